"""Smoke run of `benchmarks/scale.py` (Docker hosts part) with a tiny budget: one JSON object of the
documented shape. The engines part is the code path tests/test_ray_policy.py covers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "scale.py"


@pytest.mark.docker
@pytest.mark.slow
def test_quick_run_reports_env_steps_for_one_and_two_hosts() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--skip-engines", "--repeats", "1", "--episodes", "2", "--steps", "1",
         "--threads", "2"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    hosts = result["docker_hosts"]
    assert set(hosts["env_steps_per_s"]) == {"1", "2"} and all(
        v > 0 for v in hosts["env_steps_per_s"].values()
    )
    assert sum(hosts["placed_on_two_hosts"]) >= 2 and min(hosts["placed_on_two_hosts"]) >= 1
    assert "date" in result and "machine" in result
