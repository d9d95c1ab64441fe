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
from agentrl.rollout.placement import Placement
from agentrl.rollout.policy import HFPolicy, SamplingConfig, VLLMPolicy
from agentrl.rollout.weight_sync import EngineWeightSyncClient, WeightSync, _pickled_handles, checkpoint_name
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

    def sleep(self, level: int = 2, wait_s: float = 300.0) -> None:
        self.policy.sleep(level, wait_s=wait_s)
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

    from agentrl.rollout.weight_sync import trainer_weight_source

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
    import agentrl.rollout.vllm_engine

    monkeypatch.setattr(agentrl.rollout.vllm_engine, "_has_cuda", lambda: False)
    with pytest.raises(ValueError, match="need CUDA GPUs"):
        VLLMPolicy(tiny_model_dir, in_process=True, devices=[0])


# --- chunked pushes, repeated sleep/wake, bounded sleep, several ranks ----------------------------------


@pytest.mark.vllm  # imports vLLM's producer
def test_the_chunk_plan_is_the_one_vllms_producer_cuts_and_the_buffer_holds_the_largest_tensor(
    tiny_model_dir,  # noqa: F811
    monkeypatch,
) -> None:
    """Ranks that do not stage follow `chunk_plan`; vLLM's producer (run here on host memory) must cut the
    same chunks, or the per-chunk collectives of the two kinds of rank would not pair up."""
    import vllm.distributed.weight_transfer.packed_tensor as packed_tensor
    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer.base import ParamMeta

    from agentrl.rollout.weight_sync import _unstaged_chunks, chunk_plan, staging_bytes
    from tests.train.rank_cases import _CpuTorch

    monkeypatch.setattr(packed_tensor, "torch", _CpuTorch())
    monkeypatch.setattr(packed_tensor, "reduce_tensor", lambda t: (None, ("host", 0)))
    weights = [(n, t.to(torch.bfloat16)) for n, t in load_file(tiny_model_dir / "model.safetensors").items()]
    meta = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in weights]
    model_bytes = sum(t.numel() * 2 for _, t in weights)
    chunk = 1 << 19  # 512 KiB: the tiny model's bf16 weights (7 MB) take many chunks
    buffer = staging_bytes(meta, chunk)
    largest = max(t.numel() * 2 for _, t in weights)
    assert buffer == largest > chunk  # the embedding (1.3 MB) travels whole: the buffer grows to it
    plan = chunk_plan(meta, buffer)
    assert len(plan) > 3 and sum(len(c) for c in plan) == len(weights) and buffer < model_bytes
    produced = [
        c.names for c in packed_tensor.packed_ipc_producer(iter(weights), "GPU-0", lambda i: i[1], buffer)
    ]
    unstaged = list(_unstaged_chunks(iter(weights), buffer))
    assert produced == plan == [c.names for c in unstaged]
    assert all(c.ipc_handle == {} for c in unstaged)
    # Qwen2.5-7B's embedding (152064 x 3584 bf16) is over vLLM's 1 GiB default buffer, which would refuse it.
    embedding = ParamMeta("model.embed_tokens.weight", torch.bfloat16, (152064, 3584))
    assert staging_bytes([embedding], 1 << 30) == 152064 * 3584 * 2 > 1 << 30


@pytest.mark.vllm
@pytest.mark.slow
def test_repeated_sleep_wake_with_generation_between_and_pushes_in_chunks(
    tiny_model_dir,  # noqa: F811
    other_model_dir,
    one_rank_group,  # noqa: F811
    monkeypatch,
) -> None:
    """Three updates on the real CPU engine, each sleep -> wake weights -> push in chunks smaller than the
    model -> wake KV cache, with generation before and after: the engine samples the pushed model every
    time, and the version counts the pushes."""
    from transformers import AutoModelForCausalLM

    import agentrl.rollout.vllm_engine as engine_mod

    buckets: list[int] = []
    real_buckets = engine_mod.buckets

    def counted(named, limit, serialize):
        out = real_buckets(named, limit, serialize)
        buckets.append(len(out))
        return out

    monkeypatch.setattr(engine_mod, "buckets", counted)
    chunk = 1 << 20  # 1 MiB, the tiny model is 14 MB in fp32
    policy = VLLMPolicy(
        tiny_model_dir, in_process=True, dtype="float32", max_model_len=256, weight_bucket_bytes=chunk
    )
    try:
        refs = {
            d: HFPolicy(d).generate_sync(PROMPT, GREEDY).token_ids for d in (tiny_model_dir, other_model_dir)
        }
        assert refs[tiny_model_dir] != refs[other_model_dir]  # the two models are told apart by their samples
        assert asyncio.run(policy.generate(PROMPT, GREEDY)).token_ids == refs[tiny_model_dir]
        for cycle, target in enumerate((other_model_dir, tiny_model_dir, other_model_dir), start=1):
            trainer = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
            sync = WeightSync(SLEEPING, policy, trainer, one_rank_group, chunk_bytes=chunk)
            sync.before_update()
            assert policy.sleeping
            assert sync.after_update() == cycle and not policy.sleeping
            gen = asyncio.run(policy.generate(PROMPT, GREEDY))
            assert gen.token_ids == refs[target], (
                f"cycle {cycle}: the engine does not sample the pushed model"
            )
            assert gen.policy_version == gen.policy_version_end == cycle
        assert buckets and all(n > 5 for n in buckets), buckets  # every push went in several chunks
    finally:
        policy.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_sleep_waits_a_bounded_time_for_running_requests_then_says_so(tiny_model_dir) -> None:  # noqa: F811
    from agentrl.rollout.policy import EngineBusyError

    policy = VLLMPolicy(tiny_model_dir, in_process=True, dtype="float32", max_model_len=4096)
    try:
        assert policy.unfinished_requests() == 0
        long = SamplingConfig(temperature=0.0, max_tokens=3000, ignore_eos=True)
        done: dict[str, Any] = {}
        worker = threading.Thread(
            target=lambda: done.setdefault("gen", asyncio.run(policy.generate(PROMPT, long)))
        )
        worker.start()
        deadline = time.monotonic() + 30
        while policy.unfinished_requests() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.monotonic()
        with pytest.raises(EngineBusyError) as err:
            policy.sleep(2, wait_s=0.5)
        assert time.monotonic() - t0 < 5  # bounded: not the request's remaining minute
        message = str(err.value)
        assert "\n" not in message and "still runs 1 request(s) 0.5 s after it was asked to sleep" in message
        assert "engine.sleep_wait_s" in message
        assert not policy.sleeping  # the engine stays awake: the request goes on
        worker.join(timeout=300)
        assert len(done["gen"].token_ids) == 3000 and done["gen"].stop_reason == "length"
        policy.sleep(2, wait_s=0.5)  # nothing runs now: it sleeps at once
        assert policy.sleeping
        policy.wake_up()
        assert not policy.sleeping
        assert asyncio.run(policy.generate(PROMPT, GREEDY)).token_ids
    finally:
        policy.close()


@pytest.mark.vllm
@pytest.mark.parametrize(("engine_gpus", "stagers"), [("0", [0]), ("0,1", [0, 1])])
def test_ipc_push_over_two_gloo_ranks_stages_only_where_the_engine_reads(
    tiny_model_dir,  # noqa: F811
    tmp_path,
    engine_gpus: str,
    stagers: list[int],
) -> None:
    """`StagedIPCSender` on two ranks (FSDP gathers, the handle all-gather, a barrier per chunk) with vLLM's
    own producer on host memory, in chunks of 512 KiB, twice. A one-GPU engine: rank 1 never allocates a
    staging buffer; a tensor-parallel one on both GPUs: both stage, and each worker loads every weight."""
    from tests.train.rank_cases import launch

    res = launch("ipc_push", tmp_path, str(tiny_model_dir), engine_gpus, str(1 << 19))
    assert res[-1]["returncode"] == 0, (res.get(0), res.get(1), res[-1]["stderr"])
    r0, r1 = res[0], res[1]
    assert [r0["stages"], r1["stages"]] == [0 in stagers, 1 in stagers]
    assert [r0["staged"], r1["staged"]] == [2 if r in stagers else 0 for r in (0, 1)]  # one buffer per push
    assert r0["chunks_sent"] == r1["chunks_sent"] > 3
    assert r0["engine_chunks"] == 2 * r0["chunks_sent"]
    assert r0["versions"] == [1, 2] and r1["versions"] == [None, None]
    assert all(wrong == [] for wrong in r0["wrong"].values()), r0["wrong"]
    assert set(r0["wrong"]) == {f"GPU-{g}" for g in stagers}
    assert r0["calls"][:2] == ["sleep", "wake_up:weights"] and r0["calls"][0:7].count("start") == 1


@pytest.mark.vllm
@pytest.mark.slow
def test_rpc_push_from_two_gloo_ranks_into_an_engine_process_in_chunks(
    tiny_model_dir,  # noqa: F811
    other_model_dir,
    tmp_path,
) -> None:
    """The CPU trainer's push with --nproc 2: every rank gathers, rank 0 streams serialized buckets smaller
    than the model into the engine's own process; sleep and wake around it, twice."""
    from tests.train.rank_cases import launch

    res = launch("rpc_push", tmp_path, str(tiny_model_dir), str(other_model_dir), str(1 << 20))
    assert res[-1]["returncode"] == 0, (res.get(0), res.get(1), res[-1]["stderr"])
    assert res[0]["versions"] == [1, 2] and res[1]["versions"] == [None, None]
    assert res[0]["generated"] == res[0]["expected"]
    assert res[0]["expected"][0] != res[0]["expected"][1]


@pytest.mark.vllm
def test_the_nccl_endpoint_listens_before_its_port_is_announced(monkeypatch) -> None:
    """The port the engine's workers are told is held by the rendezvous from the start: nobody else can bind it,
    and a worker that joins through it meets the trainer."""
    import errno
    import socket

    import vllm.distributed.device_communicators.pynccl as pynccl
    from vllm.distributed.utils import StatelessProcessGroup

    from agentrl.rollout import weight_sync

    made: dict[str, Any] = {}

    class FakeCommunicator:
        def __init__(self, group, device):
            made["group"], made["device"] = group, device

    monkeypatch.setattr(pynccl, "PyNcclCommunicator", FakeCommunicator)
    monkeypatch.setattr(weight_sync, "_current_gpu", lambda: 0)

    class Client:
        def init_weight_transfer_engine(self, init_info: dict) -> None:
            made["init"] = init_info
            port = init_info["master_port"]
            with socket.socket() as s:
                with pytest.raises(OSError) as err:
                    s.bind(("127.0.0.1", port))
                made["bind_errno"] = err.value.errno
            worker = StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=1, world_size=2)
            made["worker_rank"] = worker.rank

    engine = weight_sync.nccl_sender(client=Client(), source=None, world_size=2, chunk_bytes=3 << 20)
    assert made["bind_errno"] == errno.EADDRINUSE
    assert made["worker_rank"] == 1 and made["group"].world_size == 2 and made["group"].rank == 0
    assert engine.model_update_group is not None and engine.packed_buffer_size_bytes == 3 << 20
    assert made["init"]["packed"] is True and made["init"]["packed_buffer_size_bytes"] == 3 << 20
    assert made["init"]["rank_offset"] == 1 and made["init"]["world_size"] == 2
