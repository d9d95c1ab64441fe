"""Attention over packed sequences, registered with transformers as `agentrl_varlen`.

A packed row holds several sequences back to back; each token may attend only to the earlier
tokens of its own sequence. transformers can express that with `sdpa` and a block-diagonal mask,
but the mask costs [N, N] memory and, measured on an H100 (issue 19), loses the flash kernel:
the packed batch ran slower than the padded one. torch's own varlen flash kernel
(`torch.nn.attention.varlen.varlen_attn`) takes the cumulative sequence lengths instead and does
causal attention within each sequence with no mask at all.

`varlen_attention` is the attention function of the `agentrl_varlen` implementation:

- with `cu_seq_lens_q` in its keyword arguments (what `agentrl.train.packing.packed_inputs` passes
  through the model's forward), one row of packed sequences: the varlen kernel on CUDA in
  bf16/fp16, or, elsewhere (CPU, fp32, a torch without the kernel), a reference that runs
  causal `sdpa` per sequence: slower, the same numbers, so the packed path is tested on CPU;
- without them, it is transformers' `sdpa` with the usual padding mask, so a model set to this
  implementation still serves ordinary padded or single-sequence calls.

`enable(model)` registers the implementation and switches the model to it. The setting is
permanent on purpose: activation checkpointing recomputes each layer in backward, after any
context manager would have restored the old one.
"""

from __future__ import annotations

import functools
import inspect
import itertools
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


def _flash_varlen(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float | None) -> Tensor:
    """Causal varlen flash attention: q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D]."""
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
    q = query[0].transpose(0, 1).contiguous()  # [N, Hq, D]
    k = key[0].transpose(0, 1).contiguous()  # [N, Hkv, D]
    v = value[0].transpose(0, 1).contiguous()  # [N, Hkv, D]
    if kernel_available(q.device, q.dtype):
        out = _flash_varlen(q, k, v, cu, int(kwargs.get("max_length_q") or 0), scaling)  # [N, Hq, D]
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
