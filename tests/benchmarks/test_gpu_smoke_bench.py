"""Smoke run of `benchmarks/gpu_smoke.py --tiny` on the CPU: every step runs, and the JSON names every number
the GPU run will produce."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_smoke.py"


def smoke_module():
    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_run_names_every_number_for_both_shapes() -> None:
    smoke = smoke_module()
    names = smoke.gpu_numbers()
    for shape in ("0.5B", "1.5B"):
        for what in ("ours/tokens_per_s", "ours/mfu", "ours/peak_memory_gib", "speedup_vs_plain", "long_fits",
                     "activation_checkpointing_memory_cut"):  # fmt: skip
            assert f"train_gpu/{shape}/{what}" in names
    for name in ("gpu_tests/passed", "gpu_tests/failed", "agentrl_train/weight_sync_s_median",
                 "agentrl_train/peak_gpu_memory_gib", "agentrl_train/policy_version"):  # fmt: skip
        assert name in names
    assert all(isinstance(v, str) and v for v in names.values())
    assert "{shape}" not in "".join(names)


@pytest.mark.vllm
@pytest.mark.slow
def test_tiny_mode_runs_every_step_and_fills_the_numbers_a_cpu_can_measure(tmp_path: Path) -> None:
    out_file = tmp_path / "gpu_smoke.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--out", str(out_file)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)  # stdout holds the JSON object only
    assert json.loads(out_file.read_text()) == result
    assert result["benchmark"] == "gpu_smoke" and result["mode"] == "tiny" and result["device"] == "cpu"
    steps = result["steps"]
    assert set(steps) == {"gpu_tests", "train_gpu", "agentrl_train"}
    assert all(step["ok"] for step in steps.values()), {k: s.get("stderr_tail") for k, s in steps.items()}
    # On a CPU every gpu test skips (the only marker that may), and each is listed by name.
    tests = steps["gpu_tests"]["tests"]
    assert tests and all(t["outcome"] == "skipped" for t in tests.values())
    assert any("test_two_trainer_ranks_push_by_cuda_ipc" in name for name in tests)
    numbers = result["numbers"]
    assert list(numbers) == smoke_module().number_names(("tiny",))
    assert numbers["gpu_tests/skipped"] == len(tests) and numbers["gpu_tests/failed"] == 0
    assert numbers["train_gpu/tiny/ours/tokens_per_s"] > 0 and numbers["train_gpu/tiny/speedup_vs_plain"] > 0
    assert numbers["train_gpu/tiny/ours/mfu"] is None  # no peak FLOP/s for a CPU
    assert numbers["agentrl_train/steps"] == 2 and numbers["agentrl_train/policy_version"] == 2.0
    assert numbers["agentrl_train/weight_sync_s_median"] > 0 and numbers["agentrl_train/step_s_median"] > 0
    assert numbers["agentrl_train/peak_gpu_memory_gib"] is None  # nvidia-smi has nothing to say here
    assert set(result["gpu_numbers"]) >= {n.replace("/tiny/", "/1.5B/") for n in numbers}


def test_only_the_modules_with_gpu_tests_are_collected() -> None:
    """A GPU machine may lack what other modules import (openai, datasets): collecting the whole suite
    there stopped at those imports before any gpu test ran."""
    files = smoke_module().gpu_test_files()
    assert "tests/train/test_gpu.py" in files and "tests/rollout/test_ray_policy.py" in files
    assert "tests/gateway/test_server.py" not in files and "tests/env/test_tasksource.py" not in files
    for name in files:
        assert "mark.gpu" in (SCRIPT.parents[1] / name).read_text()
