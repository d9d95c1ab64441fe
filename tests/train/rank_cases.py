"""Bodies of the multi-rank tests, one function per case, run on every rank under torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.train.rank_cases CASE OUT [ARG ...]

Each rank writes what it saw to OUT/rank-<rank>.json (`{"error": ...}` when the case raised), and the test
reads those files. The CPU cases run on gloo; the `gpu_` cases need CUDA GPUs (and vLLM's CUDA build).
Not a test module itself (pytest collects test_*.py only).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import torch
import torch.distributed as dist

GREEDY_TOKENS = 8
PROMPT = [5, 6, 7, 8, 9, 10]
ROOT = Path(__file__).resolve().parents[2]


def launch(
    case: str, out: Path, *args: str, nproc: int = 2, cpu: bool = True, timeout: float = 600
) -> dict[int, dict]:
    """Run `case` on `nproc` ranks (gloo on the CPU unless `cpu` is False); every rank's JSON, by rank."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
         "-m", "tests.train.rank_cases", case, str(out), *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
    )  # fmt: skip
    (out / "stderr.txt").write_text(proc.stderr)  # the whole of it: a failing test shows only its end
    results = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("rank-*.json")}
    results[-1] = {"returncode": proc.returncode, "stderr": proc.stderr[-4000:]}
    return results


def launch_nodes(
    case: str, out: Path, *args: str, nnodes: int = 2, nproc: int = 2, timeout: float = 300
) -> dict[int, dict]:
    """`case` on `nnodes` "nodes" of `nproc` ranks each, all on this machine (static rendezvous, as
    `agentrl train --nnodes` starts them); every rank's JSON, by global rank."""
    from agentrl.train.distributed import _free_port

    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    port = _free_port()
    rendezvous = ["--rdzv-backend=static", f"--rdzv-endpoint=127.0.0.1:{port}", "--master-addr=127.0.0.1",
                  f"--master-port={port}", f"--nproc-per-node={nproc}"]  # fmt: skip
    nodes = []
    for node in range(nnodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node}",
               *rendezvous, "-m", "tests.train.rank_cases", case, str(out), *args]  # fmt: skip
        nodes.append(
            subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
            )
        )
    errors = [p.communicate(timeout=timeout)[1] for p in nodes]
    results = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("rank-*.json")}
    results[-1] = {
        "returncode": max(p.returncode for p in nodes),
        "stderr": "\n".join(e[-2000:] for e in errors),
    }
    return results


# --- CPU cases (gloo) ---------------------------------------------------------------------------------


def wait_for_main_case(out: Path, use_wait: str) -> dict:
    """Rank 0 works alone for longer than the collective timeout, then broadcasts; the others either wait on
    the store first (`use_wait` = "wait") or sit in the broadcast itself ("bare")."""
    from agentrl.train.distributed import init_distributed, wait_for_main

    info = init_distributed(timeout_s=2.0)
    dist.barrier()  # both arrive together: the communicator exists before the timed part
    if info.is_main:
        time.sleep(6.0)  # a rollout, an engine start-up: three times the collective timeout
    payload: list[Any] = [{"batch": 42} if info.is_main else None]
    t0 = time.monotonic()
    if use_wait == "wait":
        wait_for_main("batch-0")
    dist.broadcast_object_list(payload, src=0)
    return {"got": payload[0], "waited_s": time.monotonic() - t0}


def dist_info_case(out: Path) -> dict:
    from agentrl.train.distributed import init_distributed

    info = init_distributed()
    return {
        "rank": info.rank,
        "world_size": info.world_size,
        "local_rank": info.local_rank,
        "local_world_size": info.local_world_size,
        "node_rank": info.node_rank,
    }


class _CpuTorch:
    """`torch` as vLLM's packed IPC producer sees it, on a machine without CUDA: the staging buffer in host
    memory, stream synchronisation a no-op. Everything else is torch itself."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def empty(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.empty(*args, **kwargs)

    cuda = SimpleNamespace(current_stream=lambda: SimpleNamespace(synchronize=lambda: None))


class FakeIPC:
    """Host-memory stand-ins for CUDA IPC: `reduce_tensor` registers the staging buffer and hands out a key,
    and the engine's side opens it by that key. Counts how often this rank staged."""

    buffers: ClassVar[dict[int, torch.Tensor]] = {}  # every buffer this process staged, by key

    def __init__(self) -> None:
        self.staged = 0

    def reduce_tensor(self, tensor: torch.Tensor) -> tuple[Any, tuple]:
        self.staged += 1
        key = int(os.environ["RANK"]) * 1_000_000 + self.staged
        FakeIPC.buffers[key] = tensor
        return None, ("fake-ipc", os.getpid(), key)


class EngineOnCpu:
    """Rank 0's engine for the IPC case: a weight-sync client that reads each chunk the way vLLM's worker does
    (the handle of its own GPU, `unpack_tensor` at the given sizes) and keeps the weights it loaded."""

    def __init__(self, engine_gpus: list[str], stagers: dict[str, dict[int, torch.Tensor]]):
        self.engine_gpus = engine_gpus
        self.stagers = stagers  # GPU UUID -> that rank's buffers (shared in-process for rank 0 only)
        self.loaded: dict[str, dict[str, torch.Tensor]] = {g: {} for g in engine_gpus}
        self.calls: list[str] = []
        self.chunks = 0
        self.version = 0
        self.sleeping = False

    # VLLMPolicy's side
    def sleep(self, level: int = 2, wait_s: float = 300.0) -> None:
        self.calls.append("sleep")
        self.sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(f"wake_up:{','.join(tags or [])}")
        if tags == ["kv_cache"]:
            self.sleeping = False

    def weight_sync_client(self) -> EngineOnCpu:
        return self

    @contextmanager
    def pushing_weights(self) -> Iterator[None]:
        yield
        self.version += 1

    # VLLMWeightSyncClient's side
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.calls.append(f"init:{init_info}")

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update_info: dict) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

        self.chunks += 1
        handles = update_info["ipc_handles"]
        for gpu in self.engine_gpus:
            _, pid, key = handles[gpu]  # each worker opens its own GPU's buffer, as vLLM's does
            buffer = self.stagers[gpu][key]
            dtypes = [getattr(torch, d) for d in update_info["dtype_names"]]
            content = buffer[: sum(update_info["tensor_sizes"])]
            for name, t in unpack_tensor(
                content, update_info["names"], update_info["shapes"], dtypes, update_info["tensor_sizes"]
            ):
                self.loaded[gpu][name] = t.clone()

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")


def ipc_push_case(out: Path, model_dir: str, engine_gpus: str, chunk_bytes: str) -> dict:
    """Two trainer ranks push through `StagedIPCSender` with vLLM's real producer on host memory: rank r is on
    "GPU-r"; the engine reads `engine_gpus`. Two pushes, each in chunks smaller than the model."""
    import vllm.distributed.weight_transfer.packed_tensor as packed_tensor
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from agentrl.rollout import weight_sync
    from agentrl.rollout.placement import Placement
    from agentrl.train.distributed import init_distributed, shard_model

    info = init_distributed()
    fake = FakeIPC()
    packed_tensor.torch = _CpuTorch()  # type: ignore[assignment]
    packed_tensor.reduce_tensor = fake.reduce_tensor  # type: ignore[assignment]
    weight_sync._gpu_uuid = lambda: f"GPU-{info.local_rank}"  # type: ignore[assignment]
    gpus = [int(g) for g in engine_gpus.split(",")]
    placement = Placement(
        (0, 1), tuple(gpus), colocated=True, sleep=True, transport="ipc", gpu_memory_utilization=0.4
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    shard_model(model, bf16=False)
    # Only one process can be "the engine": rank 0 reads a rank 1 buffer through a copy sent to it, below.
    engine = EngineOnCpu([f"GPU-{g}" for g in gpus], {f"GPU-{info.local_rank}": FakeIPC.buffers})
    sync = weight_sync.WeightSync(
        placement, engine if info.is_main else None, model, info, chunk_bytes=int(chunk_bytes)
    )
    if info.is_main and 1 in gpus:
        # Rank 1's buffer lives in rank 1's process: hand its staged bytes over, as IPC would map them.
        original = engine.update_weights

        def update_with_remote(update_info: dict) -> None:
            remote: list[Any] = [None]
            dist.recv_object_list(remote, src=1)
            engine.stagers["GPU-1"] = {update_info["ipc_handles"]["GPU-1"][2]: remote[0]}
            original(update_info)

        engine.update_weights = update_with_remote  # type: ignore[method-assign]
    elif 1 in gpus and info.rank == 1:
        real_merged = weight_sync.StagedIPCSender._merged

        def merged_and_sent(handle: dict) -> dict:
            result = real_merged(handle)
            key = handle["GPU-1"][2]
            dist.send_object_list([FakeIPC.buffers[key].clone()], dst=0)
            return result

        weight_sync.StagedIPCSender._merged = staticmethod(merged_and_sent)  # type: ignore[assignment]
    versions = []
    for _ in range(2):
        sync.before_update()
        versions.append(sync.after_update())
    result: dict[str, Any] = {
        "staged": fake.staged,
        "stages": sync.beside_engine,
        "chunks_sent": sync._sender.chunks_sent,
        "versions": versions,
    }
    if info.is_main:
        saved = load_file(Path(model_dir) / "model.safetensors")
        wrong = {
            gpu: sorted(
                n
                for n in saved
                if not torch.equal(loaded.get(n, torch.empty(0)), saved[n].to(torch.bfloat16))
            )
            for gpu, loaded in engine.loaded.items()
        }
        result.update(
            engine_chunks=engine.chunks,
            calls=engine.calls,
            wrong=wrong,
            n_params=len(saved),
            model_bytes=sum(t.numel() * 2 for t in saved.values()),
        )
    sync.close()
    return result


def rpc_push_case(out: Path, model_a: str, model_b: str, chunk_bytes: str) -> dict:
    """Two trainer ranks, rank 0 holding a real vLLM engine in its own process: sleep, push in chunks smaller
    than the model (serialized buckets), wake, generate; twice, with model b then model a."""
    from transformers import AutoModelForCausalLM

    from agentrl.rollout.engine import without_torchrun_env
    from agentrl.rollout.placement import Placement
    from agentrl.rollout.policy import HFPolicy, SamplingConfig, VLLMPolicy
    from agentrl.rollout.weight_sync import WeightSync
    from agentrl.train.distributed import init_distributed, shard_model

    info = init_distributed()
    greedy = SamplingConfig(temperature=0.0, max_tokens=GREEDY_TOKENS)
    sleeping = Placement((), (), colocated=True, sleep=True, transport="rpc", gpu_memory_utilization=None)
    policy = None
    if info.is_main:
        with without_torchrun_env():
            policy = VLLMPolicy(
                model_a,
                in_process=False,
                dtype="float32",
                max_model_len=256,
                weight_bucket_bytes=int(chunk_bytes),
            )
    result: dict[str, Any] = {"generated": [], "expected": [], "versions": []}
    try:
        for target in (model_b, model_a):
            model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
            shard_model(model, bf16=False)
            sync = WeightSync(sleeping, policy, model, info, chunk_bytes=int(chunk_bytes))
            sync.before_update()
            result["versions"].append(sync.after_update())
            if policy is not None:
                result["generated"].append(asyncio.run(policy.generate(PROMPT, greedy)).token_ids)
                result["expected"].append(HFPolicy(target).generate_sync(PROMPT, greedy).token_ids)
            dist.barrier()
    finally:
        if policy is not None:
            policy.close()
    return result


# --- GPU cases (NCCL, vLLM's CUDA build) --------------------------------------------------------------


def gpu_ipc_push_case(out: Path, model_a: str, model_b: str, engine_gpus: str, chunk_mib: str) -> dict:
    """Two trainer ranks on GPUs 0 and 1, the engine colocated on `engine_gpus` (one GPU, or both: tensor
    parallelism). Three sleep -> push -> wake cycles with generation between, alternating the weights."""
    from transformers import AutoModelForCausalLM

    from agentrl.rollout.engine import without_torchrun_env
    from agentrl.rollout.placement import plan_placement
    from agentrl.rollout.policy import HFPolicy, SamplingConfig, VLLMPolicy
    from agentrl.rollout.weight_sync import WeightSync
    from agentrl.train.distributed import init_distributed, shard_model

    info = init_distributed()
    devices = [int(g) for g in engine_gpus.split(",")]
    placement = plan_placement(gpus=torch.cuda.device_count(), nproc=info.local_world_size, devices=devices,
                               gpu_memory_utilization=0.3)  # fmt: skip
    chunk = int(float(chunk_mib) * (1 << 20))
    policy = None
    if info.is_main:
        with without_torchrun_env():
            policy = VLLMPolicy(model_a, dtype="float32", max_model_len=512, weight_bucket_bytes=chunk,
                                **placement.engine_kwargs())  # fmt: skip
    greedy = SamplingConfig(temperature=0.0, max_tokens=GREEDY_TOKENS)
    result: dict[str, Any] = {
        "generated": [],
        "expected": [],
        "versions": [],
        "peak_allocated": [],
        "reserved_after": [],
    }
    try:
        for target in (model_b, model_a, model_b):
            model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to(info.device)
            shard_model(model, bf16=True)
            sync = WeightSync(placement, policy, model, info, chunk_bytes=chunk)
            torch.cuda.reset_peak_memory_stats()
            sync.before_update()
            result["versions"].append(sync.after_update())
            result["peak_allocated"].append(torch.cuda.max_memory_allocated())
            result["reserved_after"].append(torch.cuda.memory_reserved())
            result["chunks"] = sync._sender.chunks_sent
            result["stages"] = sync.beside_engine
            if policy is not None:
                result["generated"].append(asyncio.run(policy.generate(PROMPT, greedy)).token_ids)
                result["expected"].append(
                    HFPolicy(_bf16_rounded(target)).generate_sync(PROMPT, greedy).token_ids
                )
            sync.close()
            del model, sync
            dist.barrier()
    finally:
        if policy is not None:
            policy.close()
    return result


def _bf16_rounded(model_dir: str) -> Any:
    """The fp32 model whose weights went through bf16: what the engine holds after a bf16 push."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


CASES: dict[str, Callable[..., dict]] = {
    "wait_for_main": wait_for_main_case,
    "dist_info": dist_info_case,
    "ipc_push": ipc_push_case,
    "rpc_push": rpc_push_case,
    "gpu_ipc_push": gpu_ipc_push_case,
}


def main() -> None:
    case, out, *args = sys.argv[1:]
    rank = os.environ.get("RANK", "0")
    try:
        result = CASES[case](Path(out), *args)
    except BaseException as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    Path(out, f"rank-{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        if "error" not in result:
            with contextlib.suppress(Exception):  # a peer that failed has left already: nothing to wait for
                dist.barrier()  # leave together: no rank tears its connections down while a peer still works
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is on disk: skip the interpreter's teardown, where a torch or vLLM thread left running
    # can abort the process ("terminate called without an active exception") after the case passed.
    os._exit(1 if "error" in result else 0)


if __name__ == "__main__":
    main()
