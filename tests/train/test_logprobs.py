"""Lean log-probs: the values and gradients of the full-logits path, without its [B, T, V] memory."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from agentrl.rollout.trajectory import Trajectory
from agentrl.train.batch import collate, sequence_logprobs, token_entropy
from agentrl.train.logprobs import action_logprobs, chunked_logprobs, supports_lean
from agentrl.train.peak_memory import PeakMemory
from tests.fixtures_model import tiny_model_dir  # noqa: F401  (pytest fixture)


def trajectories(vocab: int, n: int = 4, seed: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(20, 60)
        mask = [0] * 8 + [1 if (j // 5) % 2 == 0 else 0 for j in range(length - 8)]
        out.append(
            Trajectory(
                task_id=f"t{i}",
                group_id="g",
                token_ids=[rng.randrange(vocab) for _ in range(length)],
                loss_mask=mask,
                behavior_logprobs=[0.0] * length,
                prompt_len=8,
                reward=0.0,
                passed=False,
                finish_reason="submitted",
                policy_version=0,
            )
        )
    return out


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def test_hand_computed_log_prob_and_entropy() -> None:
    # One row, head = identity on 2 dims plus a zero row: logits (ln 2, 0, 0) -> p = (1/2, 1/4, 1/4).
    hidden = torch.tensor([[math.log(2.0), 0.0]])
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    logp, ent = chunked_logprobs(hidden, weight, torch.tensor([1]), with_entropy=True)
    assert logp.item() == pytest.approx(math.log(0.25), abs=1e-6)
    assert ent.item() == pytest.approx(-(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)), abs=1e-6)
    # Temperature 2 halves the logits: (ln 2 / 2, 0, 0) -> p ∝ (sqrt 2, 1, 1).
    logp_t, _ = chunked_logprobs(hidden, weight, torch.tensor([0]), temperature=2.0)
    assert logp_t.item() == pytest.approx(math.log(math.sqrt(2) / (math.sqrt(2) + 2)), abs=1e-6)


def _head_inputs(n: int, seed: int, h: int = 16, v: int = 50) -> tuple[torch.Tensor, ...]:
    """Random float64 hidden [n, h], head weight [v, h] and bias [v] (all requiring grad), targets [n]."""
    torch.manual_seed(seed)
    hidden = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(v, dtype=torch.float64, requires_grad=True)
    return hidden, weight, bias, torch.randint(0, v, (n,))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_values_and_gradients_equal_the_full_softmax(temperature: float) -> None:
    n = 37
    hidden, weight, bias, targets = _head_inputs(n, seed=0)
    upstream = torch.randn(n, dtype=torch.float64)
    # chunk=8: five chunks, the last one partial.
    logp, ent = chunked_logprobs(
        hidden, weight, targets, bias=bias, temperature=temperature, chunk=8, with_entropy=True
    )
    grads = torch.autograd.grad((logp.double() * upstream).sum(), (hidden, weight, bias))
    z = (hidden @ weight.t() + bias) / temperature  # [N, V]
    ref = torch.log_softmax(z, -1).gather(1, targets[:, None]).squeeze(1)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), (hidden, weight, bias))
    torch.testing.assert_close(logp.double(), ref, rtol=1e-6, atol=1e-6)  # fp32 accumulation inside
    ref_ent = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_entropy_s_gradient_equals_the_full_softmax_s(temperature: float) -> None:
    """An entropy bonus differentiates the entropy too: log-probs and entropies weighted together (the
    head works in fp32 inside, and the entropy's gradient sums V products: rel 1e-4)."""
    n = 29
    hidden, weight, bias, targets = _head_inputs(n, seed=1)
    up_logp, up_ent = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    logp, ent = chunked_logprobs(
        hidden, weight, targets, bias=bias, temperature=temperature, chunk=8, with_entropy=True
    )
    objective = (logp.double() * up_logp).sum() + (ent.double() * up_ent).sum()
    grads = torch.autograd.grad(objective, (hidden, weight, bias), retain_graph=True)
    z = (hidden @ weight.t() + bias) / temperature  # [N, V]
    log_p = torch.log_softmax(z, -1)  # [N, V]
    ref_ent = -(log_p.exp() * log_p).sum(-1)  # [N]
    ref = (log_p.gather(1, targets[:, None]).squeeze(1) * up_logp).sum() + (ref_ent * up_ent).sum()
    ref_grads = torch.autograd.grad(ref, (hidden, weight, bias), retain_graph=True)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    # The entropy alone (the log-probs unused) has its gradient too.
    only = torch.autograd.grad((ent.double() * up_ent).sum(), hidden)[0]
    torch.testing.assert_close(
        only, torch.autograd.grad((ref_ent * up_ent).sum(), hidden)[0], rtol=1e-4, atol=1e-5
    )


def test_no_selected_rows_still_gives_a_connected_zero_gradient() -> None:
    # A rank's zero-mask filler selects no rows; backward must still reach the weights (FSDP needs it).
    weight = torch.randn(5, 3, requires_grad=True)
    hidden = torch.randn(4, 3, requires_grad=True)
    picked = hidden.index_select(0, torch.zeros(0, dtype=torch.long))  # [0, 3]
    logp, _ = chunked_logprobs(picked, weight, torch.zeros(0, dtype=torch.long))
    logp.sum().backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight)) and torch.equal(
        hidden.grad, torch.zeros_like(hidden)
    )


@pytest.mark.parametrize("packed", [False, True])
def test_tiny_model_logprobs_and_gradients_equal_the_full_logits_path(tiny, packed: bool) -> None:
    """The trainer's log-probs, entropies and parameter gradients, padded or packed, against
    `model(ids).logits` -> `sequence_logprobs`: rel 1e-5 in fp32."""
    tiny.config._attn_implementation = "sdpa"
    batch = collate(trajectories(tiny.config.vocab_size), pad_id=0)
    logits = tiny(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    ref = sequence_logprobs(logits, batch.input_ids, temperature=0.8) * batch.loss_mask  # [B, T]
    ref_ent = token_entropy(logits, temperature=0.8) * batch.loss_mask  # [B, T]
    weights = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * weights).sum(), list(tiny.parameters()))
    out = action_logprobs(tiny, batch, temperature=0.8, with_entropy=True, packed=packed)
    grads = torch.autograd.grad((out.logprobs * weights).sum(), list(tiny.parameters()))
    assert supports_lean(tiny)
    torch.testing.assert_close(out.logprobs, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy, ref_ent.detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(out.logprobs == 0, ref == 0)  # zero exactly off the mask
    for g, r in zip(grads, ref_grads, strict=True):
        scale = r.abs().max().clamp_min(1e-12)
        assert ((g - r).abs().max() / scale).item() < 1e-5


@pytest.mark.parametrize("packed", [False, True])
def test_a_head_the_lean_path_refuses_gets_the_same_values_from_the_full_logits(tiny, packed: bool) -> None:
    """A config that scales its logits (Cohere's `logit_scale`) turns the lean path off; the full-logits
    fallback then gives what `sequence_logprobs` and `token_entropy` give on the model's own logits."""
    batch = collate(trajectories(tiny.config.vocab_size, seed=1), pad_id=0)
    tiny.config.logit_scale = 0.5  # this model's forward ignores it: only the path changes
    try:
        assert not supports_lean(tiny)
        out = action_logprobs(tiny, batch, temperature=0.8, with_entropy=True, packed=packed)
    finally:
        del tiny.config.logit_scale
    tiny.config._attn_implementation = "sdpa"
    logits = tiny(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    ref = sequence_logprobs(logits, batch.input_ids, temperature=0.8) * batch.loss_mask  # [B, T]
    ref_ent = token_entropy(logits, temperature=0.8) * batch.loss_mask  # [B, T]
    torch.testing.assert_close(out.logprobs, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy, ref_ent, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.logprobs == 0, ref == 0)
    # Its entropies keep a [N, V] graph only for an entropy bonus.
    assert not out.entropy.requires_grad
    tiny.config.logit_scale = 0.5
    try:
        bonus = action_logprobs(
            tiny, batch, temperature=0.8, with_entropy=True, entropy_grad=True, packed=packed
        )
    finally:
        del tiny.config.logit_scale
    grads = torch.autograd.grad(bonus.entropy.sum(), list(tiny.parameters()), allow_unused=True)
    ref_grads = torch.autograd.grad(ref_ent.sum(), list(tiny.parameters()), allow_unused=True)
    for g, r in zip(grads, ref_grads, strict=True):
        if r is not None:
            assert ((g - r).abs().max() / r.abs().max().clamp_min(1e-12)).item() < 1e-4


def _head_peak(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lean: bool) -> int:
    hidden = hidden.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    with PeakMemory() as mem:
        if lean:
            logp, _ = chunked_logprobs(hidden, weight, targets, chunk=64, with_entropy=True)
        else:  # the old path: fp32 logits, log-softmax and entropy over every row
            z = (hidden @ weight.t()).float()  # [N, V]
            logp = z.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(z, -1)
            (torch.softmax(z, -1) * z).sum(-1).detach()
        logp.sum().backward()
    return mem.peak


def test_peak_memory_of_the_logprob_path_does_not_grow_with_vocab_times_tokens(tiny) -> None:
    """On the tiny model's head (V = 2543, H = 256): 4x the tokens and 4x the vocabulary cost the lean
    path only their [N, H] and [V, H] buffers, while the full path grows by fp32 [N, V] copies."""
    weight = tiny.lm_head.weight.detach()  # [V, H]
    v, h = weight.shape
    torch.manual_seed(0)
    wide = torch.cat([weight, torch.randn(3 * v, h) * 0.02])  # [4V, H]
    n = 512
    hid = {k: torch.randn(k, h) for k in (n, 4 * n)}
    tgt = {k: torch.randint(0, v, (k,)) for k in (n, 4 * n)}
    lean = {
        (vv, k): _head_peak(hid[k], w, tgt[k], True)
        for vv, w in ((v, weight), (4 * v, wide))
        for k in (n, 4 * n)
    }
    full = {k: _head_peak(hid[k], weight, tgt[k], False) for k in (n, 4 * n)}
    more_tokens = lean[(v, 4 * n)] - lean[(v, n)]
    more_vocab = lean[(4 * v, n)] - lean[(v, n)]
    # Lean: a few [N, H] buffers (hidden grad) per extra token, a few [V, H] (weight grad) and one
    # 64-row chunk per extra vocabulary row; never an [N, V] term.
    assert more_tokens <= 3 * (3 * n) * h * 4, more_tokens
    assert more_vocab <= 4 * (3 * v) * h * 4 + 2 * 64 * (3 * v) * 4, more_vocab
    assert lean[(4 * v, 4 * n)] - lean[(4 * v, n)] <= 3 * (3 * n) * h * 4
    # The full path holds at least two fp32 [N, V] tensors at once.
    assert full[4 * n] - full[n] >= 2 * (3 * n) * v * 4
    assert lean[(v, 4 * n)] < full[4 * n] / 4


def with_common_start(trajs: list[Trajectory], start: list[int], short: bool = False) -> list[Trajectory]:
    """The same trajectories, each beginning with `start` (a shared system prompt); with `short`, the
    last one is `start` alone (nothing of it after the common prefix)."""
    out = []
    for t in trajs:
        n = len(start)
        out.append(
            dataclasses.replace(
                t,
                token_ids=start + t.token_ids,
                loss_mask=[0] * n + t.loss_mask,
                behavior_logprobs=[0.0] * n + t.behavior_logprobs,
                prompt_len=n + t.prompt_len,
            )
        )
    if short:
        n = len(start)
        out[-1] = dataclasses.replace(
            out[0],
            task_id="short",
            token_ids=start,
            loss_mask=[0] * n,
            behavior_logprobs=[0.0] * n,
            prompt_len=n,
        )
    return out


@pytest.mark.parametrize("short", [False, True])
@pytest.mark.parametrize("actions_in_prefix", [False, True])
def test_a_shared_prefix_held_once_gives_the_same_logprobs_and_gradients(
    tiny, short: bool, actions_in_prefix: bool
) -> None:
    """Sequences that start alike (a system prompt) packed with that start held once: log-probs,
    entropies and gradients of the full-logits path, rel 1e-5 in fp32. Also where predicted tokens lie
    inside the common start (samples of a group that begin with the same action) and where one sequence
    is nothing but the common start."""
    from agentrl.train.packing import shared_prefix_inputs, shared_prefix_length

    tiny.config._attn_implementation = "sdpa"
    rng = random.Random(3)
    start = [rng.randrange(tiny.config.vocab_size) for _ in range(30)]
    trajs = with_common_start(trajectories(tiny.config.vocab_size, n=5, seed=2), start, short)
    if actions_in_prefix:  # the common start's last 6 tokens are actions in every sequence
        trajs = [
            dataclasses.replace(t, loss_mask=t.loss_mask[:24] + [1] * 6 + t.loss_mask[30:]) for t in trajs
        ]
    batch = collate(trajs, pad_id=0)
    prefix = shared_prefix_length(batch)
    assert prefix == 30 if short else prefix >= 30
    assert prefix < int(batch.lengths.max())
    inputs, _ = shared_prefix_inputs(batch, prefix)
    assert inputs["input_ids"].shape[1] == prefix + int((batch.lengths - prefix).sum())  # the start once
    logits = tiny(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    ref = sequence_logprobs(logits, batch.input_ids, temperature=0.8) * batch.loss_mask  # [B, T]
    ref_ent = token_entropy(logits, temperature=0.8) * batch.loss_mask  # [B, T]
    weights = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * weights).sum(), list(tiny.parameters()))
    out = action_logprobs(tiny, batch, temperature=0.8, with_entropy=True, packed=True, share_prefix=True)
    grads = torch.autograd.grad((out.logprobs * weights).sum(), list(tiny.parameters()))
    torch.testing.assert_close(out.logprobs, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy, ref_ent.detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(out.logprobs == 0, ref == 0)
    for g, r in zip(grads, ref_grads, strict=True):
        scale = r.abs().max().clamp_min(1e-12)
        assert ((g - r).abs().max() / scale).item() < 1e-5
