"""Smoke run of `benchmarks/curriculum.py --quick`: every arm through the real loop, one JSON object and a PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "curriculum.py"
# pools and mgpo run through the same producer and trainer step (tests/train/test_samplers.py, test_trainer.py).
ARMS = ["band", "band-cheap", "uniform", "adaptive"]


@pytest.mark.vllm
@pytest.mark.docker  # the bwrap sandboxes run in a root file system exported from the Docker image
@pytest.mark.slow
def test_quick_run_compares_every_arm_at_equal_generation(tmp_path: Path, bwrap_path: str) -> None:
    proc = subprocess.run(
        [
            *(sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path / "bench")),
            *("--arms", ",".join(ARMS), "--env-kwargs", '{"mix": "swe-like"}'),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)  # stdout holds the JSON object only
    assert result["benchmark"] == "curriculum_band_vs_uniform" and result["quick"] is True
    assert list(result["arms"]) == ARMS and result["settings"]["env_kwargs"] == {"mix": "swe-like"}
    assert sorted(r["arm"] for r in result["runs"]) == sorted(ARMS)
    histogram = result["start_pass_rate_histogram"]  # the warm start's tasks: never / sometimes / always
    assert histogram["never"] + histogram["sometimes"] + histogram["always"] == pytest.approx(1.0, abs=0.002)
    assert sum(histogram["tasks_by_passes"]) == histogram["tasks"] == 4
    for run in result["runs"]:
        assert run["tokens"] >= result["budget_tokens"]  # each stops once its budget is generated
        assert run["evals"] and 0.0 <= run["final_pass_at_1"] <= 1.0
        assert run["steps"] and all("band_occupancy" in s for s in run["steps"])
    # The uniform arm trains on every group: the trainer's step and the weight push ran.
    (uniform,) = [r for r in result["runs"] if r["arm"] == "uniform"]
    assert all("loss" in s for s in uniform["steps"])
    (adaptive,) = [r for r in result["runs"] if r["arm"] == "adaptive"]
    assert all("level" in s for s in adaptive["steps"])
    (cheap,) = [r for r in result["runs"] if r["arm"] == "band-cheap"]
    assert cheap["curriculum"]["prior_key"] == "level"
    probes = cheap["groups_by_draw_kind"]["probe"]
    assert probes["episodes"] == cheap["curriculum"]["probe_group_size"] * probes["groups"]
    assert uniform["curriculum"]["sampler"] == "uniform" and adaptive["curriculum"]["sampler"] == "leveled"
    paired = result["paired_vs_band"]
    assert [c["baseline"] for c in paired] == ARMS[1:]
    assert all(c["model"] == "band" and 0.0 <= c["p_value"] <= 1.0 for c in paired)
    assert Path(result["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "bench" / "curriculum.json").read_text())["arms"] == result["arms"]
