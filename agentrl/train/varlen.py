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
  each later segment to the whole prefix and causally to itself. One varlen call does it: the keys
  and values of each later segment are gathered as [the prefix's, its own] (a copy of the prefix's
  K/V per segment, small beside the activations: GQA models have few KV heads), and causal
  attention with more keys than queries is aligned to the bottom right, as flash attention aligns
  it (query i of a segment sees keys up to P + i). The kernel on CUDA, the reference elsewhere;
  backward adds each segment's gradient of the prefix's keys and values back onto the one copy;
- without them, it is transformers' `sdpa` with the usual padding mask, so a model set to this
  implementation still serves ordinary padded or single-sequence calls.

The kernel's maximum sequence lengths are derived here from the cumulative lengths, never taken
on trust: given a maximum of 0 (a keyword argument lost on the way) or one below the longest
sequence, the flash kernel returns garbage without an error. A `max_length_q/k` that is passed must
agree with the lengths, or the call fails; the lengths are read back once per forward, not per layer
(one device-to-host copy; the shared-prefix layout's key index is built from it once, too).

`varlen_attention` is excluded from torch.compile (`torch.compiler.disable`): compiled decoder
layers (`agentrl.train.compiled`) run their elementwise work fused and call it eagerly in between.

`enable(model)` registers the implementation and switches the model to it. The setting is
permanent on purpose: activation checkpointing recomputes each layer in backward, after any
context manager would have restored the old one.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import weakref
from dataclasses import dataclass
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


# The cumulative lengths last read: (the tensor, its version counter, its values on the host). Every layer
# of one forward receives the same `cu` tensor, so one device-to-host read serves them all.
_READ: tuple[weakref.ref[Tensor], int, list[int]] | None = None


def _bounds(cu: Tensor, host: Tensor | None = None) -> list[int]:
    """The values of the cumulative lengths `cu` [B + 1] on the host, checked: they start at 0 and never decrease."""
    global _READ
    if _READ is not None and _READ[0]() is cu and _READ[1] == cu._version:
        return _READ[2]
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"cu_seq_lens must be [B + 1] cumulative lengths, got shape {tuple(cu.shape)}")
    bounds = [int(b) for b in (cu if host is None else host).tolist()]
    if bounds[0] != 0 or any(e < s for s, e in itertools.pairwise(bounds)):
        raise ValueError(f"cu_seq_lens must start at 0 and never decrease, got {bounds}")
    _READ = (weakref.ref(cu), cu._version, bounds)
    return bounds


def copied_bounds(cu: Tensor, host: Tensor) -> None:
    """Note that `cu` is a device copy of the host tensor `host` (`agentrl.train.logprobs.action_logprobs`
    copies the row's inputs over): its values are then read from `host`, without a device-to-host copy
    that would wait for every kernel queued before it."""
    if host.device.type != "cpu" or host.shape != cu.shape:
        raise ValueError("copied_bounds needs the host tensor that `cu` was copied from")
    _bounds(cu, host)


def packed_lengths(cu: Tensor) -> tuple[int, int]:
    """(longest sequence, total tokens) of the cumulative lengths `cu` [B + 1] (int32, starting at 0)."""
    bounds = _bounds(cu)
    return max(e - s for s, e in itertools.pairwise(bounds)), bounds[-1]


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


@dataclass(frozen=True)
class SharedPrefixLayout:
    """One varlen call over a shared-prefix row: the queries are the row as it is, in segments (the prefix,
    then each non-empty remainder); segment s's keys are gathered from the row as [prefix, own tokens]."""

    q_bounds: list[int]  # [S + 1] cumulative query lengths (on the host)
    k_bounds: list[int]  # [S + 1] cumulative key lengths: P, then P + n_s per remainder
    cu_q: Tensor  # [S + 1] int32, q_bounds on the row's device
    cu_k: Tensor  # [S + 1] int32, k_bounds on the row's device
    keys: Tensor  # [k_bounds[-1]] int64: the row index of each gathered key
    max_q: int
    max_k: int


# The layout last built: (cu, its version counter, the prefix, the layout); one per forward, like _READ.
_LAYOUT: tuple[weakref.ref[Tensor], int, int, SharedPrefixLayout] | None = None


def shared_prefix_layout(cu: Tensor, prefix: int) -> SharedPrefixLayout:
    """The `SharedPrefixLayout` of a row whose first segment (of `cu` [S + 1]) is a prefix of `prefix` tokens
    that every later segment continues."""
    global _LAYOUT
    if _LAYOUT is not None and _LAYOUT[0]() is cu and _LAYOUT[1] == cu._version and _LAYOUT[2] == prefix:
        return _LAYOUT[3]
    bounds = _bounds(cu)
    if len(bounds) < 3 or bounds[1] != prefix or prefix < 1:
        raise ValueError(
            f"shared_prefix_len={prefix} but the first segment of cu_seq_lens_q is {bounds[1:2]}; build the "
            "inputs with agentrl.train.packing.shared_prefix_inputs"
        )
    head = torch.arange(prefix)  # [P]
    q_bounds, k_lengths, pieces = [0, prefix], [prefix], [head]
    for s, e in itertools.pairwise(bounds[1:]):
        if e > s:  # a sequence that is the prefix alone has no queries of its own
            q_bounds.append(e)
            k_lengths.append(prefix + e - s)
            pieces += [head, torch.arange(s, e)]
    k_bounds = [0, *itertools.accumulate(k_lengths)]
    device = cu.device
    layout = SharedPrefixLayout(
        q_bounds=q_bounds,
        k_bounds=k_bounds,
        # non_blocking: a host-to-device copy that does not wait for the queued kernels
        cu_q=torch.tensor(q_bounds, dtype=torch.int32).to(device, non_blocking=True),
        cu_k=torch.tensor(k_bounds, dtype=torch.int32).to(device, non_blocking=True),
        keys=torch.cat(pieces).to(device, non_blocking=True),
        max_q=max(e - s for s, e in itertools.pairwise(q_bounds)),
        max_k=max(k_lengths),
    )
    _LAYOUT = (weakref.ref(cu), cu._version, prefix, layout)
    return layout


def _flash_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu: Tensor,
    max_len: int,
    scale: float | None,
    *,
    cu_k: Tensor | None = None,
    max_k: int | None = None,
) -> Tensor:
    """Causal varlen flash attention: q [Nq, Hq, D], k/v [Nk, Hkv, D] -> [Nq, Hq, D].

    Sequence i has the queries cu[i]:cu[i + 1] and the keys cu_k[i]:cu_k[i + 1] (cu_k defaults to cu). With
    more keys than queries, causal is aligned to the bottom right, as flash attention aligns it: query j of
    a sequence with n queries and m keys sees the keys up to j + m - n.
    """
    cu_k = cu if cu_k is None else cu_k
    max_k = max_len if max_k is None else max_k
    if max_len < 1 or max_k < 1:
        # The kernel sizes its work by max_len and returns garbage, not an error, when it is too small.
        raise ValueError(
            f"the varlen kernel needs the longest sequence's length, got max_len={min(max_len, max_k)}"
        )
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
            k = k.repeat_interleave(groups, dim=1)  # [Nk, Hq, D]
            v = v.repeat_interleave(groups, dim=1)  # [Nk, Hq, D]
    return varlen_attn(q, k, v, cu, cu_k, max_len, max_k, **kwargs)


def _reference_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu: Tensor | list[int],
    scale: float | None,
    *,
    cu_k: Tensor | list[int] | None = None,
) -> Tensor:
    """The same attention as `_flash_varlen`, one `sdpa` per sequence (any device, any dtype): causal, and
    aligned to the bottom right where a sequence has more keys than queries."""
    out = torch.empty_like(q)  # [Nq, Hq, D]
    groups = q.shape[1] // k.shape[1]
    q_bounds = cu if isinstance(cu, list) else cu.tolist()
    k_bounds = q_bounds if cu_k is None else cu_k if isinstance(cu_k, list) else cu_k.tolist()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for (s, e), (ks, ke) in zip(itertools.pairwise(q_bounds), itertools.pairwise(k_bounds), strict=True):
        if e <= s:
            continue
        n, m = e - s, ke - ks
        qs = q[s:e].transpose(0, 1)  # [Hq, n, D]
        kk = k[ks:ke].transpose(0, 1).repeat_interleave(groups, dim=0)  # [Hq, m, D]
        vv = v[ks:ke].transpose(0, 1).repeat_interleave(groups, dim=0)  # [Hq, m, D]
        if m == n:
            o = sdpa(qs, kk, vv, is_causal=True, scale=scale)  # [Hq, n, D]
        else:  # row i sees the columns j <= i + m - n
            sees = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(diagonal=m - n)  # [n, m]
            o = sdpa(qs, kk, vv, attn_mask=sees, scale=scale)  # [Hq, n, D]
        out[s:e] = o.transpose(0, 1)
    return out


@functools.cache
def bottom_right_causal(device: torch.device) -> bool:
    """Whether the varlen kernel on `device` aligns causal attention with more keys than queries to the bottom
    right (flash attention does; the shared-prefix layout relies on it): probed once, numerically, in bf16."""
    if not kernel_available(device, torch.bfloat16):
        return False
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 2, 64, generator=g).to(device, torch.bfloat16) for n in (5, 9, 9))
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
    try:
        got = _flash_varlen(q, k, v, cu_q, 3, None, cu_k=cu_k, max_k=5).float()
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False
    want = _reference_varlen(q.float(), k.float(), v.float(), [0, 2, 5], None, cu_k=[0, 4, 9])
    return bool((got - want).abs().max() < 3e-2)


@torch.compiler.disable
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
    fast = kernel_available(q.device, q.dtype)
    if prefix:
        layout = shared_prefix_layout(cu, prefix)
        k = k.index_select(0, layout.keys)  # [K, Hkv, D] each segment's keys: the prefix's, then its own
        v = v.index_select(0, layout.keys)  # [K, Hkv, D]
        if fast and bottom_right_causal(q.device):
            out = _flash_varlen(
                q, k, v, layout.cu_q, layout.max_q, scaling, cu_k=layout.cu_k, max_k=layout.max_k
            )  # [N, Hq, D]
        else:
            out = _reference_varlen(q, k, v, layout.q_bounds, scaling, cu_k=layout.k_bounds)  # [N, Hq, D]
    elif fast:
        out = _flash_varlen(q, k, v, cu, longest, scaling)  # [N, Hq, D]
    else:
        out = _reference_varlen(q, k, v, _bounds(cu), scaling)  # [N, Hq, D]
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
