"""Smoke run of `benchmarks/robustness.py` with a tiny budget: one JSON object of the documented shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "robustness.py"


@pytest.mark.docker
@pytest.mark.slow
def test_quick_run_reports_bounded_reads_and_the_call_limit() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--reps", "1", "--backends", "docker", "--skip-signals"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    reads = result["reads"]["docker"]
    assert set(reads) == {"/dev/zero", "/dev/urandom", "big.txt"}
    for path in ("/dev/zero", "/dev/urandom"):
        assert "not a regular file" in reads[path]["observation_start"]
        assert reads[path]["python_peak_bytes"] < 1 << 20
    assert result["step_limits"]["calls_run"] == 4 and result["step_limits"]["calls_not_run"] == 4
    assert "signals" not in result
