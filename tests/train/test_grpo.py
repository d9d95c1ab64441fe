"""GRPO advantages and policy loss against hand-computed values (arithmetic in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.train.batch import token_entropy
from agentrl.train.config import LossSettings
from agentrl.train.grpo import (
    LOSS_FIELDS,
    LossMetrics,
    LossStats,
    aggregate,
    broadcast_advantages,
    group_advantages,
    k3_kl,
    policy_loss,
    weight_negatives,
)

AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def loss_of(
    logprobs: torch.Tensor,
    behavior: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    **kwargs,
) -> tuple[torch.Tensor, LossMetrics]:
    """`policy_loss` with its settings given by name (TIS off unless `tis_cap` is), the metrics read: the
    hand-computed cases below each name the one or two settings they are about."""
    named = {k: v for k, v in kwargs.items() if k in LossSettings.model_fields}
    tensors = {k: v for k, v in kwargs.items() if k not in named}
    loss, stats = policy_loss(
        logprobs, behavior, advantages, mask, LossSettings(**{"tis_cap": None, **named}), **tensors
    )
    return loss, stats.metrics()


def close(actual: torch.Tensor | float, expected, atol: float = 1e-5) -> None:
    actual_t = torch.as_tensor(actual, dtype=torch.float64)
    expected_t = torch.as_tensor(expected, dtype=torch.float64)
    assert torch.allclose(actual_t, expected_t, atol=atol, rtol=0), f"{actual_t} != {expected_t}"


# --- group_advantages -----------------------------------------------------------------------


# Interleaved groups: a = rewards at positions 0, 2, 4, 5; b = positions 1, 3.
REWARDS = torch.tensor([1.0, 2.0, 0.0, 4.0, 0.0, 0.0])
GROUPS = ["a", "b", "a", "b", "a", "a"]


def test_group_advantages_use_the_unbiased_sample_std() -> None:
    # group a: r = (1, 0, 0, 0), mean 0.25, deviations (0.75, -0.25, -0.25, -0.25)
    #   Σ dev² = 0.5625 + 3·0.0625 = 0.75; sample var = 0.75 / (4 - 1) = 0.25; std = 0.5
    #   A = (1.5, -0.5, -0.5, -0.5)   (the population std sqrt(0.1875) = 0.433 would give 1.732)
    # group b: r = (2, 4), mean 3, sample var = (1 + 1) / 1 = 2, std = 1.41421; A = (-0.70711, 0.70711)
    adv = group_advantages(REWARDS, GROUPS, scale="group", eps=0.0)
    close(adv, [1.5, -1 / math.sqrt(2), -0.5, 1 / math.sqrt(2), -0.5, -0.5])
    # eps is added to the std: 0.75 / (0.5 + 1e-6)
    close(group_advantages(REWARDS, GROUPS)[0], 0.75 / (0.5 + 1e-6), atol=1e-7)


def test_group_advantages_without_scaling_are_centred_rewards() -> None:
    # Dr. GRPO: A = r - mean: a -> (0.75, -0.25, -0.25, -0.25), b -> (-1, 1)
    adv = group_advantages(REWARDS, GROUPS, scale="none")
    close(adv, [0.75, -1.0, -0.25, 1.0, -0.25, -0.25])


def test_group_advantages_two_member_binary_group() -> None:
    # r = (0, 1): mean 0.5, sample std sqrt(((0.5)² + (0.5)²) / 1) = 0.70711, A = ∓0.70711
    close(group_advantages(torch.tensor([0.0, 1.0]), ["g", "g"], eps=0.0), [-0.70711, 0.70711])


def test_all_equal_rewards_and_singletons_give_exactly_zero() -> None:
    # 0.1 three times: a float mean could leave ~1e-17 behind; max == min forces exact 0.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 1.0, 1.0], dtype=torch.float64)
    groups = ["x", "x", "x", "single", "y", "y"]
    for scale in ("group", "none"):
        adv = group_advantages(rewards, groups, scale=scale)
        assert torch.equal(adv, torch.zeros(6, dtype=torch.float64))
        assert adv.dtype == torch.float64


def test_an_episode_of_several_branches_weighs_one_in_its_group() -> None:
    # Episodes (1, 0, 0), the first one of three branches: weights 1/3 each on its trajectories.
    # Per episode: mean 1/3, sample std sqrt(((2/3)² + 2·(1/3)²) / 2) = sqrt(1/3) = 0.57735,
    # A = (1.1547, -0.57735, -0.57735), each branch taking its episode's advantage.
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0])
    weights = torch.tensor([1 / 3, 1 / 3, 1 / 3, 1.0, 1.0])
    adv = group_advantages(rewards, ["g"] * 5, eps=0.0, weights=weights)
    episodes = group_advantages(torch.tensor([1.0, 0.0, 0.0]), ["g"] * 3, eps=0.0)
    close(episodes, [2 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)])
    close(adv, [episodes[0]] * 3 + [episodes[1]] * 2)
    close(group_advantages(rewards, ["g"] * 5, scale="none", weights=weights), [2 / 3] * 3 + [-1 / 3] * 2)
    # unweighted, the branches would count three times: mean 0.6
    close(group_advantages(rewards, ["g"] * 5, scale="none"), [0.4] * 3 + [-0.6] * 2)
    with pytest.raises(ValueError, match="weights must be positive"):
        group_advantages(rewards, ["g"] * 5, weights=torch.zeros(5))


def test_group_ids_as_a_tensor_match_strings() -> None:
    ids = torch.tensor([7, 3, 7, 3, 7, 7])
    assert torch.equal(group_advantages(REWARDS, ids), group_advantages(REWARDS, GROUPS))


def test_group_advantages_reject_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="one group id per trajectory"):
        group_advantages(REWARDS, ["a"])


def test_weight_negatives_scales_only_negative_advantages() -> None:
    adv = torch.tensor([-1.0, 0.5, 0.0, -2.0])
    close(weight_negatives(adv, 0.25), [-0.25, 0.5, 0.0, -0.5])
    close(weight_negatives(adv, 0.0), [0.0, 0.5, 0.0, 0.0])  # positive-sample reinforcement only
    assert weight_negatives(adv, 1.0) is adv  # plain GRPO: untouched
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        weight_negatives(adv, 1.5)


def test_broadcast_advantages_fill_action_tokens_only() -> None:
    mask = torch.tensor([[0, 1, 1], [0, 0, 1]], dtype=torch.float32)
    out = broadcast_advantages(torch.tensor([2.0, -1.0]), mask)
    assert torch.equal(out, torch.tensor([[0.0, 2.0, 2.0], [0.0, 0.0, -1.0]]))


# --- aggregation ----------------------------------------------------------------------------

# Ragged batch: row 0 has 3 action tokens, row 1 one, row 2 none. Garbage (nan, inf) off the mask.
NAN, INF = float("nan"), float("inf")
PER_TOKEN = torch.tensor([[NAN, 1.0, 2.0, 3.0], [INF, NAN, 4.0, -INF], [NAN, 5.0, 6.0, 7.0]])
MASK = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 0], [0, 0, 0, 0]], dtype=torch.float32)


@pytest.mark.parametrize(
    ("agg", "expected"),
    [
        # token-mean: (1 + 2 + 3 + 4) / 4 tokens = 2.5
        ("token-mean", 2.5),
        # seq-mean-token-sum: per-sequence sums (6, 4), the empty row 2 does not count: (6 + 4) / 2 = 5
        ("seq-mean-token-sum", 5.0),
        # seq-mean-token-mean: per-sequence means (2, 4): (2 + 4) / 2 = 3
        ("seq-mean-token-mean", 3.0),
    ],
)
def test_aggregations_on_a_ragged_batch(agg: str, expected: float) -> None:
    close(aggregate(PER_TOKEN, MASK, agg), expected)


@pytest.mark.parametrize(
    ("agg", "expected"),
    [("token-mean", 2.5), ("seq-mean-token-sum", 5.0), ("seq-mean-token-mean", 3.0)],
)
def test_policy_loss_aggregations_on_a_ragged_batch(agg: str, expected: float) -> None:
    # ratio 1 everywhere (logprobs == behaviour), so per-token loss = -min(A, clip(1)·A) = -A.
    # With A = -PER_TOKEN on the mask the loss is aggregate(PER_TOKEN), as above.
    logprobs = torch.full((3, 4), -1.0)
    advantages = torch.where(MASK.bool(), -PER_TOKEN, torch.zeros_like(PER_TOKEN))
    loss, metrics = loss_of(logprobs, logprobs.clone(), advantages, MASK, agg=agg)
    close(loss, expected)
    assert metrics.num_action_tokens == 4 and metrics.num_sequences == 2


def test_global_denominator_makes_micro_batch_losses_sum_to_the_full_loss() -> None:
    torch.manual_seed(0)
    logprobs = (torch.randn(4, 5) * 0.1 - 1.0).requires_grad_()
    behavior = logprobs.detach() + torch.randn(4, 5) * 0.05
    mask = torch.tensor(
        [[0, 1, 1, 1, 1], [0, 0, 1, 1, 0], [0, 1, 0, 0, 0], [0, 0, 0, 1, 1]], dtype=torch.float32
    )
    adv = torch.tensor([1.0, -0.5, 0.3, -2.0])
    for agg in AGGS:
        full, _ = loss_of(logprobs, behavior, adv, mask, agg=agg)
        (full_grad,) = torch.autograd.grad(full, logprobs)
        denom = mask.sum().item() if agg == "token-mean" else 4
        parts = [
            loss_of(logprobs[s], behavior[s], adv[s], mask[s], agg=agg, denominator=denom)[0]
            for s in (slice(0, 1), slice(1, 4))
        ]
        (parts_grad,) = torch.autograd.grad(parts[0] + parts[1], logprobs)
        close(parts[0] + parts[1], full.detach())
        close(parts_grad, full_grad)


# --- clipping -------------------------------------------------------------------------------


def test_clip_low_and_clip_high_activate_on_known_ratios_with_the_analytic_gradient() -> None:
    # Sequence 0: A = +1, ratios (0.7, 1.2, 1.4); sequence 1: A = -1, ratios (0.7, 0.9, 1.4).
    # clip_low = 0.2, clip_high = 0.28 -> clip range [0.8, 1.28].
    # per-token objective min(rA, clip(r)A):
    #   seq 0: r=0.7 -> min(0.7, 0.8) = 0.7       (unclipped: A > 0 and r low is not clipped)
    #          r=1.2 -> min(1.2, 1.2) = 1.2       (inside)
    #          r=1.4 -> min(1.4, 1.28) = 1.28     (clip-high active)
    #   seq 1: r=0.7 -> min(-0.7, -0.8) = -0.8    (clip-low active)
    #          r=0.9 -> -0.9                      (inside)
    #          r=1.4 -> min(-1.4, -1.28) = -1.4   (unclipped: A < 0 and r high is not clipped)
    # token-mean loss = -(0.7 + 1.2 + 1.28 - 0.8 - 0.9 - 1.4) / 6 = -0.08 / 6 = -0.0133333
    ratios = torch.tensor([[1.0, 0.7, 1.2, 1.4], [1.0, 0.7, 0.9, 1.4]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.float32)
    behavior = torch.full((2, 4), -2.0)
    logprobs = (behavior + ratios.log()).requires_grad_()
    loss, m = loss_of(logprobs, behavior, torch.tensor([1.0, -1.0]), mask, clip_low=0.2, clip_high=0.28)
    close(loss, -0.08 / 6)
    close(m.clip_fraction_high, 1 / 6)
    close(m.clip_fraction_low, 1 / 6)
    # ratio stats over the six action tokens: mean 6.3 / 6 = 1.05, min 0.7, max 1.4
    close([m.ratio_mean, m.ratio_min, m.ratio_max], [1.05, 0.7, 1.4])
    # d loss / d logp = -A·r / N where unclipped (dr/dlogp = r), 0 where the clip is active:
    #   seq 0: (-0.7/6, -1.2/6, 0); seq 1: (0, 0.9/6, 1.4/6)
    (grad,) = torch.autograd.grad(loss, logprobs)
    close(grad, [[0.0, -0.7 / 6, -1.2 / 6, 0.0], [0.0, 0.0, 0.9 / 6, 1.4 / 6]])


def test_clip_higher_is_what_keeps_the_gradient_of_a_growing_positive_token() -> None:
    # r = 1.2, A = +1: symmetric clip 0.1 caps it at 1.1 (gradient 0); clip_high 0.28 does not.
    behavior = torch.tensor([[0.0, -1.0]])
    logprobs = (behavior + torch.tensor([[0.0, math.log(1.2)]])).requires_grad_()
    mask = torch.tensor([[0.0, 1.0]])
    for clip_high, expected_grad, clipped in ((0.1, 0.0, 1.0), (0.28, -1.2, 0.0)):
        loss, m = loss_of(logprobs, behavior, torch.tensor([1.0]), mask, clip_low=0.1, clip_high=clip_high)
        (grad,) = torch.autograd.grad(loss, logprobs)
        close(grad[0, 1], expected_grad)
        close(m.clip_fraction_high, clipped)


def test_approx_kl_is_k3_of_the_ratio() -> None:
    # r = e^0.1 on one token: (r - 1) - log r = 0.1051709 - 0.1 = 0.0051709
    logprobs = torch.tensor([[0.0, -1.0 + 0.1]])
    _, m = loss_of(logprobs, torch.tensor([[0.0, -1.0]]), torch.tensor([0.5]), torch.tensor([[0.0, 1.0]]))
    close(m.approx_kl, math.exp(0.1) - 1 - 0.1)


# --- GSPO -----------------------------------------------------------------------------------


def _gspo_example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # seq 0: log-ratios (0.1, 0.3) -> mean 0.2 -> s0 = e^0.2 = 1.221403, A0 = +1
    # seq 1: log-ratios (-0.5, -0.3, -0.1) -> mean -0.3 -> s1 = e^-0.3 = 0.740818, A1 = -1
    behavior = torch.tensor([[0.0, -1.0, -2.0, 0.0], [0.0, -0.5, -1.5, -0.7]])
    log_ratio = torch.tensor([[0.0, 0.1, 0.3, 0.0], [0.0, -0.5, -0.3, -0.1]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.float32)
    return behavior, (behavior + log_ratio).requires_grad_(), mask, torch.tensor([1.0, -1.0])


def test_gspo_sequence_ratio_on_two_sequences() -> None:
    behavior, logprobs, mask, adv = _gspo_example()
    s0, s1 = math.exp(0.2), math.exp(-0.3)
    # clip range [0.8, 1.28]: s0 = 1.2214 inside; s1 = 0.7408 < 0.8 with A < 0 -> clip-low active.
    # seq-mean-token-mean: seq 0 -> -s0·1 = -1.221403; seq 1 -> -min(-0.740818, -0.8) = 0.8
    # loss = (-1.221403 + 0.8) / 2 = -0.2107014
    loss, m = loss_of(logprobs, behavior, adv, mask, ratio="sequence", agg="seq-mean-token-mean")
    close(loss, (-s0 + 0.8) / 2)
    # every token carries its sequence's ratio: mean over the 5 tokens = (2·s0 + 3·s1) / 5
    close([m.ratio_mean, m.ratio_min, m.ratio_max], [(2 * s0 + 3 * s1) / 5, s1, s0])
    close([m.clip_fraction_low, m.clip_fraction_high], [3 / 5, 0.0])
    # GSPO-token gradient: -A·s / (|y|·S) per unclipped token: seq 0 -> -1.221403 / (2·2) = -0.305351; seq 1 -> 0
    (grad,) = torch.autograd.grad(loss, logprobs)
    close(grad, [[0.0, -s0 / 4, -s0 / 4, 0.0], [0.0] * 4])


def test_gspo_token_form_has_the_gradient_of_the_plain_sequence_objective() -> None:
    # Plain GSPO: J = (1/S) Σ_b min(s_b A_b, clip(s_b) A_b), s_b = exp(mean_t(logp - old)).
    behavior, logprobs, mask, adv = _gspo_example()
    for clip_low in (0.2, 0.5):  # 0.5 also leaves sequence 1 unclipped
        loss, _ = loss_of(
            logprobs, behavior, adv, mask, clip_low=clip_low, ratio="sequence", agg="seq-mean-token-mean"
        )
        (grad_token_form,) = torch.autograd.grad(loss, logprobs)
        s = (((logprobs - behavior) * mask).sum(-1) / mask.sum(-1)).exp()  # [B]
        plain = -torch.minimum(s * adv, s.clamp(1 - clip_low, 1.28) * adv).mean()
        (grad_plain,) = torch.autograd.grad(plain, logprobs)
        close(loss, plain.detach())
        close(grad_token_form, grad_plain)


def test_gspo_ratio_differs_from_the_token_ratio() -> None:
    behavior, logprobs, mask, adv = _gspo_example()
    token_loss, _ = loss_of(logprobs, behavior, adv, mask, ratio="token", agg="seq-mean-token-mean")
    seq_loss, _ = loss_of(logprobs, behavior, adv, mask, ratio="sequence", agg="seq-mean-token-mean")
    # token ratios of seq 0: e^0.1, e^0.3 -> its mean objective (1.105171 + 1.28 clipped) / 2 = 1.192585
    # seq 1 token ratios e^-0.5 = 0.6065 (clip-low active -> -0.8), e^-0.3 (-> -0.8), e^-0.1 = 0.904837
    #   objective mean (-0.8 - 0.8 - 0.904837) / 3 = -0.834946; loss = -(1.192585 - 0.834946) / 2 = -0.178820
    close(token_loss, -((math.exp(0.1) + 1.28) / 2 - (1.6 + math.exp(-0.1)) / 3) / 2)
    assert not torch.isclose(token_loss, seq_loss)


# --- k3 KL to a reference -------------------------------------------------------------------


def test_k3_values() -> None:
    # delta = ref - logp:  0 -> e^0 - 0 - 1 = 0
    #                      log 0.5 = -0.693147 -> 0.5 + 0.693147 - 1 = 0.193147
    #                      1 -> e - 1 - 1 = 0.718282
    logp = torch.tensor([-1.0, math.log(0.5), -2.0])
    ref = torch.tensor([-1.0, math.log(0.25), -1.0])
    close(k3_kl(logp, ref), [0.0, 0.5 + math.log(2) - 1, math.e - 2])


def test_kl_term_is_added_with_its_coefficient_and_gradient() -> None:
    # Zero advantages: the policy term is 0, loss = kl_coef · token-mean(k3).
    # k3 on the two action tokens: 0.193147 and 0.718282 -> mean 0.455714; × 0.1 = 0.0455714
    # d k3 / d logp = 1 - exp(ref - logp): (1 - 0.5, 1 - e) = (0.5, -1.718282); × 0.1 / 2 tokens
    logp = torch.tensor([[0.0, math.log(0.5), -2.0]], requires_grad=True)
    ref = torch.tensor([[5.0, math.log(0.25), -1.0]])  # position 0 is off the mask: ignored
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    loss, m = loss_of(logp, logp.detach(), torch.zeros(1), mask, ref_logprobs=ref, kl_coef=0.1)
    k3 = [0.5 + math.log(2) - 1, math.e - 2]
    close(loss, 0.1 * sum(k3) / 2)
    close(m.kl_ref, sum(k3) / 2)
    close(m.pg_loss, 0.0)
    (grad,) = torch.autograd.grad(loss, logp)
    close(grad, [[0.0, 0.1 * 0.5 / 2, 0.1 * (1 - math.e) / 2]])


def test_kl_coef_without_reference_is_an_error() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        loss_of(x, x, torch.zeros(1), torch.ones(1, 2), kl_coef=0.1)


# --- truncated importance sampling ----------------------------------------------------------


def test_tis_weights_are_capped_and_multiply_the_policy_term() -> None:
    # old - behavior = (log 3, log 0.5, 0) -> exp = (3, 0.5, 1) -> min(., cap 2) = (2, 0.5, 1)
    # logprobs == old: PPO ratio 1, per-token loss = -A·w = (-2, -0.5, -1) for A = 1
    # token-mean = -3.5 / 3 = -1.166667; TIS weight mean 3.5 / 3; capped fraction 1/3
    behavior = torch.tensor([[0.0, -1.0 - math.log(3), -1.0 - math.log(0.5), -1.0]])
    old = torch.full((1, 4), -1.0)
    logprobs = old.clone().requires_grad_()
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    loss, m = loss_of(logprobs, behavior, torch.tensor([1.0]), mask, old_logprobs=old, tis_cap=2.0)
    close(loss, -3.5 / 3)
    close([m.tis_weight_mean, m.tis_clip_fraction], [3.5 / 3, 1 / 3])
    # gradient -A·r·w / N = (-2/3, -0.5/3, -1/3): the weight scales it, no gradient flows into it
    (grad,) = torch.autograd.grad(loss, logprobs)
    close(grad, [[0.0, -2 / 3, -0.5 / 3, -1 / 3]])


def test_masked_is_drops_tokens_outside_the_band_and_keeps_the_ratio_inside() -> None:
    # The same tokens: behaviour ratios (3, 0.5, 1), band [1/2, 2]: 3 leaves it -> weight 0;
    # 0.5 and 1 stay, with their ratio as weight. Per-token loss (0, -0.5, -1); token-mean -1.5 / 3.
    behavior = torch.tensor([[0.0, -1.0 - math.log(3), -1.0 - math.log(0.5), -1.0]])
    old = torch.full((1, 4), -1.0)
    logprobs = old.clone().requires_grad_()
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    loss, m = loss_of(
        logprobs, behavior, torch.tensor([1.0]), mask, old_logprobs=old, tis_cap=2.0, tis_mode="mask"
    )
    close(loss, -1.5 / 3)
    close([m.tis_weight_mean, m.tis_clip_fraction], [1.5 / 3, 1 / 3])
    (grad,) = torch.autograd.grad(loss, logprobs)
    close(grad, [[0.0, 0.0, -0.5 / 3, -1 / 3]])
    with pytest.raises(ValueError, match="above 1 to mask"):
        loss_of(logprobs, behavior, torch.tensor([1.0]), mask, old_logprobs=old, tis_cap=1.0, tis_mode="mask")


def test_sequence_level_is_weighs_every_token_by_the_geometric_mean_ratio() -> None:
    # Sequence 0: token ratios (3, 0.5, 1) -> geometric mean (1.5)^(1/3) = 1.14471 on each token (under
    # the cap of 2). Sequence 1: ratios (4, 4) -> 4 -> truncated to 2; masked (band [1/2, 2]) -> 0.
    behavior = torch.tensor(
        [[-1.0 - math.log(3), -1.0 - math.log(0.5), -1.0], [-1.0 - math.log(4), -1.0 - math.log(4), 0.0]]
    )
    old = torch.full((2, 3), -1.0)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    g = 1.5 ** (1 / 3)
    for mode, w1 in (("truncate", 2.0), ("mask", 0.0)):
        loss, m = loss_of(
            old,
            behavior,
            torch.tensor([1.0, 1.0]),
            mask,
            old_logprobs=old,
            tis_cap=2.0,
            tis_level="sequence",
            tis_mode=mode,
        )
        # token-mean over 5 tokens: -(3g + 2·w1) / 5; sequence 1 is the one cut (2 of 5 tokens)
        close(loss, -(3 * g + 2 * w1) / 5)
        close([m.tis_weight_mean, m.tis_clip_fraction], [(3 * g + 2 * w1) / 5, 2 / 5])


def test_ppo_ratio_is_taken_against_old_logprobs_when_given() -> None:
    # logp - old = log 1.1 (ratio 1.1 inside the clip), behaviour far away: loss = -1.1·A = -1.1
    logprobs = torch.tensor([[0.0, math.log(1.1) - 1.0]])
    old = torch.tensor([[0.0, -1.0]])
    behavior = torch.tensor([[0.0, -3.0]])
    mask = torch.tensor([[0.0, 1.0]])
    loss, m = loss_of(logprobs, behavior, torch.tensor([1.0]), mask, old_logprobs=old)
    close(loss, -1.1)
    assert m.tis_weight_mean == 1.0  # no tis_cap: no correction
    # without old_logprobs the ratio is against behaviour: e^(log 1.1 + 2) = 8.13 -> clipped at 1.28
    loss_b, _ = loss_of(logprobs, behavior, torch.tensor([1.0]), mask)
    close(loss_b, -1.28)


def test_tis_cap_without_old_logprobs_is_an_error() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="old_logprobs"):
        loss_of(x, x, torch.zeros(1), torch.ones(1, 2), tis_cap=2.0)


# --- degenerate cases -----------------------------------------------------------------------


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("ratio", ["token", "sequence"])
def test_empty_mask_gives_zero_loss_and_a_finite_zero_gradient(agg: str, ratio: str) -> None:
    # No action tokens anywhere, and garbage (inf) in the padded log-probs.
    logprobs = torch.tensor([[-1.0, -INF, -2.0], [0.0, -1.0, -INF]], requires_grad=True)
    behavior = torch.tensor([[INF, 0.0, -INF], [0.0, NAN, 0.0]])
    ref = torch.tensor([[0.0, -INF, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.zeros(2, 3)
    loss, m = loss_of(
        logprobs, behavior, torch.tensor([1.0, -1.0]), mask, agg=agg, ratio=ratio,
        old_logprobs=behavior, tis_cap=2.0, ref_logprobs=ref, kl_coef=0.1,
    )  # fmt: skip
    assert loss.item() == 0.0
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert torch.equal(grad, torch.zeros_like(grad))
    assert m.num_action_tokens == 0 and m.num_sequences == 0
    assert all(math.isfinite(v) for v in (m.loss, m.approx_kl, m.kl_ref, m.ratio_mean, m.tis_weight_mean))


def test_one_token_sequences() -> None:
    # Two sequences with one action token each: every aggregation is the plain mean, and the
    # GSPO ratio of a one-token sequence is its token ratio.
    # ratios e^0.1 = 1.105171 (A = 1) and e^-0.1 = 0.904837 (A = -1), both inside [0.8, 1.28]
    # loss = -(1.105171 - 0.904837) / 2 = -0.100167
    behavior = torch.tensor([[0.0, -1.0], [0.0, -2.0]])
    logprobs = behavior + torch.tensor([[0.0, 0.1], [0.0, -0.1]])
    mask = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    expected = -(math.exp(0.1) - math.exp(-0.1)) / 2
    for agg in AGGS:
        for ratio in ("token", "sequence"):
            loss, _ = loss_of(logprobs, behavior, torch.tensor([1.0, -1.0]), mask, agg=agg, ratio=ratio)
            close(loss, expected)


def test_all_equal_rewards_give_zero_loss_and_zero_gradient() -> None:
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0])
    adv = group_advantages(rewards, ["a", "a", "a", "b", "b"])
    logprobs = torch.randn(5, 4).requires_grad_()
    mask = torch.tensor([[0, 1, 1, 1]] * 5, dtype=torch.float32)
    loss, m = loss_of(logprobs, logprobs.detach() + 0.3, adv, mask)
    assert loss.item() == 0.0
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert torch.equal(grad, torch.zeros_like(grad))
    assert m.clip_fraction_low == 0.0 and m.clip_fraction_high == 0.0


# --- metrics --------------------------------------------------------------------------------


def test_an_entropy_bonus_subtracts_the_aggregated_entropy_and_its_gradient() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, requires_grad=True)  # [B, T, V]
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    x = torch.full((2, 3), -1.0)
    entropy = token_entropy(logits)  # [B, T]
    plain, _ = loss_of(x, x, torch.ones(2), mask, entropy=entropy)
    loss, m = loss_of(x, x, torch.ones(2), mask, entropy=entropy, entropy_coef=0.1)
    mean = (entropy * mask).sum() / mask.sum()  # token-mean over the action tokens
    close(loss, plain - 0.1 * mean)
    close(m.loss, loss.detach())
    close(m.entropy, mean.detach())
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    (ref,) = torch.autograd.grad(-0.1 * mean, logits)
    torch.testing.assert_close(grad, ref)
    # Position t's entropy is that of the logits at t - 1: those no action token is drawn from get none.
    assert grad[0, 2].abs().sum() == 0 and grad[1, 0].abs().sum() == 0 and grad[1, 2].abs().sum() == 0
    # Logits instead of entropies: the same bonus.
    from_logits, _ = loss_of(x, x, torch.ones(2), mask, logits=logits, entropy_coef=0.1)
    close(from_logits, loss)


def test_an_entropy_floor_turns_the_bonus_on_only_below_it() -> None:
    logits = torch.zeros(1, 2, 4, requires_grad=True)  # uniform: entropy log 4 = 1.386 at each token
    mask = torch.tensor([[0.0, 1.0]])
    x = torch.full((1, 2), -math.log(4))
    entropy = token_entropy(logits)
    plain, _ = loss_of(x, x, torch.ones(1), mask, entropy=entropy)
    above, _ = loss_of(x, x, torch.ones(1), mask, entropy=entropy, entropy_coef=0.5, entropy_floor=1.0)
    below, _ = loss_of(x, x, torch.ones(1), mask, entropy=entropy, entropy_coef=0.5, entropy_floor=2.0)
    close(above, plain)
    close(below, plain - 0.5 * math.log(4))


def test_an_entropy_bonus_needs_a_differentiable_entropy() -> None:
    mask = torch.tensor([[0.0, 1.0]])
    x = torch.full((1, 2), -1.0)
    with pytest.raises(ValueError, match="entropy_grad=True"):
        loss_of(x, x, torch.ones(1), mask, entropy=torch.ones(1, 2), entropy_coef=0.1)
    with pytest.raises(ValueError, match="no differentiable entropy"):
        loss_of(x, x, torch.ones(1), mask, entropy_coef=0.1)


def test_entropy_metric_from_logits() -> None:
    # Uniform logits over V = 4: entropy log 4 = 1.386294 at every action token.
    logits = torch.zeros(2, 3, 4)
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    x = torch.full((2, 3), -math.log(4))
    _, m = loss_of(x, x, torch.ones(2), mask, logits=logits)
    close(m.entropy, math.log(4))
    _, m_none = loss_of(x, x, torch.ones(2), mask)
    assert m_none.entropy is None


def test_metrics_are_plain_floats_namespaced() -> None:
    x = torch.zeros(1, 3)
    _, m = loss_of(x, x, torch.ones(1), torch.tensor([[0.0, 1.0, 1.0]]))
    assert isinstance(m, LossMetrics)
    d = m.as_dict()
    assert d["losses/num_action_tokens"] == 2 and d["losses/ratio_mean"] == 1.0
    assert all(isinstance(v, (int, float)) or v is None for v in d.values())


# --- the pieces together --------------------------------------------------------------------


def test_collate_logprobs_advantages_and_loss_compose_into_a_learning_step() -> None:
    # A tiny causal model plays both rollout engine and trainer. Its own log-probs, read back
    # through collate + sequence_logprobs, must give ratio exactly 1 (the alignment is right);
    # a few steps on a group where trajectory 0 won must raise that trajectory's log-likelihood.
    from agentrl.rollout.trajectory import Trajectory
    from agentrl.train.batch import collate, sequence_logprobs

    torch.manual_seed(0)
    vocab = 7
    model = torch.nn.Sequential(
        torch.nn.Embedding(vocab, 16), torch.nn.Linear(16, vocab)
    )  # token t -> logits t
    ids = [[1, 2, 3, 4, 5], [1, 2, 5, 6]]
    masks = [[0, 0, 1, 0, 1], [0, 0, 1, 1]]  # token 3 of seq 0 is an observation
    with torch.no_grad():
        behav = [sequence_logprobs(model(torch.tensor([s])), torch.tensor([s]))[0] for s in ids]
    trajs = [
        Trajectory(
            task_id="t", group_id="g", token_ids=s, loss_mask=m,
            behavior_logprobs=[float(x) if mm else 0.0 for x, mm in zip(b, m, strict=True)],
            prompt_len=2, reward=r, passed=r == 1.0, finish_reason="submitted", policy_version=0,
        )
        for s, m, b, r in zip(ids, masks, behav, (1.0, 0.0), strict=True)
    ]  # fmt: skip
    batch = collate(trajs, pad_id=0)
    advantages = group_advantages(batch.rewards, batch.group_ids)  # (+0.7071, -0.7071)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

    def winner_loglik() -> float:
        with torch.no_grad():
            logp = sequence_logprobs(model(batch.input_ids), batch.input_ids)
            return float((logp[0] * batch.loss_mask[0]).sum())

    before = winner_loglik()
    for step in range(3):
        logp = sequence_logprobs(model(batch.input_ids), batch.input_ids)  # [B, T]
        loss, m = loss_of(logp, batch.behavior_logprobs, advantages, batch.loss_mask)
        if step == 0:
            close([m.ratio_min, m.ratio_max, m.approx_kl], [1.0, 1.0, 0.0], atol=1e-6)
            assert m.num_action_tokens == 4
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert winner_loglik() > before


def test_logprob_mismatch_is_zero_for_the_same_policy_and_k3_otherwise() -> None:
    from agentrl.train.grpo import logprob_mismatch

    behaviour = torch.tensor([[-0.5, -1.0, 0.0], [-2.0, 0.0, 0.0]])  # [B, T]
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])  # [B, T]: 3 action tokens
    same = logprob_mismatch(behaviour.clone(), behaviour, mask)
    assert same == {"logprob_abs_diff": 0.0, "logprob_abs_diff_max": 0.0, "kl": 0.0, "tokens": 3.0}
    trainer = behaviour + torch.tensor([[0.1, -0.3, 5.0], [0.2, 9.0, 9.0]])  # off-mask changes ignored
    out = logprob_mismatch(trainer, behaviour, mask)
    assert out["logprob_abs_diff"] == pytest.approx((0.1 + 0.3 + 0.2) / 3)
    assert out["logprob_abs_diff_max"] == pytest.approx(0.3)
    # k3 of KL(behaviour || trainer) per token: exp(d) - d - 1 with d = trainer - behaviour.
    expected = sum(math.exp(d) - d - 1 for d in (0.1, -0.3, 0.2)) / 3
    assert out["kl"] == pytest.approx(expected)
    assert logprob_mismatch(trainer, behaviour, torch.zeros_like(mask))["tokens"] == 0.0


def test_ratio_histogram_quantiles_add_over_parts_and_read_the_tails() -> None:
    from agentrl.train.grpo import histogram_quantiles, ratio_histogram

    gen = torch.Generator().manual_seed(0)
    behavior = -torch.rand(4, 50, generator=gen) * 3  # [B, T]
    log_ratio = torch.randn(4, 50, generator=gen) * 0.1  # [B, T]
    mask = torch.ones(4, 50, dtype=torch.long)
    mask[:, :10] = 0  # prompt tokens: not counted
    mask[0, 20] = 1
    log_ratio[0, 5] = 50.0  # off the mask: an outlier that must not count
    whole = ratio_histogram(behavior + log_ratio, behavior, mask)
    parts = ratio_histogram(behavior[:2] + log_ratio[:2], behavior[:2], mask[:2]) + ratio_histogram(
        behavior[2:] + log_ratio[2:], behavior[2:], mask[2:]
    )
    assert torch.equal(whole, parts) and whole.sum() == mask.sum()
    got = histogram_quantiles(whole, (0.05, 0.5, 0.95))
    want = torch.quantile(
        log_ratio[mask.bool()].double(), torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)
    )
    for q, w in zip((0.05, 0.5, 0.95), want.tolist(), strict=True):
        assert math.log(got[q]) == pytest.approx(
            w, abs=0.01
        )  # a bin is 0.002 wide; the quantile's rank rounds
    # Equal log-probs: every ratio is 1; an extreme ratio lands in the outermost bin, exp(2).
    assert histogram_quantiles(ratio_histogram(behavior, behavior, mask), (0.01, 0.99)) == {
        0.01: 1.0,
        0.99: 1.0,
    }
    far = ratio_histogram(behavior + 10.0, behavior, mask)
    assert histogram_quantiles(far, (0.5,))[0.5] == pytest.approx(math.exp(2.0))
    assert histogram_quantiles(torch.zeros(2001), (0.5,)) == {}


def test_policy_loss_takes_the_runs_loss_settings_and_names_its_metrics_on_the_device() -> None:
    """The trainer's call: the `loss:` section as it is (TIS on by default), metrics left on the device,
    each by name; read at once they are the `LossMetrics` of the same call."""
    logprobs = torch.tensor([[-1.0, -0.5, -2.0]], requires_grad=True)
    behavior = torch.tensor([[-1.2, -0.5, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = policy_loss(
        logprobs, behavior, torch.tensor([1.0]), mask, LossSettings(), old_logprobs=logprobs.detach()
    )
    assert isinstance(stats, LossStats) and not stats.values.requires_grad
    assert stats.values.shape == (len(LOSS_FIELDS),)
    assert stats["loss"].item() == loss.item()
    m = stats.metrics()
    assert m.num_action_tokens == 2 and m.entropy is None
    # TIS at the default cap 2: exp(-1 + 1.2) = 1.22 and exp(0) = 1 stay under it
    close(m.tis_weight_mean, (math.exp(0.2) + 1.0) / 2)
    assert LossStats.named(stats.values.tolist(), prefix="losses/")["losses/ratio_mean"] == m.ratio_mean


def test_an_entropy_floor_without_a_bonus_is_refused() -> None:
    with pytest.raises(ValueError, match="entropy_floor is set but loss.entropy_coef is 0"):
        LossSettings(entropy_floor=0.05)
