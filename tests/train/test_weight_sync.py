"""The engine around an update: sleep, wake weights, push, wake KV cache, one version per push; the
trainer-side weight source vLLM's GPU transports read. Run against the real vLLM CPU engine (its sleep
mode pauses scheduling; the CUDA IPC / NCCL transports themselves are in tests/train/test_gpu.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from agentrl.kit.tiny_model import init_tiny
from agentrl.rollout.policy import (
    EngineWeightSyncClient,
    HFPolicy,
    SamplingConfig,
    VLLMPolicy,
    _pickled_handles,
)
from agentrl.train.placement import Placement
from agentrl.train.weight_sync import WeightSync, checkpoint_name
from tests.fixtures_dist import one_rank_group  # noqa: F401  (pytest fixture)
from tests.fixtures_model import tiny_model_dir  # noqa: F401  (pytest fixture)

GREEDY = SamplingConfig(temperature=0.0, max_tokens=6)
PROMPT = [5, 6, 7, 8, 9, 10]
# On the CPU the transport is rpc; sleep is forced on to run the colocated order against the real engine.
SLEEPING = Placement((), (), colocated=True, sleep=True, transport="rpc", gpu_memory_utilization=None)


class Recorder:
    """The real policy, with the calls WeightSync makes (and the engine's state at each) written down."""

    def __init__(self, policy: VLLMPolicy):
        self.policy = policy
        self.calls: list[tuple[str, Any, bool]] = []

    def sleep(self, level: int = 2) -> None:
        self.policy.sleep(level)
        self.calls.append(("sleep", level, self.policy.sleeping))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.policy.wake_up(tags)
        self.calls.append(("wake_up", tags, self.policy.sleeping))

    def update_weights(self, weights: Any) -> int:
        self.calls.append(("update_weights", len(dict(weights)), self.policy.sleeping))
        return self.policy.update_weights(weights)

    @property
    def version(self) -> int:
        return self.policy.version


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny(tmp_path_factory.getbasetemp() / "tiny-qwen2-seed1", seed=1)


def sharded(model_dir: Path, activation_checkpointing: bool = False) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from agentrl.train.distributed import shard_model

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return shard_model(model, activation_checkpointing=activation_checkpointing, bf16=False)


@pytest.mark.vllm
@pytest.mark.slow
def test_colocated_order_on_the_real_engine(tiny_model_dir, other_model_dir, one_rank_group) -> None:  # noqa: F811
    """sleep -> (a request sent now waits) -> wake weights -> push -> wake KV cache -> the request runs
    with the new weights; the version goes up by one per push."""
    policy = VLLMPolicy(tiny_model_dir, in_process=True, dtype="float32", max_model_len=256)
    try:
        spy = Recorder(policy)
        trainer = sharded(other_model_dir)  # the "updated" weights: another seed
        sync = WeightSync(SLEEPING, spy, trainer, one_rank_group)
        sync.before_update()
        assert policy.sleeping
        done: dict[str, Any] = {}
        worker = threading.Thread(
            target=lambda: done.setdefault("gen", asyncio.run(policy.generate(PROMPT, GREEDY)))
        )
        worker.start()
        time.sleep(1.0)
        assert "gen" not in done, "a sleeping engine must not generate"
        version = sync.after_update()
        worker.join(timeout=60)
        assert [(c[0], c[1]) for c in spy.calls] == [
            ("sleep", 2),
            ("wake_up", ["weights"]),
            ("update_weights", len(trainer.state_dict())),
            ("wake_up", ["kv_cache"]),
        ]
        # Weights are loaded while the KV cache still sleeps; awake only at the end.
        assert [c[2] for c in spy.calls] == [True, True, True, False]
        assert version == 1 and policy.version == 1
        gen = done["gen"]
        assert gen.policy_version_end == 1
        assert gen.token_ids == HFPolicy(other_model_dir).generate_sync(PROMPT, GREEDY).token_ids
        # A second update: one more version, the same order again.
        sync.before_update()
        assert sync.after_update() == 2
        assert [c[0] for c in spy.calls[4:]] == ["sleep", "wake_up", "update_weights", "wake_up"]
    finally:
        policy.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_an_engine_that_does_not_sleep_is_only_pushed_to(tiny_model_dir, one_rank_group) -> None:  # noqa: F811
    policy = VLLMPolicy(tiny_model_dir, in_process=True, dtype="float32", max_model_len=256)
    try:
        spy = Recorder(policy)
        awake = Placement((), (), colocated=False, sleep=False, transport="rpc", gpu_memory_utilization=None)
        sync = WeightSync(awake, spy, sharded(tiny_model_dir), one_rank_group)
        sync.before_update()
        assert sync.after_update() == 1
        assert [c[0] for c in spy.calls] == ["update_weights"]
    finally:
        policy.close()


def test_replayed_training_neither_sleeps_nor_pushes(tiny_model_dir, one_rank_group) -> None:  # noqa: F811
    calls: list[str] = []

    class Never:
        def __getattr__(self, name: str) -> Any:
            calls.append(name)
            raise AssertionError(f"WeightSync touched the policy ({name}) with nothing to push to")

    sync = WeightSync(SLEEPING, Never(), sharded(tiny_model_dir), one_rank_group, active=False)
    sync.before_update()
    assert sync.after_update() is None and calls == []


@pytest.mark.vllm
def test_trainer_weight_source_gathers_bf16_under_checkpoint_names(tiny_model_dir, one_rank_group) -> None:  # noqa: F811
    """What vLLM's IPC/NCCL trainer engines read: checkpoint names (no activation-checkpointing wrapper),
    the tied head once, bf16, global shapes; vLLM's own order checks and per-layer grouping accept it."""
    from safetensors.torch import load_file

    from agentrl.train.weight_sync import trainer_weight_source

    model = sharded(tiny_model_dir, activation_checkpointing=True)
    source = trainer_weight_source(model)
    meta = source.metadata()
    saved = load_file(tiny_model_dir / "model.safetensors")
    assert [m.name for m in meta] == [checkpoint_name(n) for n, _ in model.named_parameters()]
    assert {m.name for m in meta} == set(saved)  # the tied lm_head is not in the checkpoint either
    assert all(m.dtype == torch.bfloat16 and tuple(saved[m.name].shape) == m.shape for m in meta)
    sent = dict(source)
    for name, tensor in sent.items():
        assert torch.equal(tensor, saved[name].to(torch.bfloat16)), name
    groups = list(source.iter_groups())  # vLLM checks the iteration order against metadata() here
    n_layers = 4
    assert len(groups) == n_layers + 2  # embeddings, one group per decoder layer, final norm
    assert groups[1][0][0].startswith("model.layers.0.")


def test_wrapper_prefixes_leave_the_names() -> None:
    assert checkpoint_name("model.layers.3._checkpoint_wrapped_module.mlp.up_proj.weight") == (
        "model.layers.3.mlp.up_proj.weight"
    )


@pytest.mark.vllm
def test_the_weight_sync_client_calls_rpcs_vllm_workers_have() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    for method in (
        "init_weight_transfer_engine",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
    ):
        assert callable(getattr(Worker, method)), method
        assert callable(getattr(EngineWeightSyncClient, method))


def test_ipc_handles_travel_pickled_and_other_payloads_untouched() -> None:
    import base64
    import pickle

    info = {
        "names": ["w"],
        "dtype_names": ["bfloat16"],
        "shapes": [[2]],
        "ipc_handles": [{"GPU-x": (1, b"h")}],
    }
    out = _pickled_handles(info)
    assert (
        "ipc_handles" not in out
        and pickle.loads(base64.b64decode(out["ipc_handles_pickled"])) == info["ipc_handles"]
    )
    nccl = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]]}
    assert _pickled_handles(nccl) is nccl


def test_gpu_placement_options_are_refused_on_the_cpu(tiny_model_dir, monkeypatch) -> None:  # noqa: F811
    import agentrl.rollout.policy

    monkeypatch.setattr(agentrl.rollout.policy, "_has_cuda", lambda: False)
    with pytest.raises(ValueError, match="need CUDA GPUs"):
        VLLMPolicy(tiny_model_dir, in_process=True, devices=[0])
