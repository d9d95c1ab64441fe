"""Smoke run of `benchmarks/shared_prefix.py`: both arms step, the prefixes save tokens, the weights agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "shared_prefix.py"


@pytest.mark.slow
def test_the_shared_prefix_arm_runs_fewer_tokens_to_the_same_weights() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--groups", "2", "--group-size", "4", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)  # stdout holds the JSON object only
    batch = result["batch"]
    assert batch["trajectories"] == 8
    # Every calc-v0 episode starts with the same system prompt: held once per micro-batch.
    assert 0 < batch["tokens_shared"] < 0.8 * batch["tokens_whole"]
    assert set(result["step_s"]) == {"off", "on"} and all(v > 0 for v in result["step_s"].values())
    assert result["max_param_difference_after_steps"] < 1e-5  # the same update, rounded otherwise
