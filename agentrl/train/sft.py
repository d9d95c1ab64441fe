"""Supervised fine-tuning on trajectories, with the RL trainer's loss mask: only assistant tokens train.

Used for warm starts (demonstrations from the environments' oracles) and rejection-sampling
fine-tuning (the policy's own passing trajectories). The data is `Trajectory` JSONL, so SFT
trains on exactly the token ids and mask the RL trainer would see; nothing is re-tokenized.

    agentrl sft --model runs/tiny --data demos.jsonl --out runs/sft [--nproc 2]

With `model.lora` (`--lora '{rank: 16}'`) only LoRA adapters train (`agentrl.train.lora`) and the output
is the adapter directory (peft's format, with the tokenizer).

Runs under FSDP2 (`agentrl.train.distributed`): one process, or `--nproc N` launches `torchrun`.
The loss is the mean negative log-likelihood over all assistant tokens of the global batch,
so 1 and N processes take the same steps.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from agentrl.rollout.trajectory import Trajectory, load_trajectories
from agentrl.train.batch import collate
from agentrl.train.compiled import resolve_compile
from agentrl.train.config import SFTConfig
from agentrl.train.logprobs import action_logprobs
from agentrl.train.packing import plan_micro_batches, resolve_packing, resolve_share_prefix


def lr_at(step: int, total: int, cfg: SFTConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def masked_nll_sum(
    model: torch.nn.Module,
    trajectories: list[Trajectory],
    pad_id: int,
    device: torch.device,
    *,
    packed: bool = False,
    share_prefix: bool = False,
) -> tuple[torch.Tensor, float]:
    """Sum of -log p over the assistant tokens of `trajectories`, and how many there are.

    Log-probs come from the hidden states at the assistant tokens only (`agentrl.train.logprobs`), with no
    KV cache: never a [B, T, V] fp32 tensor, and activation checkpointing can recompute the layers.
    """
    batch = collate(trajectories, pad_id).to(device)
    logp = action_logprobs(
        model, batch, packed=packed, share_prefix=share_prefix
    ).logprobs  # [B, T], 0 off the mask
    return -(logp * batch.loss_mask).sum(), float(batch.loss_mask.sum().item())


def train_sft(cfg: SFTConfig) -> Path:
    """Run SFT in this process (rank of a `torchrun` group, or a one-rank group)."""

    from agentrl.core.runlog import quiet_libraries
    from agentrl.train.checkpoint import export_model
    from agentrl.train.distributed import all_reduce_mean, global_token_scale, init_distributed
    from agentrl.train.lora import trainable_parameters

    info = init_distributed()
    quiet_libraries(None)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    data = training_data(cfg)
    base = cfg.model.path
    model, pad_id = _load_model(cfg, info)
    packed = resolve_packing(cfg.packing, info.device, info.device.type == "cuda")
    shares_prefix = resolve_share_prefix(cfg.share_prefix, packed, info.device, info.device.type == "cuda")
    params = trainable_parameters(model)  # with LoRA, the adapters only
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas, eps=cfg.eps)

    rng = random.Random(cfg.seed)
    steps_per_epoch = max(1, len(data) // cfg.batch_size)
    total_steps = max(1, int(cfg.epochs * steps_per_epoch))
    bar = None
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        _log(
            f"{len(data)} trajectories, {total_steps} steps of {cfg.batch_size} on {info.world_size} process(es)"
        )
        bar = tqdm(total=total_steps, desc="sft", unit="step", dynamic_ncols=True, mininterval=1.0)
    metrics_path = out / "metrics.jsonl"
    if info.is_main:
        metrics_path.write_text("")
    order: list[Trajectory] = []
    t0 = time.time()
    for step in range(total_steps):
        if len(order) < cfg.batch_size:
            epoch = data[:]
            rng.shuffle(epoch)
            order += epoch
        global_batch, order = order[: cfg.batch_size], order[cfg.batch_size :]
        micro = plan_micro_batches(
            global_batch,
            info.world_size,
            max_tokens=cfg.max_tokens_per_micro_batch,
            max_sequences=cfg.micro_batch_size,
            packed=packed,
            share_prefix=shares_prefix,
        ).for_rank(info.rank)
        local_tokens = sum(sum(t.loss_mask) for mb in micro for t in mb)
        scale, global_tokens = global_token_scale(local_tokens, info.device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total_steps, cfg)
        loss_sum, grad_norm = _optimizer_step(
            model, opt, params, micro, scale, cfg, pad_id, info.device, packed, shares_prefix
        )
        # loss_sum is this rank's share; the mean over ranks times world / global is the global mean.
        m = all_reduce_mean({"loss_sum": loss_sum}, info.device)
        row = {
            "step": step + 1,
            "loss": m["loss_sum"] * info.world_size / max(global_tokens, 1.0),
            "grad_norm": grad_norm,
            "lr": opt.param_groups[0]["lr"],
            "tokens": global_tokens,
            "elapsed_s": round(time.time() - t0, 2),
        }
        if info.is_main:
            assert bar is not None
            _report(row, metrics_path, bar, total_steps, cfg.log_every)
    if bar is not None:
        bar.close()
    export_model(model, base, out)  # collective; a LoRA run's out is the adapter directory
    if info.is_main:
        (out / "sft_config.json").write_text(cfg.model_dump_json(indent=2))
        _log(f"done in {time.time() - t0:.0f}s: {out}")
    import torch.distributed as dist

    dist.barrier()
    return out


def _load_model(cfg: SFTConfig, info: Any) -> tuple[torch.nn.Module, int]:
    """The model to train (LoRA applied when asked, sharded) on this rank's device, and the pad id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.train.distributed import shard_model
    from agentrl.train.lora import apply_lora

    base = cfg.model.path
    tok = AutoTokenizer.from_pretrained(base)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to(info.device)
    if cfg.model.lora is not None:
        apply_lora(
            model, cfg.model.lora, base
        )  # before sharding; the seed set before this call makes every rank's A the same
    model.train()
    shard_model(
        model,
        activation_checkpointing=cfg.activation_checkpointing,
        compiled=resolve_compile(cfg.compile, info.device),
    )
    return model, pad_id


def _optimizer_step(
    model: Any,
    opt: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    micro: list[list[Trajectory]],
    scale: float,
    cfg: SFTConfig,
    pad_id: int,
    device: torch.device,
    packed: bool,
    shares_prefix: bool,
) -> tuple[float, float]:
    """One step over this rank's micro-batches: (this rank's summed NLL, the clipped global grad norm)."""
    loss_sum = 0.0
    for i, mb in enumerate(micro):
        # Reduce gradients over ranks only on the last micro-batch of the step.
        model.set_requires_gradient_sync(i == len(micro) - 1)
        nll, _ = masked_nll_sum(model, mb, pad_id, device, packed=packed, share_prefix=shares_prefix)
        (nll * scale).backward()
        loss_sum += float(nll.item())
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss_sum, grad_norm


def _report(row: dict[str, Any], metrics_path: Path, bar: Any, total_steps: int, log_every: int) -> None:
    """Rank 0: a step's row to metrics.jsonl and the progress bar, and every `log_every` steps to the log."""
    with metrics_path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    bar.set_postfix_str(f"loss {row['loss']:.4f}", refresh=False)
    bar.update(1)
    step = row["step"]
    if step % log_every == 0 or step == 1 or step == total_steps:
        _log(f"step {step}/{total_steps} loss {row['loss']:.4f} grad {row['grad_norm']:.3f}")


def _log(msg: str) -> None:
    tqdm.write(f"[sft] {msg}", file=sys.stderr)  # above the progress bar, not through it


def training_data(cfg: SFTConfig) -> list[Trajectory]:
    """The trajectories SFT trains on: passed ones (unless `only_passed` is off) that fit `max_seq_len`."""
    from agentrl.core.errors import UserError, check_nonempty_file

    check_nonempty_file(cfg.data, "--data", kind="trajectory JSONL")
    try:
        every = load_trajectories(cfg.data)
    except Exception as exc:
        raise UserError(
            f"--data {cfg.data} is not trajectory JSONL (from `agentrl demos` or rollout): {exc}"
        ) from None
    data = [t for t in every if (t.passed or not cfg.only_passed) and len(t.token_ids) <= cfg.max_seq_len]
    if not data:
        passed = sum(t.passed for t in every)
        raise UserError(
            f"--data {cfg.data}: none of its {len(every)} trajectories can be trained on ({passed} passed; "
            f"only_passed={cfg.only_passed}, max_seq_len={cfg.max_seq_len}); pass --all to train on failed ones too"
        )
    return data


def launch(cfg: SFTConfig, nproc: int = 1) -> Path:
    """Run SFT here (nproc=1) or under `torchrun` with `nproc` processes, after checking the inputs
    (process count, starting model, data) so bad input is one line before any process starts."""
    from agentrl.core.errors import check_model_dir, check_nproc
    from agentrl.train.distributed import run_here_or_as_ranks

    check_nproc(nproc)
    check_model_dir(cfg.model.path)
    training_data(cfg)
    out = run_here_or_as_ranks(lambda: train_sft(cfg), "agentrl.train.sft", cfg.model_dump_json(), nproc)
    return out if out is not None else Path(cfg.out)


if __name__ == "__main__":
    from agentrl.train.distributed import run_rank

    sys.exit(run_rank(lambda: train_sft(SFTConfig.model_validate_json(sys.argv[1]))))
