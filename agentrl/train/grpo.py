"""GRPO advantages and the clipped policy loss: pure functions, no state, no distributed code.

References (the formulas each function follows are in its docstring):

- GRPO: Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300), §4.1.
- DAPO: Yu et al. 2025 (arXiv:2503.14476): clip-higher (separate low/high clip), token-level loss.
- Dr. GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training" (arXiv:2503.20783): no std
  scaling (`scale="none"`), no per-sequence length normalisation (`seq-mean-token-sum`).
- GSPO: Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071).
- k3 KL estimator: Schulman 2020, "Approximating KL Divergence".
- Truncated importance sampling (TIS): Yao et al. 2025, "Your Efficient RL Framework Secretly
  Brings You Off-Policy RL Training"; the `tis_imp_ratio_cap` of verl and SkyRL.

Shapes: B sequences, T token positions, tensors in the token-position layout of
`agentrl.train.batch` (`loss_mask[b, t] == 1` where token t was sampled). Everything is computed
with `torch.where(mask, x, 0)` rather than `x * mask`, so garbage (even inf) at padded
positions never turns into NaN in the loss or its gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor

from agentrl.train.batch import token_entropy
from agentrl.train.config import AdvantageScale, ISLevel, ISMode, LossAggregation, LossSettings, RatioLevel

# exp() of a log-ratio beyond this is either clipped away or a numerical accident; clamping
# the log-ratio (as verl does) keeps one wild token from producing inf.
_MAX_LOG_RATIO = 20.0


def _group_index(group_ids: Sequence[str] | Tensor, batch_size: int) -> tuple[Tensor, int]:
    """Map group ids to dense indices 0..G-1 (order of first appearance)."""
    if isinstance(group_ids, Tensor):
        if group_ids.shape != (batch_size,):
            raise ValueError(f"group_ids has shape {tuple(group_ids.shape)}, expected ({batch_size},)")
        _, index = torch.unique(group_ids, return_inverse=True)  # [B]
        return index, int(index.max().item()) + 1 if batch_size else 0
    if len(group_ids) != batch_size:
        raise ValueError(
            f"{len(group_ids)} group ids for {batch_size} rewards; give one group id per trajectory"
        )
    dense: dict[str, int] = {}
    index = torch.tensor([dense.setdefault(g, len(dense)) for g in group_ids], dtype=torch.long)  # [B]
    return index, len(dense)


def group_advantages(
    rewards: Tensor,
    group_ids: Sequence[str] | Tensor,
    scale: AdvantageScale = "group",
    eps: float = 1e-6,
    weights: Tensor | None = None,
) -> Tensor:
    """Trajectory-level, group-relative advantages (GRPO outcome supervision, DeepSeekMath §4.1.2).

        A_i = r_i - mean_g(r)                        scale="none"  (Dr. GRPO)
        A_i = (r_i - mean_g(r)) / (std_g(r) + eps)   scale="group" (GRPO)

    where g is the group of trajectory i (the trajectories sharing its group id: same task,
    same policy). std_g is the *sample* (unbiased, Bessel-corrected) standard deviation,
    sqrt(Σ_j (r_j - mean_g)² / (n_g - 1)), as in DeepSeekMath's reference implementations
    (TRL and verl call `torch.std`, which is unbiased). For a group of two, r = (0, 1):
    mean 0.5, std sqrt(0.5) ≈ 0.7071, A = ∓0.7071 (the population std would give ∓1).

    Degenerate groups give exactly 0: a group whose rewards are all equal (checked with
    max == min, not with a float mean that could leave 1e-17 behind) and a singleton group.
    Computed in float64, returned in `rewards.dtype`. Groups need not be contiguous or equal-sized.

    `weights` [B] (frequency weights; default 1 each) make mean_g and std_g count trajectory i
    w_i times: n_g = Σ_j w_j. A harness episode that gave k trajectories (branches, one reward)
    weighs 1/k in each, so the group's statistics are over its episodes, as for native episodes.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if scale not in ("group", "none"):
        raise ValueError(f"scale must be 'group' or 'none', got {scale!r}")
    batch_size = rewards.shape[0]
    index, num_groups = _group_index(group_ids, batch_size)
    index = index.to(rewards.device)
    r = rewards.detach().double()  # [B]
    if weights is None:
        w = torch.ones_like(r)  # [B]
    elif weights.shape != (batch_size,) or bool((weights <= 0).any()):
        raise ValueError(
            f"weights must be positive, one per trajectory ({batch_size}); got shape {tuple(weights.shape)}"
        )
    else:
        w = weights.detach().double().to(r.device)  # [B]
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=rewards.device)  # [G]
    counts = zeros.index_add(0, index, w)  # [G] episodes per group
    mean = zeros.index_add(0, index, w * r) / counts  # [G]
    centered = r - mean[index]  # [B]
    group_max = zeros.scatter_reduce(0, index, r, reduce="amax", include_self=False)  # [G]
    group_min = zeros.scatter_reduce(0, index, r, reduce="amin", include_self=False)  # [G]
    degenerate = (group_max == group_min)[index]  # [B] all-equal rewards, singletons included
    if scale == "group":
        sq = zeros.index_add(0, index, w * centered**2)  # [G]
        std = (sq / (counts - 1).clamp_min(1)).sqrt()  # [G] unbiased; singletons are masked below
        centered = centered / (std[index] + eps)  # [B]
    advantages = torch.where(degenerate, torch.zeros_like(centered), centered)  # [B]
    return advantages.to(rewards.dtype)


def weight_negatives(advantages: Tensor, weight: float) -> Tensor:
    """Scale the negative advantages by `weight` in [0, 1], leave the others as they are.

        A'_i = A_i           if A_i >= 0
        A'_i = weight · A_i  if A_i < 0

    weight=1 is plain GRPO; weight=0 keeps positive-sample reinforcement only (PSR in Zhu et al.
    2025, "The Surprising Effectiveness of Negative Reinforcement in LLM Reasoning",
    arXiv:2506.01347). They split the objective into its positive and negative parts and find
    the positives are what raise pass@1 (at a cost in pass@k) while the negatives keep pass@k;
    their W-REINFORCE down-weights the positives instead. On a small model whose failures are
    scattered sampling slips, pushing those slips down moves the whole model more than it
    sharpens it (docs/DEMO.md).
    """
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"negative weight must be in [0, 1], got {weight}")
    if weight == 1.0:
        return advantages
    return torch.where(advantages < 0, advantages * weight, advantages)  # [B]


def broadcast_advantages(advantages: Tensor, loss_mask: Tensor) -> Tensor:
    """Give every action token its trajectory's advantage: out[b, t] = A_b if loss_mask[b, t] else 0."""
    if advantages.dim() != 1 or advantages.shape[0] != loss_mask.shape[0]:
        raise ValueError(
            f"advantages {tuple(advantages.shape)} must be [B] with B = loss_mask.shape[0] ({loss_mask.shape[0]})"
        )
    expanded = advantages.unsqueeze(-1).expand_as(loss_mask)  # [B, T]
    return torch.where(loss_mask.bool(), expanded, torch.zeros_like(expanded))  # [B, T]


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(π_θ || π_ref) (Schulman 2020), ≥ 0 and unbiased under π_θ.

        k3 = exp(ref - logp) - (ref - logp) - 1

    Its gradient is (1 - exp(ref - logp)) ∇logp. The log-ratio is clamped to ±20 so a token
    the reference finds impossible cannot produce inf.
    """
    delta = (ref_logprobs - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # [B, T]
    return delta.exp() - delta - 1.0  # [B, T]


def aggregate(
    per_token: Tensor,
    loss_mask: Tensor,
    agg: LossAggregation,
    denominator: float | None = None,
) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar over the action tokens (DAPO / Dr. GRPO names).

    - `token-mean` (DAPO §3.3): Σ_{b,t} m·l / Σ_{b,t} m — every action token weighs the same.
    - `seq-mean-token-sum` (Dr. GRPO): (1/S) Σ_b Σ_t m·l — no per-sequence length normalisation.
    - `seq-mean-token-mean` (original GRPO, GSPO): (1/S) Σ_b (Σ_t m·l / Σ_t m).

    S counts the sequences with at least one action token (an empty sequence neither
    contributes nor dilutes). `denominator` replaces Σ m (token-mean) or S (seq-mean-*) with a
    count over the *global* batch: with gradient accumulation over micro-batches, or data
    parallel ranks, pass the number of action tokens (or sequences) in the whole optimiser
    step, and the micro-batch losses then *sum* to the full-batch loss instead of averaging
    per micro-batch. FSDP/DDP *average* gradients over ranks, so with a global denominator
    multiply each rank's loss by the world size. An empty mask gives 0, still attached to
    the graph (gradient 0, never NaN). To divide the token sums by a constant instead (Dr.
    GRPO's code uses the generation budget; verl's `seq-mean-token-sum-norm`), use
    `seq-mean-token-sum` with that constant as `denominator`.
    """
    mask = loss_mask.bool()  # [B, T]
    masked = torch.where(mask, per_token, torch.zeros_like(per_token))  # [B, T]
    tokens_per_seq = mask.sum(-1).to(masked.dtype)  # [B]
    # Counts stay tensors (no device sync); clamp_min(1) makes an empty mask give 0, not NaN.
    if agg == "token-mean":
        count = tokens_per_seq.sum() if denominator is None else torch.tensor(float(denominator))
        return masked.sum() / count.clamp_min(1.0).to(masked.device)
    if agg == "seq-mean-token-sum":
        per_seq = masked.sum(-1)  # [B]
    elif agg == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / tokens_per_seq.clamp_min(1.0)  # [B]
    else:
        raise ValueError(
            f"agg must be one of 'token-mean', 'seq-mean-token-sum', 'seq-mean-token-mean'; got {agg!r}"
        )
    num_seqs = (
        (tokens_per_seq > 0).sum().to(masked.dtype)
        if denominator is None
        else torch.tensor(float(denominator))
    )
    return per_seq.sum() / num_seqs.clamp_min(1.0).to(masked.device)


@dataclass
class LossMetrics:
    """Diagnostics of one `policy_loss` call. Token statistics are over action tokens only.

    Clip fractions count tokens where the clip is *active* (its gradient is cut): `low` where
    ratio < 1 - clip_low with a negative advantage, `high` where ratio > 1 + clip_high with a
    positive one. With ratio="sequence" every token of a sequence carries that sequence's
    ratio, so these are token-weighted sequence statistics.
    """

    loss: float  # total: policy term + kl_coef * kl term - entropy_coef * entropy bonus
    pg_loss: float  # the clipped-surrogate term alone
    clip_fraction_low: float
    clip_fraction_high: float
    ratio_mean: float
    ratio_min: float
    ratio_max: float
    approx_kl: float  # mean k3 estimate of KL(π_old || π_θ) from the PPO ratio: (r - 1) - log r
    kl_ref: float  # mean k3 KL to the reference policy; 0.0 when no ref_logprobs
    entropy: float | None  # mean token entropy; None when neither entropies nor logits were given
    tis_weight_mean: float  # 1.0 when TIS is off
    tis_clip_fraction: float  # fraction of action tokens whose TIS weight was cut: capped, or masked to 0
    num_action_tokens: int
    num_sequences: int  # sequences with at least one action token

    def as_dict(self, prefix: str = "losses/") -> dict[str, float | int | None]:
        return {prefix + k: v for k, v in asdict(self).items()}

    @classmethod
    def from_stats(cls, stats: Sequence[float], *, entropy: bool) -> LossMetrics:
        """The metrics from `LossStats.values` (`entropy`: whether the entropy was measured)."""
        names = [f.name for f in fields(cls)]
        values: dict[str, Any] = dict(zip(names, stats, strict=True))
        values["entropy"] = values["entropy"] if entropy else None
        values["num_action_tokens"] = int(values["num_action_tokens"])
        values["num_sequences"] = int(values["num_sequences"])
        return cls(**values)


LOSS_FIELDS = tuple(f.name for f in fields(LossMetrics))
"""The names of `LossStats.values`, in order."""


def log_policy_ratio(logprobs: Tensor, anchor: Tensor, mask: Tensor, ratio: RatioLevel) -> Tensor:
    """log ρ [B, T] of `policy_loss` against `anchor` (detached): per token, or GSPO-token per sequence.

    `ratio="sequence"` is GSPO in its GSPO-token form (paper eq. 13-14, verl's
    `compute_policy_loss_gspo`): every token's ratio has the *value* s_b (so clipping is
    decided per sequence), and the gradient is s_b·∇logp_{b,t}. Aggregated with
    `seq-mean-token-mean`, which is what the GSPO paper uses, its gradient equals that of
    the plain sequence objective (1/S) Σ_b min(s_b A_b, clip(s_b) A_b) exactly; the token
    form is used because it also accepts [B, T] advantages and any aggregation.
    """
    zeros = torch.zeros_like(logprobs)  # [B, T]
    log_ratio = torch.where(mask, logprobs - anchor, zeros)  # [B, T]
    if ratio == "token":
        return log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # [B, T]
    tokens_per_seq = mask.sum(-1).clamp_min(1).to(logprobs.dtype)  # [B]
    log_seq_ratio = log_ratio.sum(-1) / tokens_per_seq  # [B] log s_b
    log_seq_ratio = log_seq_ratio.detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # [B]
    # Value s_b, gradient s_b·∇logp: the logp - sg[logp] term is 0 in value, 1 in derivative.
    return log_seq_ratio.unsqueeze(-1) + (log_ratio - log_ratio.detach())  # [B, T]


def clipped_surrogate(ratios: Tensor, advantages: Tensor, clip_low: float, clip_high: float) -> Tensor:
    """The per-token clipped-surrogate loss -min(ρA, clip(ρ, 1 - clip_low, 1 + clip_high)A) [B, T]."""
    surrogate = ratios * advantages  # [B, T]
    clipped = ratios.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages  # [B, T]
    return -torch.minimum(surrogate, clipped)  # [B, T]


def importance_weights(
    old_logprobs: Tensor,
    behavior_logprobs: Tensor,
    mask: Tensor,
    tis_cap: float,
    tis_level: ISLevel,
    tis_mode: ISMode,
) -> tuple[Tensor, Tensor]:
    """The detached TIS weights [B, T] of `policy_loss` and where they cut [B, T] (bool, action tokens).

    Truncated importance sampling (TIS, Yao et al. 2025): the rollout engine (vLLM, bf16,
    other kernels) and the trainer do not assign identical probabilities to the same
    tokens. With `old_logprobs` and `tis_cap` given, each token's loss is multiplied by the
    detached weight w = min(exp(old - behavior), tis_cap) — token-level, capped above only,
    applied to the policy term and not to the KL term, exactly as verl's
    `tis_imp_ratio_cap` and SkyRL's token TIS. Without TIS, w = 1. verl and SkyRL use
    caps of about 2 to 8. The weight's level and mode are choices:
    `tis_level="sequence"` gives every token of sequence b the weight of
    q_b = exp(mean_t(old_{b,t} - behavior_{b,t})) (the geometric mean of its token ratios, so a
    long sequence is not an extreme product); `tis_mode="mask"` drops instead of capping: the
    weight is the ratio itself inside [1/tis_cap, tis_cap] and 0 outside (masked IS, as IcePop),
    so tokens or sequences the engine sampled from a policy too far from the trainer's do not train.
    """
    zeros = torch.zeros_like(old_logprobs)  # [B, T]
    tis_log = torch.where(mask, old_logprobs - behavior_logprobs, zeros).detach()  # [B, T]
    if tis_level == "sequence":
        seq_log = tis_log.sum(-1) / mask.sum(-1).clamp_min(1).to(tis_log.dtype)  # [B] log q_b
        tis_log = torch.where(mask, seq_log.unsqueeze(-1).expand_as(tis_log), zeros)  # [B, T]
    tis_ratio = tis_log.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()  # [B, T]
    if tis_mode == "mask":
        inside = (tis_ratio >= 1.0 / tis_cap) & (tis_ratio <= tis_cap)  # [B, T]
        return torch.where(inside, tis_ratio, zeros), mask & ~inside  # [B, T], [B, T]
    return tis_ratio.clamp(max=tis_cap), mask & (tis_ratio >= tis_cap)  # [B, T], [B, T]


@dataclass(frozen=True)
class LossStats:
    """The metrics of one `policy_loss` call as it leaves them: on the device, detached, fp32, so that a
    trainer can add them up over micro-batches without a device sync per call. By name: `stats["loss"]`
    (a 0-d tensor); all of them read at once (one sync): `stats.metrics()`, a `LossMetrics`."""

    values: Tensor
    """[len(LOSS_FIELDS)]: the value of each `LossMetrics` field, in `LOSS_FIELDS` order."""
    entropy_measured: bool
    """Whether the call was given entropies or logits (otherwise the entropy metric is None)."""

    def __getitem__(self, name: str) -> Tensor:
        return self.values[LOSS_FIELDS.index(name)]

    def metrics(self) -> LossMetrics:
        return LossMetrics.from_stats(self.values.tolist(), entropy=self.entropy_measured)

    @staticmethod
    def named(summed: Sequence[float], prefix: str = "") -> dict[str, float]:
        """Sums of `values` over calls (weighted or not), by metric name."""
        return {prefix + name: v for name, v in zip(LOSS_FIELDS, summed, strict=True)}


def policy_loss(
    logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    settings: LossSettings,
    *,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    logits: Tensor | None = None,
    entropy: Tensor | None = None,
    denominator: float | None = None,
) -> tuple[Tensor, LossStats]:
    """Clipped surrogate loss for GRPO-family updates; returns (scalar loss to minimise, its metrics).

    `settings` are the run's `loss:` section (`LossSettings`: clip_low, clip_high, agg, ratio, kl_coef,
    tis_cap, tis_level, tis_mode); the tensors of one micro-batch are the arguments. The metrics stay on
    the device (`LossStats`): a trainer adds them up over micro-batches and reads them once.

    Per action token (b, t), with the ratio ρ against the policy that anchors the trust region:

        ρ_{b,t} = exp(logp_{b,t} - anchor_{b,t})             ratio="token"  (PPO / GRPO)
        ρ_{b,t} = s_b · exp(logp_{b,t} - sg[logp_{b,t}])     ratio="sequence" (GSPO-token)
        s_b     = exp( (1/|y_b|) Σ_t (logp_{b,t} - anchor_{b,t}) )
        l_{b,t} = -min(ρ A_b, clip(ρ, 1 - clip_low, 1 + clip_high) A_b) · w_{b,t}
        loss    = aggregate(l, agg) + kl_coef · aggregate(k3(logp, ref), agg)
                  - entropy_coef · [H̄ < entropy_floor] · aggregate(H, agg)

    - Clip-higher (DAPO): the ratio is clipped to [1 - clip_low, 1 + clip_high]; with
      clip_high > clip_low low-probability tokens with positive advantage may grow further,
      which slows entropy collapse.
    - `ratio="sequence"` is GSPO in its GSPO-token form: see `log_policy_ratio`.
    - The anchor is `old_logprobs` when given (the trainer's own forward pass with the
      weights that generated the batch, before this update: "decoupled" PPO), otherwise
      `behavior_logprobs` (the rollout engine's log-probs).
    - Truncated importance sampling (TIS, Yao et al. 2025), with `old_logprobs` and `tis_cap`: each
      token's policy term is multiplied by a detached weight w (`importance_weights`); without TIS, w = 1.
    - `advantages` is [B] (one per trajectory, broadcast over its action tokens) or [B, T].
    - `denominator`: see `aggregate` (micro-batching and data parallel ranks).
    - `entropy` ([B, T], each action token's entropy, as `agentrl.train.logprobs` computes it beside the
      log-probs) or else `logits` ([B, T, V], token-position layout as in `agentrl.train.batch`) feed the
      entropy metric, and with `entropy_coef` > 0 the entropy bonus (they must then be differentiable):
      H̄ is the micro-batch's mean action-token entropy (detached), and without `entropy_floor` the
      bracket is 1. The gate is a tensor, so the floor costs no device sync.

    Degenerate inputs are defined: no action tokens anywhere gives loss 0 with a zero
    gradient (not NaN); a one-token sequence's GSPO ratio is its token ratio; all-zero
    advantages give loss 0 and gradient 0 (plus the KL term if any).
    """
    _check_loss_inputs(
        logprobs, behavior_logprobs, loss_mask, settings, old_logprobs, ref_logprobs, entropy, logits
    )
    clip_low, clip_high, agg = settings.clip_low, settings.clip_high, settings.agg
    mask = loss_mask.bool()  # [B, T]
    advantages = _per_token_advantages(advantages, logprobs.dtype, loss_mask)  # [B, T]

    anchor = (old_logprobs if old_logprobs is not None else behavior_logprobs).detach()  # [B, T]
    log_ratio = log_policy_ratio(logprobs, anchor, mask, settings.ratio)  # [B, T]
    ratios = log_ratio.exp()  # [B, T]
    pg_per_token = clipped_surrogate(ratios, advantages, clip_low, clip_high)  # [B, T]

    tis_weights, tis_cut = _tis_weights(logprobs, old_logprobs, behavior_logprobs, mask, settings)  # [B, T]
    if settings.tis_cap is not None:
        pg_per_token = pg_per_token * tis_weights  # [B, T]

    pg_loss = aggregate(pg_per_token, loss_mask, agg, denominator)
    loss = pg_loss
    kl_per_token = None
    if ref_logprobs is not None:
        kl_per_token = _masked_k3(logprobs, ref_logprobs, mask)  # [B, T]
        loss = loss + settings.kl_coef * aggregate(kl_per_token, loss_mask, agg, denominator)
    if settings.entropy_coef > 0.0:
        loss = loss - settings.entropy_coef * _entropy_bonus(entropy, logits, mask, settings, denominator)

    stats = _loss_stats(
        loss, pg_loss, ratios, log_ratio, advantages, mask, settings, kl_per_token, tis_weights, tis_cut,
        entropy, logits,
    )  # fmt: skip
    return loss, LossStats(stats, entropy_measured=entropy is not None or logits is not None)


def _masked_k3(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """k3 KL to the reference per action token [B, T], 0 elsewhere. Masked inputs (not only a masked
    sum): no padded garbage may reach exp() or its gradient."""
    zeros = torch.zeros_like(logprobs)  # [B, T]
    return k3_kl(torch.where(mask, logprobs, zeros), torch.where(mask, ref_logprobs.detach(), zeros))


def _entropy_bonus(
    entropy: Tensor | None,
    logits: Tensor | None,
    mask: Tensor,
    settings: LossSettings,
    denominator: float | None,
) -> Tensor:
    """The aggregated action-token entropy the loss subtracts (times entropy_coef), 0 where the
    micro-batch's mean entropy is at or above `entropy_floor`."""
    ent = entropy if entropy is not None else token_entropy(logits)  # type: ignore[arg-type]  # [B, T]
    ent = torch.where(mask, ent, torch.zeros_like(ent))  # [B, T]; no padded value reaches the gradient
    bonus = aggregate(ent, mask.to(ent.dtype), settings.agg, denominator)
    if settings.entropy_floor is None:
        return bonus
    mean = ent.detach().sum() / mask.sum().clamp_min(1)
    return bonus * (mean < settings.entropy_floor).to(bonus.dtype)


def _tis_weights(
    logprobs: Tensor,
    old_logprobs: Tensor | None,
    behavior_logprobs: Tensor,
    mask: Tensor,
    settings: LossSettings,
) -> tuple[Tensor, Tensor]:
    """`importance_weights` when TIS is on; else weights 1 that cut nothing (for the metrics)."""
    if settings.tis_cap is None:
        return torch.ones_like(logprobs), torch.zeros_like(mask)  # [B, T], [B, T]
    assert old_logprobs is not None
    return importance_weights(
        old_logprobs, behavior_logprobs, mask, settings.tis_cap, settings.tis_level, settings.tis_mode
    )  # [B, T], [B, T]


def _per_token_advantages(advantages: Tensor, dtype: torch.dtype, loss_mask: Tensor) -> Tensor:
    """[B] advantages broadcast over each sequence's action tokens, or [B, T] as given; detached."""
    if advantages.dim() == 1:
        advantages = broadcast_advantages(advantages.to(dtype), loss_mask)  # [B, T]
    elif advantages.shape != loss_mask.shape:
        raise ValueError(
            f"advantages must be [B] or [B, T] = {tuple(loss_mask.shape)}, got {tuple(advantages.shape)}"
        )
    return advantages.detach()


def _check_loss_inputs(
    logprobs: Tensor,
    behavior_logprobs: Tensor,
    loss_mask: Tensor,
    settings: LossSettings,
    old_logprobs: Tensor | None,
    ref_logprobs: Tensor | None,
    entropy: Tensor | None = None,
    logits: Tensor | None = None,
) -> None:
    """`policy_loss`'s inputs, each wrong one a ValueError that says what to pass."""
    clip_low, clip_high, ratio = settings.clip_low, settings.clip_high, settings.ratio
    kl_coef, tis_cap = settings.kl_coef, settings.tis_cap
    tis_level, tis_mode = settings.tis_level, settings.tis_mode
    if logprobs.shape != loss_mask.shape or behavior_logprobs.shape != loss_mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, behavior_logprobs {tuple(behavior_logprobs.shape)} and "
            f"loss_mask {tuple(loss_mask.shape)} must all be [B, T]"
        )
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ValueError(
            f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, clip_high={clip_high}"
        )
    if ratio not in ("token", "sequence"):
        raise ValueError(f"ratio must be 'token' or 'sequence', got {ratio!r}")
    if tis_cap is not None and old_logprobs is None:
        raise ValueError(
            "tis_cap needs old_logprobs: TIS reweights by exp(old_logprobs - behavior_logprobs); pass the "
            "trainer's log-probs from before the update, or set tis_cap=None"
        )
    if tis_cap is not None and tis_cap <= (1.0 if tis_mode == "mask" else 0.0):
        raise ValueError(
            f"tis_cap must be {'above 1 to mask' if tis_mode == 'mask' else 'positive'}, got {tis_cap}"
        )
    if tis_level not in ("token", "sequence") or tis_mode not in ("truncate", "mask"):
        raise ValueError(
            f"tis_level must be token or sequence and tis_mode truncate or mask; got {tis_level!r}, {tis_mode!r}"
        )
    if ref_logprobs is None and kl_coef != 0.0:
        raise ValueError(
            "kl_coef is non-zero but no ref_logprobs were given; pass the reference model's log-probs"
        )
    if settings.entropy_coef > 0.0:
        given = entropy if entropy is not None else logits
        if given is None or not given.requires_grad:
            raise ValueError(
                "entropy_coef is non-zero but no differentiable entropy (or logits) was given; pass "
                "action_logprobs(..., with_entropy=True, entropy_grad=True).entropy"
            )


def _loss_stats(
    loss: Tensor,
    pg_loss: Tensor,
    ratios: Tensor,
    log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    settings: LossSettings,
    kl_per_token: Tensor | None,
    tis_weights: Tensor,
    tis_cut: Tensor,
    entropy: Tensor | None,
    logits: Tensor | None,
) -> Tensor:
    """`LossStats.values` of one `policy_loss` call: [len(LOSS_FIELDS)], fp32, detached."""
    clip_low, clip_high = settings.clip_low, settings.clip_high
    with torch.no_grad():
        r = ratios.detach()  # [B, T]
        on = mask.to(r.dtype)  # [B, T]
        n = on.sum()
        denom = n.clamp_min(1.0)

        def token_mean(x: Tensor) -> Tensor:
            return torch.where(mask, x, torch.zeros_like(x)).sum() / denom

        big = torch.finfo(r.dtype).max
        no_kl = torch.zeros((), dtype=r.dtype, device=r.device)
        # One stacked tensor: one device sync reads all the metrics, when the caller reads them.
        return torch.stack(
            [
                loss.detach().to(r.dtype),
                pg_loss.detach().to(r.dtype),
                (on * ((r < 1.0 - clip_low) & (advantages < 0))).sum() / denom,
                (on * ((r > 1.0 + clip_high) & (advantages > 0))).sum() / denom,
                torch.where(n > 0, token_mean(r), 1.0),
                torch.where(n > 0, torch.where(mask, r, big).min(), 1.0),
                torch.where(n > 0, torch.where(mask, r, -big).max(), 1.0),
                token_mean((r - 1.0) - log_ratio.detach()),  # k3 of the ratio; log r = log_ratio
                token_mean(kl_per_token.detach()) if kl_per_token is not None else no_kl,
                token_mean(entropy.detach().to(r.dtype))
                if entropy is not None
                else token_mean(token_entropy(logits).to(r.dtype))
                if logits is not None
                else no_kl,
                torch.where(n > 0, token_mean(tis_weights), 1.0),
                tis_cut.to(r.dtype).sum() / denom,
                n,
                (mask.sum(-1) > 0).sum().to(r.dtype),
            ]
        )  # [14]


RATIO_BIN = 0.002
"""Width of a bin of `ratio_histogram` in log-ratio: quantiles are exact to 0.2% of the ratio."""
RATIO_BINS = 1000
"""Bins each side of log-ratio 0: ratios beyond exp(±2) (7.39, 0.135) count in the outermost bin."""


def ratio_histogram(trainer_logprobs: Tensor, behavior_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """Counts of the importance ratio ρ = exp(trainer - behaviour) of the action tokens in fixed bins of
    log ρ (`RATIO_BIN` wide, centred on 0, clamped at ±`RATIO_BINS` bins): [2·RATIO_BINS + 1], float64.
    Histograms add over micro-batches and ranks; `histogram_quantiles` reads quantiles off the sum."""
    with torch.no_grad():
        mask = loss_mask.bool()  # [B, T]
        log_ratio = (trainer_logprobs.double() - behavior_logprobs.double())[mask]  # [N]
        index = (log_ratio / RATIO_BIN).round().clamp(-RATIO_BINS, RATIO_BINS).long() + RATIO_BINS  # [N]
        return torch.bincount(index, minlength=2 * RATIO_BINS + 1).double()  # [2K+1]


def histogram_quantiles(counts: Tensor, quantiles: Sequence[float]) -> dict[float, float]:
    """The ratio at each quantile of a `ratio_histogram` (its bin's centre); {} when it counts nothing."""
    total = float(counts.sum())
    if total == 0.0:
        return {}
    cumulative = counts.double().cumsum(0)  # [2K+1]
    out = {}
    for q in quantiles:
        k = int(
            torch.searchsorted(cumulative, torch.tensor(q * total, dtype=torch.float64)).clamp(
                max=len(counts) - 1
            )
        )
        out[q] = math.exp((k - RATIO_BINS) * RATIO_BIN)
    return out


def logprob_mismatch(
    trainer_logprobs: Tensor, behavior_logprobs: Tensor, loss_mask: Tensor
) -> dict[str, float]:
    """How far the engine's behaviour log-probs are from the trainer's, on the action tokens: the proof that
    the engine samples from the policy the trainer holds (the same weights, the newest adapter).

    `trainer_logprobs` are the trainer's for the same tokens with the weights the batch was sampled with
    (before any update on it). Returns the means over action tokens of |Δ| (`logprob_abs_diff`) and of the
    k3 estimate of KL(behaviour ‖ trainer) (`kl`: the tokens were drawn by the behaviour policy), the
    largest |Δ| (`logprob_abs_diff_max`) and the token count (`tokens`). fp32 on both sides gives ~1e-6;
    bf16 engines ~1e-2 |Δ|; an engine on stale weights or a stale adapter grows with every step.
    """
    if trainer_logprobs.shape != loss_mask.shape or behavior_logprobs.shape != loss_mask.shape:
        raise ValueError(
            f"trainer_logprobs {tuple(trainer_logprobs.shape)}, behavior_logprobs "
            f"{tuple(behavior_logprobs.shape)} and loss_mask {tuple(loss_mask.shape)} must all be [B, T]"
        )
    abs_sum, kl_sum, abs_max, n = mismatch_sums(trainer_logprobs, behavior_logprobs, loss_mask).tolist()
    if n == 0.0:
        return {"logprob_abs_diff": 0.0, "logprob_abs_diff_max": 0.0, "kl": 0.0, "tokens": 0.0}
    return {"logprob_abs_diff": abs_sum / n, "logprob_abs_diff_max": abs_max, "kl": kl_sum / n, "tokens": n}


def mismatch_sums(trainer_logprobs: Tensor, behavior_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """What `logprob_mismatch` reads, left on the device: [sum of |Δ|, sum of the k3 KL, largest |Δ|, tokens]
    over the action tokens, float64 (sums add up over micro-batches, to be divided by the tokens once)."""
    if trainer_logprobs.shape != loss_mask.shape or behavior_logprobs.shape != loss_mask.shape:
        raise ValueError(
            f"trainer_logprobs {tuple(trainer_logprobs.shape)}, behavior_logprobs "
            f"{tuple(behavior_logprobs.shape)} and loss_mask {tuple(loss_mask.shape)} must all be [B, T]"
        )
    with torch.no_grad():
        mask = loss_mask.to(torch.float64)  # [B, T]
        delta = (
            (trainer_logprobs.double() - behavior_logprobs.double()) * mask
        ).abs()  # [B, T], 0 off the mask
        kl = k3_kl(behavior_logprobs.double(), trainer_logprobs.double()) * mask  # [B, T]
        return torch.stack([delta.sum(), kl.sum(), delta.max(), mask.sum()])  # [4]
