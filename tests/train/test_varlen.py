"""Packed attention: the reference equals causal attention per sequence; the adapter calls each torch
version's varlen kernel with the right causal and GQA arguments; a model switched to it still serves
ordinary padded calls."""

from __future__ import annotations

import inspect

import pytest
import torch

from agentrl.train import varlen
from agentrl.train.batch import collate
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
