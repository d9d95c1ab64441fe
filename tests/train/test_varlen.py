"""Packed attention: the reference equals causal attention per sequence; the adapter calls each torch
version's varlen kernel with the right causal and GQA arguments; a model switched to it still serves
ordinary padded calls."""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch

from agentrl.train import varlen
from agentrl.train.batch import collate
from tests.fixtures_dist import assert_same_gradients, one_rank_group  # noqa: F401
from tests.fixtures_model import tiny_model_dir  # noqa: F401  (pytest fixture)
from tests.train.test_packing import traj


def packed_qkv(lengths: list[int], hq: int = 4, hkv: int = 2, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return (
        torch.randn(n, hq, d, generator=g),
        torch.randn(n, hkv, d, generator=g),
        torch.randn(n, hkv, d, generator=g),
        cu,
    )


def per_sequence(q, k, v, cu, scale):
    """Causal attention of each sequence alone, written out: softmax(q k^T * scale + causal) v."""
    out = []
    groups = q.shape[1] // k.shape[1]
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        qs, ks, vs = q[s:e], k[s:e].repeat_interleave(groups, 1), v[s:e].repeat_interleave(groups, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale  # [H, n, n]
        n = e - s
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs))
    return torch.cat(out)


def test_reference_is_causal_attention_within_each_sequence() -> None:
    q, k, v, cu = packed_qkv([5, 1, 9])
    got = varlen._reference_varlen(q, k, v, cu, scale=0.25)
    torch.testing.assert_close(got, per_sequence(q, k, v, cu, 0.25), rtol=1e-5, atol=1e-5)
    # Nothing leaks across a boundary: changing sequence 0 leaves sequences 1 and 2 alone.
    q2 = q.clone()
    q2[:5] += 1.0
    k2 = k.clone()
    k2[:5] -= 1.0
    again = varlen._reference_varlen(q2, k2, v, cu, scale=0.25)
    torch.testing.assert_close(again[5:], got[5:])


def _fake_kernel(signature: str):
    """A stand-in for `torch.nn.attention.varlen.varlen_attn` of one torch version (no GPU here): it
    checks the arguments the way that version reads them and computes with the written-out reference."""

    def common(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, gqa):
        assert torch.equal(cu_q, cu_k) and max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
        assert causal, "the adapter must ask for causal attention"
        if not gqa:
            assert k.shape[1] == q.shape[1], "without enable_gqa the kernel needs repeated KV heads"
        return per_sequence(q, k, v, cu_q, scale if scale is not None else q.shape[-1] ** -0.5)

    if signature == "2.9":  # varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None)

        def kernel(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):
            return common(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, None, False)

    elif signature == "2.10":  # (..., *, return_aux=None, scale=None, window_size=(-1, -1))

        def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
            return common(q, k, v, cu_q, cu_k, max_q, max_k, tuple(window_size) == (-1, 0), scale, False)

    else:  # 2.12+: (..., *, return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False, ...)

        def kernel(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_q,
            max_k,
            *,
            return_aux=None,
            scale=None,
            window_size=(-1, -1),
            enable_gqa=False,
        ):
            return common(q, k, v, cu_q, cu_k, max_q, max_k, tuple(window_size) == (-1, 0), scale, enable_gqa)

    return kernel, frozenset(inspect.signature(kernel).parameters)


@pytest.mark.parametrize("signature", ["2.9", "2.10", "2.12"])
def test_the_kernel_adapter_speaks_each_torch_versions_signature(monkeypatch, signature: str) -> None:
    monkeypatch.setattr(varlen, "_varlen_kernel", lambda: _fake_kernel(signature))
    q, k, v, cu = packed_qkv([7, 3, 12])
    scale = q.shape[-1] ** -0.5
    got = varlen._flash_varlen(q, k, v, cu, 12, scale)
    torch.testing.assert_close(got, per_sequence(q, k, v, cu, scale), rtol=1e-5, atol=1e-5)


def test_the_installed_torch_kernel_has_a_signature_the_adapter_knows() -> None:
    kernel = varlen._varlen_kernel()
    if kernel is None:  # a torch without it: packing then runs the reference everywhere
        assert not varlen.kernel_available("cuda", torch.bfloat16)
        return
    params = kernel[1]
    assert "window_size" in params or "is_causal" in params


def test_a_model_switched_to_varlen_still_serves_padded_calls(tiny_model_dir) -> None:  # noqa: F811
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    batch = collate([traj(n, vocab=model.config.vocab_size) for n in (9, 17, 4)], pad_id=0)
    with torch.no_grad():
        before = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
        varlen.enable(model)
        assert model.config._attn_implementation == varlen.NAME
        after = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    keep = batch.attention_mask.bool()
    torch.testing.assert_close(after[keep], before[keep], rtol=1e-5, atol=1e-5)


# --- the kernel's maximum lengths come from the cumulative lengths ----------------------------------------


def _recording_kernel(calls: list[tuple[int, int, list[int]]]):
    """A varlen kernel (torch 2.12's signature) that records the lengths it is given and computes with the
    written-out reference; it refuses what the real kernel would silently get wrong."""

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
               enable_gqa=False):  # fmt: skip
        calls.append((max_q, max_k, cu_q.tolist()))
        assert max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max()), "the kernel got a wrong maximum length"
        return per_sequence(q, k, v, cu_q, scale if scale is not None else q.shape[-1] ** -0.5)

    return kernel, frozenset(inspect.signature(kernel).parameters)


@pytest.fixture
def recorded_kernel(monkeypatch):
    """The kernel path taken on the CPU, with `_recording_kernel` in place of torch's."""
    calls: list[tuple[int, int, list[int]]] = []
    monkeypatch.setattr(varlen, "_varlen_kernel", lambda: _recording_kernel(calls))
    monkeypatch.setattr(varlen, "kernel_available", lambda device, dtype: True)
    return calls


def _attend(q, k, v, cu, **kwargs):
    """varlen_attention as transformers calls it: [1, H, N, D] in, [1, N, H, D] out."""
    out, _ = varlen.varlen_attention(
        torch.nn.Module(), q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None,
        scaling=0.25, cu_seq_lens_q=cu, cu_seq_lens_k=cu, **kwargs,
    )  # fmt: skip
    return out[0]


def test_the_kernel_gets_the_longest_sequence_even_when_no_maximum_is_passed(recorded_kernel) -> None:
    q, k, v, cu = packed_qkv([7, 3, 12])
    expected = per_sequence(q, k, v, cu, 0.25)
    torch.testing.assert_close(_attend(q, k, v, cu), expected, rtol=1e-5, atol=1e-5)  # none passed
    torch.testing.assert_close(_attend(q, k, v, cu, max_length_q=12, max_length_k=12), expected)
    assert [c[:2] for c in recorded_kernel] == [(12, 12), (12, 12)]


@pytest.mark.parametrize(
    ("given", "match"),
    [
        ({"max_length_q": 0}, "max_length_q=0 but the longest sequence in cu_seq_lens_q is 12"),
        ({"max_length_q": 7, "max_length_k": 7}, "max_length_q=7 but the longest"),
        ({"max_length_k": 13}, "max_length_k=13 but the longest"),
    ],
)
def test_a_maximum_that_disagrees_with_the_lengths_is_refused_not_used(recorded_kernel, given, match) -> None:
    q, k, v, cu = packed_qkv([7, 3, 12])
    with pytest.raises(ValueError, match=match):
        _attend(q, k, v, cu, **given)
    with pytest.raises(ValueError, match=match):  # the CPU reference checks it too: CPU tests catch it
        varlen.varlen_attention(
            torch.nn.Module(), q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None,
            scaling=0.25, cu_seq_lens_q=cu, cu_seq_lens_k=cu, **given,
        )  # fmt: skip
    assert recorded_kernel == []


def test_cumulative_lengths_that_do_not_cover_the_row_are_refused(recorded_kernel) -> None:
    q, k, v, cu = packed_qkv([7, 3, 12])
    with pytest.raises(ValueError, match="covers 20 tokens .* row holds 22"):
        _attend(q, k, v, torch.tensor([0, 7, 10, 20], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seq_lens_k must equal cu_seq_lens_q"):
        varlen.varlen_attention(
            torch.nn.Module(), q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None,
            cu_seq_lens_q=cu, cu_seq_lens_k=cu.flip(0),
        )  # fmt: skip
    with pytest.raises(ValueError, match="the varlen kernel needs the longest sequence's length"):
        varlen._flash_varlen(q, k, v, cu, 0, None)
    assert recorded_kernel == []


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("with_maximum", [True, False])
def test_packed_training_forward_and_backward_call_the_kernel_only_with_the_longest_length(
    tiny_model_dir,  # noqa: F811
    one_rank_group,  # noqa: F811
    recorded_kernel,
    monkeypatch,
    checkpointing: bool,
    with_maximum: bool,
) -> None:
    """The trainer's packed path through the real Qwen2 model under FSDP2 (activation checkpointing recomputes
    every layer in backward): every kernel call gets the longest sequence, also when the inputs carry no
    maximum at all, and the log-probs and gradients are those of the per-sequence reference."""
    from transformers import AutoModelForCausalLM

    from agentrl.train import packing
    from agentrl.train.distributed import shard_model
    from agentrl.train.logprobs import action_logprobs

    if not with_maximum:
        real = packing.packed_inputs

        def without_maximum(batch):
            inputs, offsets = real(batch)
            return {k: v for k, v in inputs.items() if not k.startswith("max_length")}, offsets

        monkeypatch.setattr(packing, "packed_inputs", without_maximum)
    lengths = (9, 17, 4, 30)
    trajs = [traj(n, vocab=2543) for n in lengths]
    batch = collate(trajs, pad_id=0)

    def run(kernel: bool):
        if not kernel:
            monkeypatch.setattr(varlen, "kernel_available", lambda device, dtype: False)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        shard_model(model, activation_checkpointing=checkpointing, bf16=False)
        logp = action_logprobs(model, batch, packed=True).logprobs  # [B, T]
        logp.sum().backward()
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                 for n, p in model.named_parameters()}  # fmt: skip
        return logp.detach(), grads

    logp, grads = run(kernel=True)
    layers = 4
    assert len(recorded_kernel) == layers * (2 if checkpointing else 1)  # forward, and recomputed in backward
    assert {c[:2] for c in recorded_kernel} == {(max(lengths), max(lengths))}
    ref_logp, ref_grads = run(kernel=False)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    # fp32, two ways of summing the same attention (einsum against sdpa): rounding, relative to each tensor's scale.
    assert_same_gradients(grads, ref_grads, rel=1e-4)


# --- shared prefixes: one varlen call, each segment's keys gathered behind the prefix's -------------------


def with_prefix(prefix: int, rests: list[int], hq: int = 4, hkv: int = 2, d: int = 16, seed: int = 1):
    """A shared-prefix row (the prefix, then each remainder) and, for the oracle, every full sequence."""
    g = torch.Generator().manual_seed(seed)
    n = prefix + sum(rests)
    q, k, v = (torch.randn(n, h, d, generator=g, requires_grad=True) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor([prefix, *rests]).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def unshared(q, k, v, cu, prefix: int, scale: float):
    """The oracle: every sequence written out whole (the prefix copied in front of its remainder), causal
    attention per sequence (`per_sequence`), and each remainder's rows taken back; the prefix's own rows
    from the first sequence (they are the same in every one)."""
    bounds = cu.tolist()
    seqs = list(itertools.pairwise(bounds[1:]))

    def whole(x):
        return torch.cat([torch.cat([x[:prefix], x[s:e]]) for s, e in seqs])

    full_cu = torch.tensor([0, *torch.tensor([prefix + e - s for s, e in seqs]).cumsum(0).tolist()])
    out = per_sequence(whole(q), whole(k), whole(v), full_cu, scale)
    rows = [out[:prefix]]  # the first sequence's prefix rows
    for (s, e), start in zip(seqs, full_cu[:-1].tolist(), strict=True):
        rows.append(out[start + prefix : start + prefix + e - s])
    return torch.cat(rows)


def test_the_shared_prefix_layout_puts_the_prefix_keys_before_each_segments_own() -> None:
    cu = torch.tensor([0, 3, 5, 8, 8], dtype=torch.int32)  # a prefix of 3; remainders of 2, 3 and 0 tokens
    layout = varlen.shared_prefix_layout(cu, 3)
    assert layout.q_bounds == [0, 3, 5, 8]  # the empty remainder has no queries: left out
    assert layout.k_bounds == [0, 3, 8, 14]
    assert layout.keys.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7]
    assert (layout.max_q, layout.max_k) == (3, 6)
    assert layout.cu_q.dtype == layout.cu_k.dtype == torch.int32
    with pytest.raises(ValueError, match="shared_prefix_len=4 but the first segment"):
        varlen.shared_prefix_layout(cu, 4)


@pytest.mark.parametrize("fast", [False, True], ids=["reference", "kernel-adapter"])
def test_shared_prefix_attention_and_its_gradients_are_those_of_the_whole_sequences(
    monkeypatch, fast
) -> None:
    """Through the reference and through the kernel adapter (with a stand-in kernel that has flash attention's
    bottom-right causal alignment): the outputs of the unshared sequences, and the gradients of q, k and v,
    with the prefix's key and value gradients summed over every sequence that attends to them."""
    calls = []
    if fast:

        def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
                   enable_gqa=False):  # fmt: skip
            assert tuple(window_size) == (-1, 0) and enable_gqa
            calls.append((cu_q.tolist(), cu_k.tolist(), max_q, max_k))
            return bottom_right(q, k, v, cu_q, cu_k, scale)

        monkeypatch.setattr(
            varlen, "_varlen_kernel", lambda: (kernel, frozenset(inspect.signature(kernel).parameters))
        )
        monkeypatch.setattr(varlen, "kernel_available", lambda device, dtype: True)
        monkeypatch.setattr(varlen, "bottom_right_causal", lambda device: True)
    prefix, rests = 6, [4, 1, 9, 0, 3]
    q, k, v, cu = with_prefix(prefix, rests)
    got = _attend(q, k, v, cu, shared_prefix_len=prefix)  # [N, Hq, D]
    want = unshared(q, k, v, cu, prefix, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    weights = torch.randn_like(want)
    grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    if fast:
        assert calls == [([0, 6, 10, 11, 20, 23], [0, 6, 16, 23, 38, 47], 9, 15)]


def bottom_right(q, k, v, cu_q, cu_k, scale):
    """Causal attention per sequence with more keys than queries aligned to the bottom right, written out."""
    out = []
    groups = q.shape[1] // k.shape[1]
    for (s, e), (ks, ke) in zip(
        itertools.pairwise(cu_q.tolist()), itertools.pairwise(cu_k.tolist()), strict=True
    ):
        qs, kk, vv = q[s:e], k[ks:ke].repeat_interleave(groups, 1), v[ks:ke].repeat_interleave(groups, 1)
        n, m = e - s, ke - ks
        scores = torch.einsum("qhd,khd->hqk", qs, kk) * scale  # [H, n, m]
        scores = scores.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(m - n + 1), float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
    return torch.cat(out)


def test_the_kernel_is_trusted_with_shared_prefixes_only_where_it_aligns_causal_to_the_bottom_right(
    monkeypatch,
) -> None:
    """The probe behind `share_prefix: auto` on a GPU: a kernel aligned to the top left (what `sdpa`'s
    is_causal means for non-square attention) is caught, one aligned as flash attention is passes."""
    from agentrl.train.packing import resolve_share_prefix

    def make(aligned: str):
        def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
                   enable_gqa=False):  # fmt: skip
            if aligned == "bottom":
                return bottom_right(q, k, v, cu_q, cu_k, scale if scale is not None else q.shape[-1] ** -0.5)
            out = []
            for (s, e), (ks, ke) in zip(itertools.pairwise(cu_q.tolist()), itertools.pairwise(cu_k.tolist()),
                                        strict=True):  # fmt: skip
                out.append(torch.nn.functional.scaled_dot_product_attention(
                    q[s:e].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1), is_causal=True
                ).transpose(0, 1))  # fmt: skip
            return torch.cat(out)

        return kernel, frozenset(inspect.signature(kernel).parameters)

    monkeypatch.setattr(varlen, "kernel_available", lambda device, dtype: True)
    probe = varlen.bottom_right_causal.__wrapped__  # uncached: one probe per kernel
    cpu = torch.device("cpu")
    monkeypatch.setattr(varlen, "_varlen_kernel", lambda: make("top"))
    assert probe(cpu) is False
    monkeypatch.setattr(varlen, "bottom_right_causal", probe)
    assert resolve_share_prefix("auto", True, cpu, bf16=True) is False  # so auto does not share there
    monkeypatch.setattr(varlen, "_varlen_kernel", lambda: make("bottom"))
    assert probe(cpu) is True
    assert resolve_share_prefix("auto", True, cpu, bf16=True) is True
