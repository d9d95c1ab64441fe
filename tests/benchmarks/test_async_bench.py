"""Smoke run of `benchmarks/async.py --quick`: the synchronous arm and async k = 2 with overlapping batches,
each a real `agentrl train` on the long-tailed env, then one paired evaluation of both final models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "async.py"


@pytest.mark.vllm
@pytest.mark.slow
def test_quick_mode_trains_each_arm_and_pairs_their_evaluations(tmp_path: Path) -> None:
    out_file = tmp_path / "async.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--nproc",  # one training process: no torchrun, and the engine in the trainer's process
            "1",
            "--scale-s",
            "0.02",
            "--cap-s",
            "0.5",
            "--out",
            str(out_file),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out_file.read_text())
    sync, k2 = result["arms"]
    assert (sync["arm"], k2["arm"]) == ("sync", "k2")
    for arm in (sync, k2):
        assert arm["steps"] == 2 and arm["steps_per_hour"] > 0 and arm["trained_samples"] > 0
        assert 0.0 <= arm["trainer_idle_frac"] <= 1.0 and 0.0 <= arm["engine_idle_frac"] <= 1.0
    assert sync["staleness_max"] == 0.0 and k2["staleness_max"] <= 2.0
    assert set(result["eval"]["pass_at_1"]) == {"sync", "k2"}
    assert "k2" in result["eval"]["paired_vs_first"]
    assert out_file.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run([sys.executable, str(SCRIPT), "--arms", "sync,fast"], check=True, capture_output=True)
