"""The trainer's side of the rollout engine around an update: sleep, wake, and the weight push.

    sync = WeightSync(placement, policy_on_rank_0_or_None, model, info, active=True)
    sync.before_update()        # a colocated engine sleeps: its weights and KV cache leave the GPU
    grpo_step(...)
    version = sync.after_update()   # wake weights -> push the new ones -> wake the KV cache

Called on every trainer rank (pushing is a collective: each rank's shard is gathered); only rank 0
holds the engine. The push depends on `agentrl.train.placement`:

- `rpc` (CPU): the full state dict is gathered to the CPU and handed to `VLLMPolicy.update_weights`,
  which streams it to the engine's workers in buckets (serialized when the engine is another
  process).
- `ipc` (colocated GPUs) and `nccl` (dedicated GPUs): vLLM's weight-transfer engines
  (`vllm.distributed.weight_transfer`). The trainer's parameters are gathered one at a time on
  their GPU, cast to bf16 and handed over as CUDA IPC handles (the engine reads them in place) or
  broadcast over an NCCL group between trainer rank 0 and the engine's workers: no CPU round trip,
  no serialization. vLLM buckets them (its packed producers bound the staging memory).

The order around an update matters with sleep mode level 2: weights are woken (allocated) before
they are loaded, and the KV cache only after, so the push never competes with the cache for memory.
Every push increments the policy's `version` once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from agentrl.train.distributed import DistInfo, full_state_dict
from agentrl.train.placement import Placement

# Module wrappers whose names must not reach the engine (activation checkpointing adds the first).
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def checkpoint_name(name: str) -> str:
    """A trainer parameter's name as the checkpoint (and vLLM's `load_weights`) knows it."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def named_trainer_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, parameter) of every parameter, shared ones (a tied head) once."""
    for name, param in model.named_parameters():
        yield checkpoint_name(name), param


def trainer_weight_source(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> Any:
    """vLLM's `WeightSource` over the (FSDP-sharded) trainer: metadata without gathering, iteration that
    gathers one full parameter at a time on its device (a collective: every rank iterates) and casts it
    to `dtype`, the wire and engine dtype."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource, materialize_full_tensor

    class TrainerWeights(WeightSource):
        def metadata(self) -> list[Any]:
            # A DTensor's shape is the global one: no gather needed here.
            return [ParamMeta(name, dtype, tuple(p.shape)) for name, p in named_trainer_parameters(model)]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for name, p in named_trainer_parameters(model):
                yield name, materialize_full_tensor(p.detach()).to(dtype)

    return TrainerWeights()


class WeightSync:
    """Sleep/wake of the engine around each update, and the push of the new weights (see the module doc)."""

    def __init__(
        self,
        placement: Placement,
        policy: Any | None,
        model: nn.Module,
        info: DistInfo,
        *,
        active: bool = True,
    ):
        if info.is_main and active and policy is None:
            raise ValueError("WeightSync on rank 0 needs the policy it pushes to")
        self.placement = placement
        self.policy = policy if info.is_main else None
        self.model = model
        self.info = info
        self.active = active  # False when nothing generates (replayed trajectories): no push, no sleep
        self._sender: Any = None
        self._asleep = False

    def before_update(self) -> None:
        """Rank 0: put a colocated engine to sleep so the update has its memory."""
        if self.active and self.placement.sleep and self.policy is not None and not self._asleep:
            self.policy.sleep(level=2)
            self._asleep = True

    def after_update(self) -> int | None:
        """Every rank: wake the engine's weights, push the new ones, wake its KV cache. Returns the policy
        version on rank 0 (None elsewhere, or when inactive)."""
        if not self.active:
            return None
        if self.placement.colocated and torch.cuda.is_available():
            # The engine maps its memory with its own allocator: blocks PyTorch freed but still caches
            # (this update's activations) must go back to the driver before the engine wakes.
            torch.cuda.empty_cache()
        if self._asleep and self.policy is not None:
            self.policy.wake_up(["weights"])
        self.push()
        if self._asleep and self.policy is not None:
            self.policy.wake_up(["kv_cache"])
            self._asleep = False
        return None if self.policy is None else int(self.policy.version)

    def push(self) -> None:
        """Every rank: the trainer's weights into the engine (one version)."""
        if self.placement.transport == "rpc":
            sd = full_state_dict(self.model)  # collective: every rank gathers
            if self.policy is not None:
                self.policy.update_weights(sd)
            return
        sender = self._ensure_sender()
        if self.policy is None:
            sender.send_weights()  # this rank's share of the gathers (and its IPC handles)
            return
        with self.policy.pushing_weights():
            sender.send_weights()

    def _ensure_sender(self) -> Any:
        if self._sender is not None:
            return self._sender
        try:
            from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        except ImportError as exc:
            raise RuntimeError(
                f"the {self.placement.transport} weight transfer needs vLLM >= 0.32 "
                "(vllm.distributed.weight_transfer); pip install 'agentrl[gpu]'"
            ) from exc
        client = self.policy.weight_sync_client() if self.policy is not None else None
        source = trainer_weight_source(self.model)
        if self.placement.transport == "ipc":
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            # Packed: the handles point into a bounded staging buffer, not a bf16 copy of the whole model.
            init: Any = IPCTrainerInitInfo(rank=self.info.rank, packed=True)
        else:
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            from agentrl.train.distributed import _free_port

            init = NCCLTrainerInitInfo(
                rank=self.info.rank,
                master_address="127.0.0.1",
                master_port=_free_port() if self.info.is_main else 0,
                world_size=1 + len(self.placement.engine_gpus),  # trainer rank 0 + the engine's workers
            )
        self._sender = WeightTransferTrainerFactory.trainer_init(init, client=client, source=source)
        return self._sender

    def close(self) -> None:
        if self._sender is not None:
            self._sender.shutdown()
            self._sender = None
