"""`make_policy`'s pieces that need no engine: where the placement puts it, and the torchrun variables it
hides. The engine it starts is tested in tests/rollout/test_policy.py (one engine) and
tests/rollout/test_ray_policy.py (engines on a Ray cluster)."""

from __future__ import annotations

import os

import pytest

from agentrl.rollout.engine import without_torchrun_env
from agentrl.rollout.placement import plan_placement


def test_the_placement_becomes_the_engines_gpu_arguments() -> None:
    assert plan_placement(gpus=0, nproc=2).engine_kwargs() == {}  # CPU: vLLM's defaults
    assert plan_placement(gpus=1, nproc=1).engine_kwargs() == {
        "devices": [0],
        "gpu_memory_utilization": 0.4,
        "sleep_mode": True,
        "weight_transfer": "ipc",
    }
    assert plan_placement(gpus=4, nproc=2, devices=[2, 3], asynchronous=True).engine_kwargs() == {
        "devices": [2, 3],
        "gpu_memory_utilization": 0.9,
        "sleep_mode": False,
        "weight_transfer": "nccl",
    }


def test_torchrun_variables_are_hidden_while_an_engine_starts_and_restored_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in {
        "RANK": "1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "r",
        "HOME_LIKE": "kept",
    }.items():
        monkeypatch.setenv(key, value)
    with without_torchrun_env():
        assert not {"RANK", "MASTER_PORT", "TORCHELASTIC_RUN_ID"} & set(os.environ)
        assert os.environ["HOME_LIKE"] == "kept"
    assert (os.environ["RANK"], os.environ["MASTER_PORT"], os.environ["TORCHELASTIC_RUN_ID"]) == (
        "1",
        "29500",
        "r",
    )
