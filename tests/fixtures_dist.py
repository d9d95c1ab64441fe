"""A one-rank gloo process group inside the test process, for calling FSDP2 code (grpo_step) directly.

The rendezvous variables are set with monkeypatch and the group is destroyed afterwards: a later
test that starts `python -m agentrl.train.trainer` must not inherit this process's RANK/MASTER_PORT.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from agentrl.rollout.trajectory import Trajectory
from agentrl.train.config import TrainConfig
from agentrl.train.distributed import DistInfo, _free_port, init_distributed


@pytest.fixture
def one_rank_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[DistInfo]:
    if dist.is_initialized():
        pytest.fail(
            "a process group is already initialised in this process; a test leaked one", pytrace=False
        )
    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }.items():
        monkeypatch.setenv(key, value)
    info = init_distributed()
    try:
        yield info
    finally:
        # An in-process vLLM engine joins this group and tears it down when it closes.
        if dist.is_initialized():
            dist.destroy_process_group()


def grpo_step_gradients(
    model_dir, info, cfg: TrainConfig, trajs: list[Trajectory], every_step: list[dict] | None = None
) -> tuple[dict, dict]:
    """One `grpo_step` on a fresh copy of the tiny model; the gradients its last optimizer step applied
    (those of every step appended to `every_step`), and its metrics."""
    from transformers import AutoModelForCausalLM

    from agentrl.train.compiled import resolve_compile
    from agentrl.train.distributed import shard_model
    from agentrl.train.update import grpo_step

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(info.device)
    bf16 = bool(cfg.optim.bf16)  # unset means fp32 here, on any device: the comparisons are fp32 ones
    compiled = resolve_compile(cfg.optim.compile, info.device)  # as the trainer does: on GPUs by default
    shard_model(
        model, activation_checkpointing=cfg.optim.activation_checkpointing, bf16=bf16, compiled=compiled
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    grads: dict[str, torch.Tensor] = {}

    def record(optimizer, args, kwargs):  # the gradients the optimizer is about to apply
        for name, p in model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name.replace("_checkpoint_wrapped_module.", "")] = g.detach().clone()
        if every_step is not None:
            every_step.append(dict(grads))

    opt.register_step_pre_hook(record)
    ref_model = None
    if cfg.loss.kl_coef > 0:  # the frozen start, as train() builds it
        ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(info.device)
        ref_model.eval().requires_grad_(False)
        shard_model(ref_model, bf16=bf16, compiled=compiled)
    metrics = grpo_step(model, opt, trajs, cfg, info, pad_id=0, ref_model=ref_model)
    return grads, metrics


def assert_same_gradients(a: dict, b: dict, rel: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for name in a:
        scale = a[name].abs().max().clamp_min(1e-12)
        err = ((a[name] - b[name]).abs().max() / scale).item()
        assert err < rel, f"{name}: relative difference {err:.2e}"
