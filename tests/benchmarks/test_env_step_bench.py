"""Smoke run of `benchmarks/env_step.py` with a tiny budget: one JSON object of the documented shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "env_step.py"


@pytest.mark.docker
@pytest.mark.slow
def test_quick_run_prints_levels_with_throughput_and_time_shares() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--envs", "1,2", "--episodes", "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert result["env"] == "agentrl/calc-v0" and [lv["envs"] for lv in result["levels"]] == [1, 2]
    for level in result["levels"]:
        assert level["steps"] == 2 * level["episodes"]  # the calc oracle: one python call, one submit
        assert level["steps_per_s"] > 0
        assert (
            0 <= level["sandbox_share"] <= 1 and abs(level["sandbox_share"] + level["ours_share"] - 1) < 1e-6
        )
