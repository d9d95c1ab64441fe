"""Compiled decoder layers: each layer's elementwise work fused by torch.compile (`optim.compile`).

In eager mode every elementwise operation of a decoder layer is a kernel of its own that reads and
writes the activations: the RMS norms (an fp32 upcast, a square, a mean, an rsqrt, two products, a
downcast), the rotary embeddings (slices, a negation, a concatenation, products and sums for q and
for k), SwiGLU (a SiLU and a product over the MLP's widest tensor), the residual adds, and the same
again in backward. Profiled on an H100 at the 1.5B shape, they took about 43% of the step's GPU
time against 39% for the matrix products. Compiling each layer's forward (Inductor: Triton kernels
on CUDA, C++ on the CPU) fuses each run of them into one kernel, forward and backward; the matrix
products stay cuBLAS calls, and attention stays `agentrl.train.varlen`'s kernel. The log-prob head's
work on each chunk of logits (softmax statistics, the logits' gradient) is fused the same way
(`agentrl.train.logprobs`).

- One compiled function serves every layer of a model class: the layers differ only in their
  weights, which the compiled code takes as inputs. Shapes are dynamic, so a micro-batch of another
  length does not recompile; grad mode (the update against the no-grad passes) and the attention's
  inputs (packed, padded, a shared prefix) add a few variants, each compiled once.
- The attention function runs eagerly between the compiled parts of a layer
  (`agentrl.train.varlen.varlen_attention` is `torch.compiler.disable`d: it reads lengths on the
  host and calls a kernel of its own).
- It composes with FSDP2 (its hooks run around the compiled forward, which gets the unsharded bf16
  weights) and activation checkpointing (the checkpoint wraps the layer and recomputes through the
  compiled forward).

`resolve_compile` reads the setting: auto compiles on CUDA where a probe compile works (Triton and a
C compiler are there), and not on the CPU, where compiling (tens of seconds per variant on a small
machine) is not repaid by the short runs it serves; `on` compiles anywhere or stops saying why not.
Log-probs and gradients are those of the eager layers to rounding (tests: fp32 on the CPU, bf16 on a GPU).
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from agentrl.train.config import PackingMode

log = logging.getLogger(__name__)


@functools.cache
def _compiled(forward: Callable[..., Any], backend: str) -> Callable[..., Any]:
    """The compiled version of a decoder layer class's `forward` (one per class and backend)."""
    return torch.compile(forward, backend=backend, dynamic=True)


def compile_layers(model: nn.Module, layers: Iterable[nn.Module], *, backend: str = "inductor") -> int:
    """Compile the forward of each of `layers`, the decoder layers of `model` (a transformers causal LM,
    LoRA adapters or not: `agentrl.train.distributed.shard_model` finds them); before or after
    `fully_shard` and activation checkpointing. Idempotent; returns how many it compiled."""
    # Each variant (grad mode, packed or padded, a shared prefix, checkpointing's recompute, a reference
    # model in another dtype) is one more entry of the one compiled function; past the limit dynamo would
    # run the rest eager without a word, so it is raised above what a run can reach.
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, limit, max(getattr(config, limit), 64))
    done = 0
    for layer in layers:
        inner = getattr(layer, "_checkpoint_wrapped_module", layer)
        if getattr(inner, "_agentrl_compiled", None) == backend:
            continue
        # FSDP2 gives the module a subclass of its own; the class's forward is still the model's.
        inner.forward = types.MethodType(_compiled(type(inner).forward, backend), inner)
        inner._agentrl_compiled = backend
        done += 1
    # The log-prob head's elementwise work per chunk, fused too (`agentrl.train.logprobs`).
    model._agentrl_fused_head = backend  # type: ignore[assignment]
    return done


def _probe_layer(x: torch.Tensor, w: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """An RMS norm and a SwiGLU: what the decoder layers fuse."""
    h = x.float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w
    return torch.nn.functional.silu(gate) * h


@functools.cache
def compile_works(device_type: str) -> str | None:
    """None when torch.compile builds and runs a small fused forward and backward on this device type
    (Triton and a C compiler on CUDA, a C++ compiler on the CPU); otherwise why not, in one line."""
    device = torch.device(device_type)
    try:
        g = torch.Generator().manual_seed(0)
        x, w, gate = (torch.randn(8, 64, generator=g).to(device).requires_grad_() for _ in range(3))
        fused = torch.compile(_probe_layer, dynamic=True)
        got = fused(x, w, gate)
        got.sum().backward()
        grad = x.grad.clone()
        x.grad = None
        want = _probe_layer(x, w, gate)
        want.sum().backward()
        if not (torch.allclose(got, want, atol=1e-4) and torch.allclose(grad, x.grad, atol=1e-4)):
            return "its result differs from the eager one"
    except Exception as exc:  # any failure to compile means: run eager
        first = (str(exc).strip().splitlines() or [""])[0]
        return f"{type(exc).__name__}: {first[:300]}"
    return None


def resolve_compile(setting: PackingMode, device: torch.device) -> bool:
    """`compile: auto|on|off` for a trainer on `device`: whether to compile its decoder layers."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"compile must be auto, on or off; got {setting!r}")
    if setting == "off" or (setting == "auto" and device.type != "cuda"):
        return False
    why = compile_works(device.type)
    if why is None:
        return True
    if setting == "on":
        raise RuntimeError(
            f"optim.compile: on, but torch.compile does not work on {device.type} here ({why})"
        )
    log.warning("decoder layers run eager: torch.compile does not work on %s here (%s)", device.type, why)
    return False
