"""`make_policy`: the one way a rollout engine is started, whoever starts it (the trainer, the evaluation,
`agentrl rollout`, the kit's warm start).

    policy = make_policy("/path/to/model", rollout)                                # one VLLMPolicy
    policy = make_policy(model, rollout, placement=placement, version=7)           # beside the trainer, resumed
    policy = make_policy(model, rollout, ray_address="auto", engines=4)            # a RayPolicy of 4 engines
    policy = make_policy(model, rollout, lora_rank=16, adapter="runs/x/checkpoint-8")  # LoRA, resumed adapter

One rule for the engine's context (`max_model_len`): the rollout's `max_total_tokens`. The rollout loop
cuts each turn's `max_tokens` to what is left of that budget and ends an episode whose next observation
would overflow it, so no request ever needs a longer context.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.placement import Placement
from agentrl.rollout.vllm_engine import VLLMPolicy, _has_cuda
from agentrl.rollout.weight_sync import DEFAULT_WEIGHT_CHUNK_BYTES


def make_policy(
    model: str | os.PathLike[str],
    rollout: RolloutConfig,
    *,
    seed: int = 0,
    dtype: str = "auto",
    in_process: bool | None = None,
    placement: Placement | None = None,
    weight_chunk_bytes: int = DEFAULT_WEIGHT_CHUNK_BYTES,
    version: int = 0,
    ray_address: str | None = None,
    engines: int = 1,
    resources: Mapping[str, float] | Sequence[Mapping[str, float]] | None = None,
    lora_rank: int | None = None,
    adapter: str | os.PathLike[str] | None = None,
    max_loras: int = 4,
) -> Any:
    """A started policy serving `model` (a Hugging Face checkpoint directory) to rollouts under `rollout`.

    seed: the engine's sampling seed. dtype: vLLM's; "auto" on a CPU means the checkpoint's own dtype.
    in_process: the engine in this process (no engine-core process: it starts several times faster);
        None: on a CPU machine yes, on GPUs no.
    placement: the GPUs and weight transfer beside a trainer (`agentrl.rollout.placement`); None: vLLM's
        defaults. weight_chunk_bytes: one bucket of a weight push.
    version: the version of these weights (a resumed run continues its count).
    ray_address: a Ray cluster (`auto`, HOST:PORT): `engines` engines there as one `RayPolicy`, each
        asking for `resources` (`agentrl.rollout.ray_policy`); None: one engine on this machine.
    lora_rank: the engine serves LoRA adapters up to this rank (vLLM's `max_lora_rank`: the smallest
        rank it accepts that is at least this one); None: no LoRA (unless `adapter` is given).
    adapter: a LoRA adapter directory loaded at start as the current adapter, as version `version` (a
        resumed LoRA run, an evaluation of an adapter); on Ray, readable at that path on every node.
    max_loras: distinct adapters one batch may mix (vLLM's `max_loras`).
    """
    common: dict[str, Any] = {
        "seed": seed,
        "dtype": dtype,
        "max_model_len": rollout.max_total_tokens,
        "engine_kwargs": {"use_tqdm_on_load": False},  # the caller's progress bar, not vLLM's
        "version": version,
    }
    if lora_rank is not None or adapter is not None:
        common.update(
            lora_rank=lora_rank, adapter=None if adapter is None else str(adapter), max_loras=max_loras
        )
    # An engine started by a torchrun rank must not join the rank's rendezvous (its engine core and
    # workers would read torchrun's variables); elsewhere there is nothing to hide.
    with without_torchrun_env():
        if ray_address is not None:
            from agentrl.rollout.ray_policy import RayPolicy

            return RayPolicy(model, engines=engines, address=ray_address, resources=resources, **common)
        return VLLMPolicy(
            model,
            in_process=not _has_cuda() if in_process is None else in_process,
            weight_bucket_bytes=weight_chunk_bytes,
            **(placement.engine_kwargs() if placement is not None else {}),
            **common,
        )


@contextlib.contextmanager
def without_torchrun_env() -> Iterator[None]:
    """Hide torchrun's rendezvous variables from processes spawned inside (the vLLM engine core)."""
    keys = [k for k in os.environ if k in _TORCHRUN_VARS or k.startswith("TORCHELASTIC_")]
    saved = {k: os.environ.pop(k) for k in keys}
    try:
        yield
    finally:
        os.environ.update(saved)


_TORCHRUN_VARS = {
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_WORLD_SIZE",
    "ROLE_NAME",
}
