"""Lean log-probs: from the final hidden states, in fp32 chunks, only where the loss needs them.

A causal LM's head turns every position's hidden state into V logits. The trainer needs one
number per *action* token (the log-prob of the sampled id) and the entropy there (a metric, or an
entropy bonus in the loss).
Computing `model(ids).logits` and a log-softmax over them costs a [B, T, V] tensor in the
model's dtype plus fp32 copies of it: for Qwen2.5's V = 151,936 and 8 sequences of 3k tokens
that is 14 GiB per fp32 copy, most of it for prompt and observation tokens that carry no loss.

Here the backbone runs as usual (`model.base_model`, no KV cache), the hidden states of the
positions that predict action tokens are picked out ([N, H]), and the head runs over them in
chunks of about `chunk_bytes` of fp32 logits. `ChunkedLogProbs` is an autograd function that
keeps only the hidden states, the head weight and one log-sum-exp per row for backward, and
recomputes each chunk's logits there: the peak of the log-prob path is one chunk of logits
(and its gradient), whatever the vocabulary and the sequence length. Values match the
full-logits path (`agentrl.train.batch.sequence_logprobs`) to fp32 rounding.

On CUDA with bf16 weights the head's matmul writes fp32 directly (`torch.mm(..., out_dtype=)`),
so logits are not rounded to bf16 before the softmax; elsewhere the matmul runs in the weight's
dtype and is upcast.

The work on each chunk's [c, V] fp32 logits besides the matmuls (the log-sum-exp, the target's
log-prob, the entropy; in backward the softmax, the one-hot, the scaling and the cast to the weight's
dtype) is about ten passes over the chunk in eager mode. With compiled decoder layers
(`agentrl.train.compiled`) those run as two fused kernels per chunk instead, one forward (`_row_stats`)
and one backward (`_logit_grad`), which read the logits once and write the bf16 gradient directly;
the matmuls stay cuBLAS calls.

Under FSDP2 the root module (embeddings, final norm, head) is only gathered around its own
`forward`; `install` registers the lean forward as another FSDP forward method
(`torch.distributed.fsdp.register_fsdp_forward_method`), so the head weight is unsharded while
it runs and its gradient is reduce-scattered like any other.
"""

from __future__ import annotations

import functools
import logging
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from agentrl.train.batch import Batch

log = logging.getLogger(__name__)

# fp32 logits per chunk: 512 MiB is ~880 rows of a 151,936-token vocabulary, enough to keep the
# head's matmul efficient, small beside a layer's activations (backward adds a bf16 copy).
DEFAULT_CHUNK_BYTES = 512 << 20
_METHOD = "agentrl_selected_logprobs"


def chunk_rows(vocab_size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Rows of fp32 logits per chunk: `chunk_bytes` of them, at least 16."""
    return max(16, chunk_bytes // (4 * max(1, vocab_size)))


# Whether this torch writes fp32 from half-precision matmuls on CUDA (mm / addmm with out_dtype);
# probed once, numerically, on first use.
_FP32_OUT: dict[str, bool] = {}


def _probe(kind: str, device: torch.device, dtype: torch.dtype) -> bool:
    if kind not in _FP32_OUT:
        try:
            # The layouts of the real calls: h @ W^T (a transposed second operand), gz^T @ h (a
            # transposed first one).
            if kind == "mm":
                a = torch.randn(4, 8, device=device).to(dtype)
                b = torch.randn(3, 8, device=device).to(dtype).t()
                got = torch.mm(a, b, out_dtype=torch.float32)
                want = a.float() @ b.float()
            else:
                a = torch.randn(4, 8, device=device).to(dtype).t()
                b = torch.randn(4, 3, device=device).to(dtype)
                got = torch.ones(8, 3, device=device)
                torch.ops.aten.addmm.dtype_out(got, a, b, torch.float32, out=got)
                want = a.float() @ b.float() + 1
            _FP32_OUT[kind] = got.dtype == torch.float32 and bool(torch.allclose(got, want, atol=1e-2))
        except (TypeError, RuntimeError, NotImplementedError, AttributeError):
            _FP32_OUT[kind] = False
    return _FP32_OUT[kind]


def _half_cuda(a: Tensor, b: Tensor) -> bool:
    return a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16)


def _mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b with an fp32 result; half-precision inputs keep their speed where the backend writes fp32."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return a @ b
    if _half_cuda(a, b) and _probe("mm", a.device, a.dtype):
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b.to(a.dtype)).float()


def _addmm_fp32_(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b in place, acc fp32: no [V, H] temporary per chunk where the backend allows it."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        acc.addmm_(a, b)
    elif _half_cuda(a, b) and _probe("addmm", a.device, a.dtype):
        torch.ops.aten.addmm.dtype_out(acc, a, b, torch.float32, out=acc)
    else:
        acc += _mm_fp32(a, b)


def _row_stats(z: Tensor, targets: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(log-sum-exp [c], the target's log-prob [c], the entropy [c] or [0]) of fp32 logits z [c, V]."""
    lse = torch.logsumexp(z, dim=-1)  # [c]
    logp = z.gather(1, targets[:, None]).squeeze(1) - lse  # [c]
    if not with_entropy:
        return lse, logp, z.new_empty(0)
    logp_all = z - lse[:, None]  # [c, V]
    return lse, logp, -(logp_all.exp() * logp_all).sum(-1)


def _logit_grad(
    z: Tensor, lse: Tensor, g: Tensor, targets: Tensor, temperature: float, dtype: torch.dtype
) -> Tensor:
    """d(g . logp[target]) / d(logits) in `dtype`: g (onehot(target) - softmax(z)) / temperature, [c, V]."""
    gz = (z - lse[:, None]).exp() * -g[:, None]  # [c, V]
    gz = gz.scatter_add(1, targets[:, None], g[:, None])
    return (gz / temperature).to(dtype)


@functools.cache
def _fused(fn: Any, backend: str) -> Any:
    """`fn` compiled (one fused kernel over a chunk), any chunk size."""
    return torch.compile(fn, backend=backend, dynamic=True)


def _chunk_logits(h: Tensor, wt: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """fp32 logits of one chunk, tempered: [c, H] x [H, V] -> [c, V]."""
    z = _mm_fp32(h, wt)  # [c, V]
    if bias is not None:
        z += bias.float()
    if temperature != 1.0:
        z /= temperature
    return z


class ChunkedLogProbs(torch.autograd.Function):
    """log softmax((h W^T + b) / temperature)[target], row by row in chunks, and the entropy.

    Inputs: hidden [N, H], weight [V, H], bias [V] or None, targets [N] int64; `fused`: a torch.compile
    backend for the elementwise work on each chunk (`_row_stats`, `_logit_grad`), or None (eager).
    Outputs: logp [N] fp32 and entropy [N] fp32 (or [0] when not asked for), both differentiable
    w.r.t. hidden, weight, bias. The entropy's gradient (an entropy bonus in the loss) is worked out
    only when something uses it; a metric's entropy costs nothing in backward. Saved for backward:
    the inputs, one log-sum-exp per row and the entropies; each chunk's logits are recomputed there.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        temperature: float,
        chunk: int,
        with_entropy: bool,
        fused: str | None = None,
    ) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)  # [N]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)  # [N]
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)  # [N]
        wt = weight.t()  # [H, V]
        for s in range(0, n, chunk):
            z = _chunk_logits(hidden[s : s + chunk], wt, bias, temperature)  # [c, V] fp32
            if fused:
                stats = _fused(_row_stats, fused)(z, targets[s : s + chunk], with_entropy)
                lse[s : s + chunk], logp[s : s + chunk] = stats[0], stats[1]
                if with_entropy:
                    entropy[s : s + chunk] = stats[2]
                continue
            row_lse = torch.logsumexp(z, dim=-1)  # [c]
            lse[s : s + chunk] = row_lse
            logp[s : s + chunk] = z.gather(1, targets[s : s + chunk, None]).squeeze(1) - row_lse
            if with_entropy:
                # H = -sum_v p_v log p_v, from log p = z - lse (in z's buffer): no cancellation
                # between two large numbers, as lse - sum p z would have.
                logp_all = z.sub_(row_lse[:, None])  # [c, V]
                entropy[s : s + chunk] = -logp_all.exp().mul_(logp_all).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature = temperature
        ctx.chunk = chunk
        ctx.fused = fused
        # An output nothing differentiates (the entropy as a metric) comes to backward as None, not zeros.
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor | None, grad_entropy: Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        temperature, chunk = ctx.temperature, ctx.chunk
        grad_h = torch.empty_like(hidden) if need_h else None  # [N, H]
        # fp32 accumulation over chunks: a bf16 running sum would drop the small contributions.
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        wt = weight.t()  # [H, V]
        grad_logp = (
            torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
            if grad_logp is None
            else grad_logp.float()
        )  # [N]
        ge_all = None if grad_entropy is None else grad_entropy.float()  # [N]
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]  # [c, H]
            g = grad_logp[s : s + chunk]  # [c]
            z = _chunk_logits(h, wt, bias, temperature)  # [c, V]
            if ctx.fused and grad_b is None and ge_all is None:
                gz_w = _fused(_logit_grad, ctx.fused)(
                    z, lse[s : s + chunk], g, targets[s : s + chunk], temperature, weight.dtype
                )  # [c, V] in the matmul dtype
            else:
                logp_all = z.sub_(lse[s : s + chunk, None])  # [c, V] log-softmax, in z's buffer
                gz = logp_all.exp()  # [c, V] softmax
                bonus = None
                if ge_all is not None:
                    # d H / d z = -softmax(z) (log softmax(z) + H), times the entropy's incoming gradient.
                    ge, ent = ge_all[s : s + chunk, None], entropy[s : s + chunk, None]  # [c, 1]
                    bonus = (logp_all + ent).mul_(gz).mul_(ge)  # [c, V], the negative of that term
                # d logp / d z = onehot(target) - softmax(z), times the incoming gradient.
                gz.mul_(-g[:, None])
                gz.scatter_add_(1, targets[s : s + chunk, None], g[:, None])
                if bonus is not None:
                    gz.sub_(bonus)
                if temperature != 1.0:
                    gz /= temperature  # z = logits / temperature
                if grad_b is not None:
                    grad_b += gz.sum(0)
                gz_w = gz.to(weight.dtype)  # [c, V] in the matmul dtype (a no-op in fp32)
            if grad_h is not None:
                grad_h[s : s + chunk] = (gz_w @ weight).to(hidden.dtype)  # [c, H]
            if grad_w is not None:
                _addmm_fp32_(grad_w, gz_w.t(), h.to(weight.dtype))  # [V, H]
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
        )


def chunked_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    chunk: int | None = None,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """(log-probs [N], entropies [N] or None) of `targets` under the head `weight` applied to `hidden` [N, H]."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden must be [N, H] and targets [N]; got {tuple(hidden.shape)} and {tuple(targets.shape)}"
        )
    rows = chunk or chunk_rows(weight.shape[0])
    logp, entropy = ChunkedLogProbs.apply(
        hidden, weight, bias, targets, float(temperature), rows, with_entropy
    )
    return logp, (entropy if with_entropy else None)


# --- the model side ------------------------------------------------------------------------------


def supports_lean(model: nn.Module) -> bool:
    """True when the model's logits are exactly `lm_head(final hidden state)` (Qwen2, Llama, Mistral...).

    Heads that scale or soft-cap their logits (Gemma 2's `final_logit_softcapping`, Cohere's
    `logit_scale`) would need those steps too; they fall back to the full-logits path.
    """
    config = getattr(model, "config", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if config is None or not isinstance(head, nn.Linear) or getattr(model, "base_model", model) is model:
        return False
    return not any(
        getattr(config, k, None) not in (None, 1.0) for k in ("final_logit_softcapping", "logit_scale")
    )


def _selected_logprobs(
    self: nn.Module,
    model_inputs: dict[str, Any],
    rows: Tensor,
    targets: Tensor,
    temperature: float,
    with_entropy: bool,
) -> tuple[Tensor, Tensor]:
    """Installed on the model as a method (and registered with FSDP2 as a forward method)."""
    hidden = self.base_model(**model_inputs, use_cache=False).last_hidden_state  # [B, T, H]
    picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)  # [N, H]
    head = self.get_output_embeddings()
    logp, entropy = ChunkedLogProbs.apply(
        picked,
        head.weight,
        head.bias,
        targets,
        float(temperature),
        chunk_rows(head.weight.shape[0]),
        with_entropy,
        getattr(self, "_agentrl_fused_head", None),
    )
    return logp, entropy


def install(model: nn.Module) -> None:
    """Give `model` the lean forward method (idempotent; call after `fully_shard`, or again after it)."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    sharded = isinstance(model, FSDPModule)
    if getattr(model, "_agentrl_lean", None) == sharded:
        return
    setattr(model, _METHOD, types.MethodType(_selected_logprobs, model))
    if sharded:
        register_fsdp_forward_method(model, _METHOD)
    model._agentrl_lean = sharded  # type: ignore[assignment]


@dataclass
class TokenLogProbs:
    """What one forward pass over a micro-batch gives, in the token-position layout of `agentrl.train.batch`."""

    logprobs: Tensor  # [B, T] fp32: log π(token t | < t) where loss_mask[b, t] == 1, else 0
    entropy: Tensor | None  # [B, T] fp32 entropy of the distribution token t was drawn from, else 0
    computed_tokens: int = 0
    """Positions the model ran: the packed row's length (a shared prefix counted once), or B x T padded."""


def action_logprobs(
    model: nn.Module,
    batch: Batch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    packed: bool = False,
    share_prefix: bool = False,
    positions: Tensor | None = None,
    device: torch.device | str | None = None,
) -> TokenLogProbs:
    """Log-probs (and entropies) of the action tokens of `batch` under `model`, never [B, T, V] in fp32.

    `positions` ([B, T] bool) picks other tokens than the loss mask (which is the default). With
    `packed`, the sequences run as one row with position ids restarting per sequence and
    cumulative lengths for the varlen attention (`agentrl.train.packing`, `agentrl.train.varlen`): no
    compute on padding. Padded or packed, the result is in the padded [B, T] layout, so the
    losses of `agentrl.train.grpo` read it unchanged. With `share_prefix` as well, the tokens every
    sequence starts with run once (`agentrl.train.packing.shared_prefix_inputs`): the same log-probs.

    `entropy_grad`: the entropies are differentiable (an entropy bonus in the loss). The lean head's
    always are, at no cost unless used; the full-logits fallback keeps its [N, V] graph only with this.

    `device`: where the model runs, for a `batch` still on the host (the trainer's case): the layout
    (which positions, where in the row, the lengths) is worked out on the host and only the model's
    inputs are copied over, without waiting for the device's queued work; a batch already on the
    device costs a few device-to-host reads (`nonzero`, the lengths) per call instead. The result is
    on `device` (default: the batch's).
    """
    from agentrl.train.packing import packed_inputs, shared_prefix_inputs, shared_prefix_length

    host = batch.input_ids.device
    device = host if device is None else torch.device(device)
    want = (batch.loss_mask > 0) if positions is None else positions.to(host).bool()  # [B, T]
    want = want.clone()
    want[:, 0] = False  # nothing predicts the first token
    b_idx, t_idx = want.nonzero(as_tuple=True)  # [N], [N]
    bsz, width = batch.input_ids.shape
    targets = batch.input_ids[b_idx, t_idx]  # [N]
    if packed:
        from agentrl.train import varlen

        varlen.enable(model)
        prefix = shared_prefix_length(batch) if share_prefix and bsz > 1 else 0
        if prefix:
            row_inputs, offsets = shared_prefix_inputs(batch, prefix)
            # [N] the predicting position: in the one copy of the prefix, or in the sequence's remainder
            rows = torch.where(t_idx - 1 < prefix, t_idx - 1, offsets[b_idx] + t_idx - 1)
        else:
            row_inputs, offsets = packed_inputs(batch)
            rows = offsets[b_idx] + t_idx - 1  # [N] index of the predicting position in the packed row
    else:
        row_inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        rows = b_idx * width + t_idx - 1  # [N] flat index into [B * T]
    computed = int(row_inputs["input_ids"].numel())
    flat = b_idx * width + t_idx  # [N] where each value lands in [B * T]
    if device != host:
        # non_blocking: host-to-device copies that do not wait for the kernels already queued
        copies = {  # one copy per tensor: cu_seq_lens_q and _k are the same one
            id(v): v.to(device, non_blocking=True) for v in row_inputs.values() if isinstance(v, Tensor)
        }
        moved = {k: copies[id(v)] if isinstance(v, Tensor) else v for k, v in row_inputs.items()}
        if packed:  # the attention reads the lengths from the host copy, not back from the device
            varlen.copied_bounds(moved["cu_seq_lens_q"], row_inputs["cu_seq_lens_q"])
        row_inputs = moved
        rows, targets, flat = (x.to(device, non_blocking=True) for x in (rows, targets, flat))
    if supports_lean(model):
        install(model)
        logp, ent = getattr(model, _METHOD)(row_inputs, rows, targets, temperature, with_entropy)
    else:
        logp, ent = _logprobs_of_logits(
            _full_logits_at(model, row_inputs, rows), targets, temperature, with_entropy, entropy_grad
        )
    zeros = torch.zeros(bsz * width, dtype=torch.float32, device=device)  # [B * T]
    out = zeros.scatter(0, flat, logp).view(bsz, width)  # [B, T]
    entropy = zeros.scatter(0, flat, ent).view(bsz, width) if with_entropy else None  # [B, T]
    return TokenLogProbs(out, entropy, computed)


def _full_logits_at(model: nn.Module, row_inputs: dict[str, Any], rows: Tensor) -> Tensor:
    """For heads `supports_lean` refuses: the model's own logits [N, V], kept only at the selected rows."""
    if not getattr(model, "_agentrl_warned_fallback", False):
        log.warning(
            "%s: logits are not plain lm_head(hidden); computing log-probs from the full logits",
            type(model).__name__,
        )
        model._agentrl_warned_fallback = True  # type: ignore[assignment]
    logits = model(**row_inputs, use_cache=False).logits  # [B, T, V]
    return logits.reshape(-1, logits.shape[-1]).index_select(0, rows)  # [N, V]


def _logprobs_of_logits(
    logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool, entropy_grad: bool = False
) -> tuple[Tensor, Tensor]:
    """(log-probs [N], entropies [N], empty unless `with_entropy`) of `targets` under `logits` [N, V]; the
    entropies differentiable with `entropy_grad`."""
    z = logits.float() / temperature  # [N, V]
    lse = torch.logsumexp(z, dim=-1)  # [N]
    logp = z.gather(1, targets[:, None]).squeeze(1) - lse  # [N]
    ent = torch.empty(0, device=z.device)
    if with_entropy:
        # Differentiable only for an entropy bonus: its graph would hold two [N, V] fp32 tensors.
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = lse - (torch.softmax(z, -1) * z).sum(-1)  # [N]
    return logp, ent
