"""The GRPO update of one batch, on every rank: `grpo_step` runs `optim.epochs` passes over the batch, each
split into `optim.mini_batches` optimizer steps; a step runs this rank's micro-batches (cut by a token
budget, packed where the varlen kernel runs), each through `agentrl.train.grpo.policy_loss`, then
clips the global gradient and steps AdamW. Metrics are token-weighted and averaged over ranks.

With more than one optimizer step per batch, or a KL reference, the log-probs from before the first
update are computed up front (`_logprobs_before_update`): the ratio is anchored there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from agentrl.rollout.trajectory import Trajectory
from agentrl.train.batch import Batch, collate
from agentrl.train.config import TrainConfig
from agentrl.train.distributed import DistInfo, all_reduce_mean, global_token_scale
from agentrl.train.grpo import (
    LossStats,
    group_advantages,
    histogram_quantiles,
    mismatch_sums,
    policy_loss,
    ratio_histogram,
    weight_negatives,
)
from agentrl.train.logprobs import action_logprobs
from agentrl.train.packing import filler, plan_micro_batches, resolve_packing, resolve_share_prefix


def grpo_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    trajectories: list[Trajectory],
    cfg: TrainConfig,
    info: DistInfo,
    pad_id: int,
    *,
    ref_model: torch.nn.Module | None = None,
    updates_done: int = 0,
    seed: int = 0,
) -> dict[str, float]:
    """GRPO updates on `trajectories` (the same list on every rank): `optim.epochs` passes, each
    split into `optim.mini_batches` optimizer steps. Returns metrics averaged over ranks and updates.

    `updates_done` (optimizer steps taken before this batch) drives the learning-rate warm-up;
    `seed` fixes the mini-batch shuffle, identically on every rank.
    """
    totals = _Totals()
    batch = _BatchContext.build(model, trajectories, cfg, info, pad_id, ref_model, totals)
    order = list(range(len(trajectories)))
    shuffle = torch.Generator().manual_seed(seed)
    for epoch in range(cfg.optim.epochs):
        if epoch > 0:  # the first pass keeps the batch's order: one update reproduces the plain step
            order = torch.randperm(len(trajectories), generator=shuffle).tolist()
        for part in range(cfg.optim.mini_batches):
            mini = [trajectories[i] for i in order[part :: cfg.optim.mini_batches]]
            for group in opt.param_groups:
                group["lr"] = learning_rate(cfg, updates_done)
            updates_done += 1
            _optimizer_step(model, opt, mini, batch, totals)
    totals.settle()
    # Token-weighted over all ranks: the mean over ranks of the weighted sums, over that of the weights.
    totals.weighted["losses/policy_loss"] = totals.loss / batch.n_updates
    totals.weighted["_computed"] = float(totals.computed)
    # Each rank's loss is world · (its sum) / (global count), so the mean over ranks is the global loss.
    out = all_reduce_mean(totals.weighted, info.device)
    w = max(out.pop("_w", 0.0), 1e-9)
    mw = max(out.pop("_mw", 0.0), 1e-9)
    computed = out.pop("_computed") * info.world_size  # summed over ranks
    out = {
        k: v if k == "losses/policy_loss" else v / (mw if k.startswith("mismatch/") else w)
        for k, v in out.items()
    }
    # Quantiles of the importance ratio trainer/engine over every rank's action tokens: its tails are what
    # the TIS cap and the clip act on (histograms add over ranks, quantiles do not).
    if totals.ratio_hist is not None:
        hist = totals.ratio_hist.to(info.device)
        if dist.is_initialized():
            dist.all_reduce(hist)
        for q, value in histogram_quantiles(hist.cpu(), (0.01, 0.05, 0.5, 0.95, 0.99)).items():
            out[f"mismatch/is_ratio_p{round(q * 100):02d}"] = value
    out["losses/grad_norm"] = totals.grad_norm / batch.n_updates
    out["batch/action_tokens"] = totals.tokens / batch.n_updates
    out["batch/sequences"] = float(len(trajectories))
    out["batch/tokens_computed"] = computed / batch.n_updates
    out["optim/lr"] = learning_rate(cfg, updates_done - 1)
    out["optim/updates"] = float(updates_done)
    return out


@dataclass
class _Totals:
    """Sums over the optimizer steps of one `grpo_step`."""

    weighted: dict[str, float] = field(default_factory=dict)
    """Metrics times action tokens. "_w": the tokens the loss metrics saw (the trained trajectories'),
    "_mw": those the mismatch metrics saw (every trajectory of the batch)."""
    loss: float = 0.0
    grad_norm: float = 0.0
    tokens: float = 0.0
    computed: int = 0
    """Positions the training passes ran through the model (a shared prefix once), this rank."""
    ratio_hist: torch.Tensor | None = None
    """Counts of the trainer/engine log-ratio of the action tokens (`ratio_histogram`), over micro-batches."""
    pending: dict[str, torch.Tensor] = field(default_factory=dict)
    """Sums still on the device, read by `settle` once per step, not once per micro-batch (each read
    waits for every queued kernel): "loss", "losses" (the loss metrics times their action tokens),
    "mismatch" (|Δ| and KL sums), "grad_norm", "ratio_hist"."""

    def add(self, key: str, value: torch.Tensor) -> None:
        value = value.detach().double().reshape(-1)
        self.pending[key] = value if key not in self.pending else self.pending[key] + value

    def settle(self) -> None:
        """Read the sums kept on the device into the host totals: one device-to-host copy."""
        if not self.pending:
            return
        keys = sorted(self.pending)
        values = (
            torch.cat([self.pending[k] for k in keys]).cpu().split([self.pending[k].numel() for k in keys])
        )
        self.pending.clear()
        for key, value in zip(keys, values, strict=True):
            if key == "ratio_hist":
                self.ratio_hist = value if self.ratio_hist is None else self.ratio_hist + value
                continue
            numbers = value.tolist()
            if key == "loss":
                self.loss += numbers[0]
            elif key == "grad_norm":
                self.grad_norm += numbers[0]
            elif key == "losses":
                for name, v in LossStats.named(numbers, prefix="losses/").items():
                    self.weighted[name] = self.weighted.get(name, 0.0) + v
            elif key == "mismatch":
                for name, v in zip(("logprob_abs_diff", "kl"), numbers, strict=True):
                    self.weighted[f"mismatch/{name}"] = self.weighted.get(f"mismatch/{name}", 0.0) + v


@dataclass
class _BatchContext:
    """What every micro-batch of one `grpo_step` shares."""

    cfg: TrainConfig
    info: DistInfo
    pad_id: int
    ref_model: torch.nn.Module | None
    packed: bool
    shares_prefix: bool
    """Packed micro-batches hold the tokens all their sequences start with once (`optim.share_prefix`)."""
    n_updates: int
    advantage_of: dict[int, float]
    """Per trajectory, keyed by object: the plans hand out these same objects (plus zero-mask fillers)."""
    anchored: bool
    """The ratio is taken against the trainer's own log-probs from before the first update."""
    before: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]
    """The policy's and the reference's log-probs before the first update, where needed."""

    def trains(self, t: Trajectory) -> bool:
        """Whether trajectory `t` can add anything to the gradient. Without a KL term or an entropy bonus
        every loss term is a multiple of the advantage: a trajectory whose advantage is 0 (a negative under
        `loss.negative_weight: 0`, a reward equal to its group's mean) adds exactly nothing, so the
        optimizer steps do not run it."""
        with_kl = self.ref_model is not None and self.cfg.loss.kl_coef != 0.0
        return with_kl or self.cfg.loss.entropy_coef > 0.0 or self.advantage_of.get(id(t), 0.0) != 0.0

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        trajectories: list[Trajectory],
        cfg: TrainConfig,
        info: DistInfo,
        pad_id: int,
        ref_model: torch.nn.Module | None,
        totals: _Totals,
    ) -> _BatchContext:
        rewards = torch.tensor([t.reward for t in trajectories])  # [N]
        # A harness episode's branches share its reward: each weighs 1/branches, so a group's
        # statistics count episodes, not trajectories.
        episode_share = torch.tensor([1.0 / t.branches for t in trajectories])  # [N]
        advantages = group_advantages(
            rewards, [t.group_id for t in trajectories], scale=cfg.loss.adv_scale, weights=episode_share
        )  # [N]
        advantages = weight_negatives(advantages, cfg.loss.negative_weight)  # [N]
        # The sampler's weight of each trajectory's group (1 unless it weights the loss, e.g. mgpo).
        advantages = advantages * torch.tensor(
            [t.loss_weight for t in trajectories], dtype=advantages.dtype
        )  # [N]
        n_updates = cfg.optim.epochs * cfg.optim.mini_batches
        # The trust region is anchored at the trainer's own log-probs of the batch before its first
        # update ("decoupled" PPO: the rollout engine's log-probs only enter through the capped TIS
        # weight). With one update those are the live log-probs detached; with more, the ratio must
        # move away from 1 between updates, so they are computed once up front, as is the reference.
        before: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        if n_updates > 1 or ref_model is not None:
            before = _logprobs_before_update(
                model if n_updates > 1 else None, ref_model, trajectories, cfg, info, pad_id, totals
            )
        packed, shares_prefix = trainer_layout(cfg, info)
        return cls(
            cfg,
            info,
            pad_id,
            ref_model,
            packed=packed,
            shares_prefix=shares_prefix,
            n_updates=n_updates,
            advantage_of={id(t): a for t, a in zip(trajectories, advantages.tolist(), strict=True)},
            anchored=cfg.loss.tis_cap is not None or n_updates > 1,
            before=before,
        )


def _optimizer_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    mini: list[Trajectory],
    batch: _BatchContext,
    totals: _Totals,
) -> None:
    """One optimizer step on the mini-batch `mini`: this rank's micro-batches, the clipped global gradient."""
    cfg, info = batch.cfg, batch.info
    micro = trainer_micro_batches(mini, cfg, info, batch.packed, batch.shares_prefix)
    # Denominators over the whole optimizer step, all ranks: the plan is the same everywhere,
    # so each rank counts its own share and one all-reduce gives the global count.
    local_tokens = sum(sum(t.loss_mask) for mb in micro for t in mb)
    _, global_tokens = global_token_scale(local_tokens, info.device)
    local_seqs = sum(1 for mb in micro for t in mb if any(t.loss_mask))
    _, global_seqs = global_token_scale(local_seqs, info.device)
    # FSDP2 averages gradients over ranks, so each rank divides its sum by global count / world.
    denom = (global_tokens if cfg.loss.agg == "token-mean" else global_seqs) / info.world_size
    totals.tokens += global_tokens
    # The denominators above count every trajectory; the passes run only those that add to the
    # gradient (with positives-only updates, every negative is left out). A mini-batch with none still runs one
    # zero-mask filler, so the optimizer sees zero gradients (Adam's momentum moves) as before.
    trained = [t for t in mini if batch.trains(t)]
    if len(trained) < len(mini):
        if batch.n_updates == 1:  # no pass before the update measured the mismatch: a forward for the rest
            skipped = [t for t in mini if not batch.trains(t)]
            _logprobs_before_update(model, None, skipped, cfg, info, batch.pad_id, totals)
        micro = trainer_micro_batches(
            trained or [filler(mini[0])], cfg, info, batch.packed, batch.shares_prefix
        )
    for i, mb in enumerate(micro):
        model.set_requires_gradient_sync(i == len(micro) - 1)
        _micro_batch_backward(model, mb, batch, max(denom, 1e-9), totals)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
    totals.add("grad_norm", grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _micro_batch_backward(
    model: torch.nn.Module, mb: list[Trajectory], batch: _BatchContext, denominator: float, totals: _Totals
) -> None:
    """The clipped surrogate of one micro-batch, its gradient accumulated; its metrics into `totals`."""
    cfg, device = batch.cfg, batch.info.device
    # The layout is worked out on the host and copied over without waiting for the queued kernels.
    on_host = collate(mb, batch.pad_id)
    rows = on_host.to(device, non_blocking=True)
    live = action_logprobs(
        model,
        on_host,
        temperature=cfg.rollout.temperature,
        with_entropy=True,
        entropy_grad=cfg.loss.entropy_coef > 0.0,
        packed=batch.packed,
        share_prefix=batch.shares_prefix,
        device=device,
    )
    logp = live.logprobs  # [B, T], 0 off the loss mask
    adv = torch.tensor([batch.advantage_of.get(id(t), 0.0) for t in mb]).to(device, non_blocking=True)  # [B]
    w = float(_action_tokens(mb))
    width = logp.shape[1]
    old = ref = None
    if batch.anchored:
        old = (
            logp.detach()
            if batch.n_updates == 1
            else _rows([batch.before.get(id(t), (None, None))[0] for t in mb], width, logp)
        )  # [B, T]
    if batch.ref_model is not None:
        ref = _rows([batch.before.get(id(t), (None, None))[1] for t in mb], width, logp)  # [B, T]
    if batch.n_updates == 1:  # with more, the pass before the first update measured every trajectory
        _add_mismatch(totals, logp.detach(), rows, w)
    loss, stats = policy_loss(
        logp,
        rows.behavior_logprobs,
        adv,
        rows.loss_mask,
        cfg.loss,
        old_logprobs=old,
        ref_logprobs=ref,
        entropy=live.entropy,
        denominator=denominator,
    )
    loss.backward()
    totals.add("loss", stats["loss"])
    totals.add("losses", stats.values * w)  # every metric of the loss, token-weighted
    totals.weighted["_w"] = totals.weighted.get("_w", 0.0) + w
    totals.computed += live.computed_tokens


def _action_tokens(mb: list[Trajectory]) -> int:
    return sum(sum(t.loss_mask) for t in mb)


def _add_mismatch(totals: _Totals, trainer_logprobs: torch.Tensor, rows: Batch, w: float) -> None:
    """The trainer's log-probs with the weights the batch was sampled with ([B, T]), against the
    engine's: the engine must be sampling from this policy (the newest weights or adapter);
    staleness adds to it in async. `w`: the batch's action tokens."""
    sums = mismatch_sums(trainer_logprobs, rows.behavior_logprobs, rows.loss_mask)  # [4]
    totals.add("mismatch", sums[:2])  # |Δ| and KL summed over the tokens: their means times w
    totals.add("ratio_hist", ratio_histogram(trainer_logprobs, rows.behavior_logprobs, rows.loss_mask))
    totals.weighted["_mw"] = totals.weighted.get("_mw", 0.0) + w


def trainer_layout(cfg: TrainConfig, info: DistInfo) -> tuple[bool, bool]:
    """(packed, shares_prefix): whether this trainer packs its micro-batches (`optim.packing`) and holds
    their common prefix once (`optim.share_prefix`), resolved for its device and dtype."""
    bf16 = cfg.optim.bf16 if cfg.optim.bf16 is not None else info.device.type == "cuda"
    packed = resolve_packing(cfg.optim.packing, info.device, bf16)
    return packed, resolve_share_prefix(cfg.optim.share_prefix, packed, info.device, bf16)


def trainer_micro_batches(
    trajectories: list[Trajectory],
    cfg: TrainConfig,
    info: DistInfo,
    packed: bool,
    shares_prefix: bool = False,
) -> list[list[Trajectory]]:
    """This rank's micro-batches of `trajectories` under the token budget (same count on every rank); with
    `shares_prefix`, sequences with a long common start planned together."""
    plan = plan_micro_batches(
        trajectories,
        info.world_size,
        max_tokens=cfg.optim.max_tokens_per_micro_batch,
        max_sequences=cfg.optim.micro_batch_size,
        packed=packed,
        share_prefix=shares_prefix,
    )
    return plan.for_rank(info.rank)


def learning_rate(cfg: TrainConfig, update: int) -> float:
    """Learning rate of optimizer step `update` (0-based): linear warm-up, then constant."""
    if cfg.optim.warmup_steps and update < cfg.optim.warmup_steps:
        return cfg.optim.lr * (update + 1) / cfg.optim.warmup_steps
    return cfg.optim.lr


def _logprobs_before_update(
    model: torch.nn.Module | None,
    ref_model: torch.nn.Module | None,
    trajectories: list[Trajectory],
    cfg: TrainConfig,
    info: DistInfo,
    pad_id: int,
    totals: _Totals,
) -> dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Per trajectory (keyed by id): the policy's and the reference's log-probs before any update,
    each [len(token_ids)]. Every rank computes its own share (the shards are what it trains on)
    plus the zero-mask fillers, so the FSDP collectives of the forward passes match. The policy's
    log-probs against the engine's go into `totals` (the mismatch metrics), for every trajectory."""
    out: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
    packed, shares_prefix = trainer_layout(cfg, info)
    micro = trainer_micro_batches(trajectories, cfg, info, packed, shares_prefix)
    mine = [t for mb in micro for t in mb]
    # The mini-batches reshuffle trajectories across ranks, so every rank needs every row: run
    # this rank's share, then gather the rows of the others.
    with torch.no_grad():
        for mb in micro:
            on_host = collate(mb, pad_id)
            batch = on_host.to(info.device, non_blocking=True)
            rows = []
            for m in (model, ref_model):
                if m is None:
                    rows.append(None)
                    continue
                rows.append(
                    action_logprobs(
                        m,
                        on_host,
                        temperature=cfg.rollout.temperature,
                        packed=packed,
                        share_prefix=shares_prefix,
                        device=info.device,
                    ).logprobs
                )  # [B, T], 0 off the loss mask (the only positions the loss reads)
            if rows[0] is not None:
                _add_mismatch(totals, rows[0], batch, float(_action_tokens(mb)))
            rows = [None if r is None else r.cpu() for r in rows]  # one copy per model, not one per row
            for b, t in enumerate(mb):
                n = len(t.token_ids)
                out[id(t)] = tuple(None if r is None else r[b, :n].clone() for r in rows)  # type: ignore[assignment]
    if info.world_size > 1:
        index = {id(t): i for i, t in enumerate(trajectories)}
        local = {index[id(t)]: out[id(t)] for t in mine if id(t) in index and any(t.loss_mask)}
        gathered: list[Any] = [None] * info.world_size
        dist.all_gather_object(gathered, local)
        for part in gathered:
            for i, rows in part.items():
                out[id(trajectories[i])] = rows
    return out


def _rows(rows: list[torch.Tensor | None], width: int, like: torch.Tensor) -> torch.Tensor:
    """Stack per-trajectory [n] rows into [B, width], zero-padded; a missing row (a zero-mask
    filler) is all zeros, which its mask ignores."""
    out = torch.zeros((len(rows), width), dtype=like.dtype)  # [B, T], on the host: one copy over
    for b, r in enumerate(rows):
        if r is not None:
            out[b, : r.shape[0]] = r.cpu()
    return out.to(like.device, non_blocking=True)
