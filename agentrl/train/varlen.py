"""Attention over packed sequences, registered with transformers as `agentrl_varlen`.

A packed row holds several sequences back to back; each token may attend only to the earlier
tokens of its own sequence. transformers can express that with `sdpa` and a block-diagonal mask,
but the mask costs [N, N] memory and, measured on an H100, loses the flash kernel:
the packed batch ran slower than the padded one. torch's own varlen flash kernel
(`torch.nn.attention.varlen.varlen_attn`) takes the cumulative sequence lengths instead and does
causal attention within each sequence with no mask at all.

`varlen_attention` is the attention function of the `agentrl_varlen` implementation:

- with `cu_seq_lens_q` in its keyword arguments (what `agentrl.train.packing.packed_inputs` passes
  through the model's forward), one row of packed sequences: the varlen kernel on CUDA in
  bf16/fp16, or, elsewhere (CPU, fp32, a torch without the kernel), a reference that runs
  causal `sdpa` per sequence: slower, the same numbers, so the packed path is tested on CPU;
- with `shared_prefix_len` P as well (`agentrl.train.packing.shared_prefix_inputs`), the first segment
  is a prefix every sequence of the row starts with, held once: it attends causally to itself, and
  each later segment to the whole prefix and causally to itself (the reference, on any device);
- without them, it is transformers' `sdpa` with the usual padding mask, so a model set to this
  implementation still serves ordinary padded or single-sequence calls.

The kernel's maximum sequence lengths are derived here from the cumulative lengths, never taken
on trust: given a maximum of 0 (a keyword argument lost on the way) or one below the longest
sequence, the flash kernel returns garbage without an error. A `max_length_q/k` that is passed must
agree with the lengths, or the call fails; the lengths are read back once per forward, not per layer.

`enable(model)` registers the implementation and switches the model to it. The setting is
permanent on purpose: activation checkpointing recomputes each layer in backward, after any
context manager would have restored the old one.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import weakref
from typing import Any

import torch
from torch import Tensor, nn

NAME = "agentrl_varlen"


@functools.cache
def _varlen_kernel() -> tuple[Any, frozenset[str]] | None:
    """torch's varlen flash attention and its keyword parameters, or None (torch < 2.9, or a build without it)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    try:
        params = frozenset(inspect.signature(varlen_attn).parameters)
    except (TypeError, ValueError):
        return None
    return varlen_attn, params


def kernel_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """True when packed attention on `device` in `dtype` runs the varlen flash kernel (not the reference)."""
    return (
        torch.device(device).type == "cuda"
        and dtype in (torch.bfloat16, torch.float16)
        and _varlen_kernel() is not None
    )


# The cumulative lengths last measured: (the tensor, its version counter, (longest sequence, total tokens)).
# Every layer of one forward receives the same `cu` tensor, so one device-to-host read serves them all.
_MEASURED: tuple[weakref.ref[Tensor], int, tuple[int, int]] | None = None


def packed_lengths(cu: Tensor) -> tuple[int, int]:
    """(longest sequence, total tokens) of the cumulative lengths `cu` [B + 1] (int32, starting at 0)."""
    global _MEASURED
    if _MEASURED is not None and _MEASURED[0]() is cu and _MEASURED[1] == cu._version:
        return _MEASURED[2]
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"cu_seq_lens must be [B + 1] cumulative lengths, got shape {tuple(cu.shape)}")
    lengths = cu[1:] - cu[:-1]  # [B]
    longest, shortest, first, total = torch.stack([lengths.max(), lengths.min(), cu[0], cu[-1]]).tolist()
    if shortest < 0 or first != 0:
        raise ValueError(f"cu_seq_lens must start at 0 and never decrease, got {cu.tolist()}")
    measured = (int(longest), int(total))
    _MEASURED = (weakref.ref(cu), cu._version, measured)
    return measured


def _checked_max_length(kwargs: dict[str, Any], cu: Tensor, tokens: int) -> int:
    """The longest sequence of `cu`, checked against the row (`tokens`) and any `max_length_q/k` passed."""
    cu_k = kwargs.get("cu_seq_lens_k")
    if cu_k is not None and cu_k is not cu and not torch.equal(cu_k, cu):
        raise ValueError(
            "packed attention is causal self-attention within each sequence: cu_seq_lens_k must equal "
            "cu_seq_lens_q (agentrl.train.packing.packed_inputs passes the same tensor)"
        )
    longest, total = packed_lengths(cu)
    if total != tokens or longest < 1:
        raise ValueError(
            f"packed attention: cu_seq_lens_q covers {total} tokens (longest sequence {longest}) but the row "
            f"holds {tokens}; build the inputs with agentrl.train.packing.packed_inputs"
        )
    for key in ("max_length_q", "max_length_k"):
        given = kwargs.get(key)
        if given is not None and int(given) != longest:
            raise ValueError(
                f"packed attention: {key}={int(given)} but the longest sequence in cu_seq_lens_q is {longest}; "
                "pass the longest length (packed_inputs does) or leave it out"
            )
    return longest


def _flash_varlen(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float | None) -> Tensor:
    """Causal varlen flash attention: q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D]."""
    if max_len < 1:
        # The kernel sizes its work by max_len and returns garbage, not an error, when it is too small.
        raise ValueError(f"the varlen kernel needs the longest sequence's length, got max_len={max_len}")
    kernel = _varlen_kernel()
    assert kernel is not None
    varlen_attn, params = kernel
    kwargs: dict[str, Any] = {}
    if "scale" in params:
        kwargs["scale"] = scale
    elif scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        raise RuntimeError(
            "this torch's varlen_attn has no `scale` argument and the model needs a custom one"
        )
    # The causal switch moved: torch 2.9 has `is_causal`, 2.10+ a window, (-1, 0) meaning causal.
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # older kernels want as many KV heads as query heads: repeat each KV head for its group
            groups = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(groups, dim=1)  # [N, Hq, D]
            v = v.repeat_interleave(groups, dim=1)  # [N, Hq, D]
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)


def _reference_varlen(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, scale: float | None) -> Tensor:
    """The same attention as `_flash_varlen`, one causal `sdpa` per sequence (any device, any dtype)."""
    out = torch.empty_like(q)  # [N, Hq, D]
    groups = q.shape[1] // k.shape[1]
    bounds = cu.tolist()
    for s, e in itertools.pairwise(bounds):
        if e <= s:
            continue
        qs = q[s:e].transpose(0, 1)  # [Hq, n, D]
        ks = k[s:e].transpose(0, 1).repeat_interleave(groups, dim=0)  # [Hq, n, D]
        vs = v[s:e].transpose(0, 1).repeat_interleave(groups, dim=0)  # [Hq, n, D]
        o = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale
        )  # [Hq, n, D]
        out[s:e] = o.transpose(0, 1)
    return out


def _shared_prefix_reference(
    q: Tensor, k: Tensor, v: Tensor, cu: Tensor, prefix: int, scale: float | None
) -> Tensor:
    """Segment 0 of `cu` is a prefix of every sequence, held once: causal attention within it, and for
    each later segment causal attention over [the prefix, the segment], one `sdpa` each."""
    bounds = cu.tolist()
    if len(bounds) < 3 or bounds[1] != prefix:
        raise ValueError(
            f"shared_prefix_len={prefix} but the first segment of cu_seq_lens_q is {bounds[1:2]}; build the "
            "inputs with agentrl.train.packing.shared_prefix_inputs"
        )
    out = torch.empty_like(q)  # [N, Hq, D]
    groups = q.shape[1] // k.shape[1]
    kp = k[:prefix].transpose(0, 1).repeat_interleave(groups, dim=0)  # [Hq, P, D]
    vp = v[:prefix].transpose(0, 1).repeat_interleave(groups, dim=0)  # [Hq, P, D]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out[:prefix] = sdpa(q[:prefix].transpose(0, 1), kp, vp, is_causal=True, scale=scale).transpose(0, 1)
    for s, e in itertools.pairwise(bounds[1:]):
        if e <= s:
            continue
        qs = q[s:e].transpose(0, 1)  # [Hq, n, D]
        ks = torch.cat([kp, k[s:e].transpose(0, 1).repeat_interleave(groups, dim=0)], dim=1)  # [Hq, P + n, D]
        vs = torch.cat([vp, v[s:e].transpose(0, 1).repeat_interleave(groups, dim=0)], dim=1)  # [Hq, P + n, D]
        # Row i sees the whole prefix and its own segment up to i: columns j <= P + i.
        sees = torch.ones(e - s, prefix + e - s, dtype=torch.bool, device=q.device).tril(
            diagonal=prefix
        )  # [n, P + n]
        out[s:e] = sdpa(qs, ks, vs, attn_mask=sees, scale=scale).transpose(0, 1)  # [n, Hq, D]
    return out


def varlen_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention function: query [B, Hq, T, D], key/value [B, Hkv, T, D] -> ([B, T, Hq, D], None)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        raise ValueError(
            f"packed attention needs one row of packed sequences and no KV cache; got query {tuple(query.shape)}, "
            f"key {tuple(key.shape)}"
        )
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError(
            "packed attention does not implement sliding-window layers; use packing=off"
        )
    if dropout:
        raise NotImplementedError("packed attention has no dropout; set the model's attention_dropout to 0")
    longest = _checked_max_length(kwargs, cu, query.shape[2])
    q = query[0].transpose(0, 1).contiguous()  # [N, Hq, D]
    k = key[0].transpose(0, 1).contiguous()  # [N, Hkv, D]
    v = value[0].transpose(0, 1).contiguous()  # [N, Hkv, D]
    prefix = int(kwargs.get("shared_prefix_len") or 0)
    if prefix:
        out = _shared_prefix_reference(q, k, v, cu, prefix, scaling)  # [N, Hq, D]
    elif kernel_available(q.device, q.dtype):
        out = _flash_varlen(q, k, v, cu, longest, scaling)  # [N, Hq, D]
    else:
        out = _reference_varlen(q, k, v, cu, scaling)  # [N, Hq, D]
    return out.unsqueeze(0), None  # [1, N, Hq, D]


def _mask(*, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor | None:
    """Mask factory of the implementation: none for packed rows (the lengths say it all), sdpa's otherwise."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(attention_mask=attention_mask, **kwargs)


@functools.cache
def register() -> str:
    """Register `agentrl_varlen` with transformers' attention and mask interfaces (once); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_attention)
    AttentionMaskInterface.register(NAME, _mask)
    return NAME


def enable(model: nn.Module) -> None:
    """Switch `model` (a transformers model) to the `agentrl_varlen` attention implementation."""
    register()
    config = model.config
    if getattr(config, "_attn_implementation", None) == NAME:
        return
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(NAME)
    if getattr(config, "_attn_implementation", None) != NAME:
        # Older transformers (or a class it cannot vet): every attention module reads the shared config.
        config._attn_implementation = NAME
    if getattr(config, "_attn_implementation", None) != NAME:
        raise RuntimeError(
            f"{type(model).__name__} did not accept the {NAME} attention implementation; train it with packing off"
        )
