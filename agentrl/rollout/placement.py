"""Where the trainer and the rollout engine run on GPUs, and how weights move between them.

    plan_placement(gpus=1, nproc=1, devices=None, ...)     # colocated: engine on GPU 0, sleeps in updates
    plan_placement(gpus=2, nproc=1, devices=[1], ...)      # dedicated: trainer GPU 0, engine GPU 1

Trainer rank r runs on visible GPU r (torchrun's local rank), so `--nproc N` takes GPUs 0..N-1 of its
node. Everything here is per node: `nproc` is the node's trainer processes (torchrun's local world size,
never the world size of all nodes) and `gpus` the node's visible GPUs, so `--nnodes 2 --nproc 8` on two
8-GPU nodes plans GPUs 0..7 on each. The vLLM engine runs beside rank 0, on node 0, on `engine.devices`,
GPU indices among the visible ones:

- none given, or trainer GPUs: **colocated**. The engine shares the trainer's memory: it takes
  `gpu_memory_utilization` of it (0.4 by default) while generating and, in synchronous mode,
  sleeps during each update (vLLM sleep mode, level 2: its weights and KV cache are released,
  then woken for the weight push and the next generation). Weights move by CUDA IPC handles:
  the engine reads the trainer's bf16 copies in place, no copy through the CPU.
- GPUs the trainer does not use: **dedicated**. The engine keeps its memory (0.9 by default);
  weights are broadcast over an NCCL group between trainer rank 0 and the engine's workers.
- no GPU: today's CPU path, `rpc` (the weights as tensors or safetensors bytes through vLLM's
  `collective_rpc`).

Both GPU transports are vLLM's own weight-transfer engines (`vllm.distributed.weight_transfer`,
vLLM >= 0.32): `agentrl.rollout.weight_sync` drives them.

Everything here is a pure function of the counts and the config, so every rank computes the same
placement, and a bad one fails before anything starts, with a message that says what to change.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

from agentrl.core.errors import UserError, check_nproc, cuda_visible_note

Transport = Literal["rpc", "ipc", "nccl"]

COLOCATED_MEMORY = 0.4
DEDICATED_MEMORY = 0.9


class PlacementError(UserError, ValueError):
    """A placement that cannot work on this machine; the message says why and what to change."""


@dataclass(frozen=True)
class Placement:
    """The outcome of `plan_placement`: GPUs of trainer and engine, and how the weights travel."""

    trainer_gpus: tuple[int, ...]  # visible-GPU index of each trainer rank; () on CPU
    engine_gpus: tuple[int, ...]  # visible-GPU indices of the engine (its tensor-parallel ranks); () on CPU
    colocated: bool  # the engine shares trainer GPUs
    sleep: bool  # the engine sleeps during each update (colocated, synchronous, `engine.sleep`)
    transport: Transport  # rpc on CPU, ipc colocated, nccl dedicated
    gpu_memory_utilization: float | None  # the engine's share of each of its GPUs; None on CPU

    @property
    def on_gpu(self) -> bool:
        return bool(self.trainer_gpus)

    def shares_engine_gpu(self, *, node_rank: int, local_rank: int) -> bool:
        """Whether trainer rank `local_rank` of node `node_rank` computes on a GPU an engine worker also uses.
        The engine runs on node 0, so only node 0's ranks on `engine_gpus` do: those alone stage weights for
        the CUDA IPC push (the engine reads no other GPU's) and give cached memory back before it wakes."""
        return self.colocated and node_rank == 0 and local_rank in self.engine_gpus

    def engine_kwargs(self) -> dict[str, Any]:
        """`VLLMPolicy` arguments that put the engine where this placement says (nothing on CPU)."""
        if not self.on_gpu:
            return {}
        return {
            "devices": list(self.engine_gpus),
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "sleep_mode": self.sleep,
            "weight_transfer": self.transport,
        }


def plan_placement(
    *,
    gpus: int,
    nproc: int,
    devices: list[int] | None = None,
    asynchronous: bool = False,
    sleep: bool = True,
    gpu_memory_utilization: float | None = None,
) -> Placement:
    """Where trainer ranks and the vLLM engine go on a node with `gpus` visible GPUs and `nproc` trainer
    processes (this node's, not all nodes'; see the module doc)."""
    check_nproc(nproc, gpus)
    if gpus == 0:
        if devices:
            raise PlacementError(
                f"engine.devices={devices} names GPUs but none is visible ({cuda_visible_note()}); "
                "remove engine.devices to run the engine on the CPU"
            )
        return Placement((), (), False, False, "rpc", None)
    trainer = tuple(range(nproc))
    if devices is None:
        engine: tuple[int, ...] = (0,)
    else:
        if not devices:
            raise PlacementError("engine.devices is empty; give GPU indices, e.g. [1], or leave it unset")
        bad = [d for d in devices if not 0 <= d < gpus]
        if bad:
            raise PlacementError(
                f"engine.devices={devices}: {bad} not among the {gpus} visible GPU(s) (indices 0..{gpus - 1}, "
                f"{cuda_visible_note()})"
            )
        if len(set(devices)) != len(devices):
            raise PlacementError(f"engine.devices={devices} repeats a GPU; list each once")
        engine = tuple(devices)
    shared = set(engine) & set(trainer)
    if shared and shared != set(engine):
        raise PlacementError(
            f"engine.devices={list(engine)} mixes trainer GPUs {sorted(shared)} (0..{nproc - 1} with --nproc "
            f"{nproc}) and free ones; put the engine entirely on trainer GPUs (colocated) or entirely off them"
        )
    colocated = bool(shared)
    memory = gpu_memory_utilization or (COLOCATED_MEMORY if colocated else DEDICATED_MEMORY)
    # The engine cannot sleep while it generates the next batch, which is what asynchronous mode does.
    return Placement(
        trainer_gpus=trainer,
        engine_gpus=engine,
        colocated=colocated,
        sleep=colocated and sleep and not asynchronous,
        transport="ipc" if colocated else "nccl",
        gpu_memory_utilization=memory,
    )


def physical_devices(indices: tuple[int, ...]) -> str:
    """`CUDA_VISIBLE_DEVICES` for a child that must see exactly these visible-GPU indices of ours."""
    current = os.environ.get("CUDA_VISIBLE_DEVICES")
    if current is None or not current.strip():
        return ",".join(str(i) for i in indices)
    ours = [d.strip() for d in current.split(",") if d.strip()]
    return ",".join(ours[i] for i in indices)
