"""GRPO trainer throughput and memory on a GPU, against a plain PyTorch loop on the same batch.

    python3 -P benchmarks/train_gpu.py                     # H100: Qwen2.5-0.5B and -1.5B shapes, ~5 min
    python3 -P benchmarks/train_gpu.py --shapes 1.5B --out $OUT/train_gpu.json
    .venv/bin/python benchmarks/train_gpu.py --tiny        # CPU: the tiny model, the same JSON (CI runs it)
    python3 -P benchmarks/train_gpu.py --shapes 1.5B --quick --max-tokens-per-micro-batch 12288 --profile $OUT/prof
    python3 -P benchmarks/train_gpu.py --shapes 1.5B --skip-agentic --skip-long   # the GRPO-shaped batch alone

Random-init models of the Qwen2.5 shapes, built from a config (no hub, no vLLM, no Docker), bf16
compute with fp32 master weights, one process (FSDP2 on a one-rank group, as `agentrl train` runs).
The batch is synthesized like an agentic GRPO batch: 64 trajectories (8 groups x 8) of 1,024-3,072
tokens, a prompt, then alternating sampled spans (loss mask 1) and tool observations (mask 0),
rewards that vary within each group. Measured, in this run, on that same batch:

- `ours`: `agentrl.train.update.grpo_step` at the default settings (token-budget micro-batches, packed
  through the varlen attention where its kernel runs, shared prefixes held once, decoder layers
  compiled where `optim.compile: auto` compiles them (CUDA), lean log-probs);
- `ours_packing_off` / `ours_packing_on`: the same with the packing mode the defaults did not
  choose on this device (length-bucketed padding, or packed rows);
- `ours_compile_off`: `ours` with eager decoder layers, where the defaults compile them (what the
  fused elementwise kernels are worth);
- `plain`: a plain PyTorch loop: the transformers model under autocast, padded micro-batches of a
  fixed count in batch order, `model(ids, attention_mask).logits`, an fp32 log-softmax, the same
  GRPO loss (`agentrl.train.grpo.policy_loss`), AdamW;
- `ours_activation_checkpointing`: `ours` with `optim.activation_checkpointing=true`;
- `long`: `ours` at the defaults on 8 trajectories of 8,192 tokens (does it fit?).

A second, GRPO-shaped batch (`grpo` in the JSON; `--skip-grpo` leaves it out): 8 groups of 8
episodes, each group's episodes starting with the same 1,000-token prompt (system prompt, tool
schemas, task), then 256-2,048 tokens of their own (sampled spans and observations). On it: `ours`
(the prompt computed once per micro-batch, `optim.share_prefix: auto`), `ours_share_prefix_off`
(every episode computes its prompt), and `plain`. Its tokens/s are given two ways: `tokens_per_s`,
the tokens the step trained on (every episode's whole length, as an unshared trainer computes them),
and `computed_tokens_per_s`, the positions the model actually ran (a shared prompt once; padding
included for `plain`); MFU counts the FLOPs of what was computed.

Per variant: tokens/s (real tokens, no padding, per second of optimizer step, median over the
timed steps), MFU (model FLOPs: 6 x matmul parameters x tokens plus causal attention,
6 x layers x heads x head_dim x length^2 per sequence, over the GPU's dense bf16 peak), and
peak memory (`torch.cuda.max_memory_allocated` from model creation on; on the CPU, the process
heap the variant takes, `agentrl.train.peak_memory.HeapPeak`, in a separate untimed pass). Prints ONE JSON object.
`--max-tokens-per-micro-batch` sets our token budget (the trainer's default otherwise); `--profile P`
profiles one more step of `ours` per shape and writes its operator table to `P.<shape>.txt`, with the
GPU's kernel time and the matrix products' share of it in the JSON.
Targets (H100): 1.5B `ours` >= 1.3x `plain` tokens/s and MFU >= 35%; on the GRPO-shaped batch,
`ours` >= 2x `plain` in trained tokens/s; `long` fits; activation checkpointing cuts peak memory >= 40%.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen2.5-0.5B and -1.5B as published (config.json), tied embeddings, vocabulary 151,936.
    "0.5B": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "1.5B": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    # The model kit's tiny Qwen2 (CPU, CI).
    "tiny": dict(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2543,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}

# Dense bf16 tensor-core peak (no sparsity), TFLOP/s, by device name.
PEAK_TFLOPS = [("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0)]


def log(msg: str) -> None:
    print(f"[train_gpu] {msg}", file=sys.stderr, flush=True)


# --- the batch --------------------------------------------------------------------------------------


def synthesize(
    n: int, group_size: int, min_len: int, max_len: int, vocab: int, seed: int, fixed_len: int | None = None
) -> list[Any]:
    """An agentic GRPO batch: per trajectory a prompt (mask 0), then sampled spans (mask 1) and
    observations (mask 0) in turn; rewards 0/1 alternating within each group."""
    from agentrl.rollout.trajectory import Trajectory

    rng = random.Random(seed)
    around = -math.log(vocab)  # the random model's own log-probs: moderate ratios, as in training
    out = []
    for i in range(n):
        length = fixed_len or rng.randint(min_len, max_len)
        prompt = max(2, length // 8)
        mask = [0] * prompt
        action = True
        while len(mask) < length:
            span = rng.randint(16, 256) if action else rng.randint(8, 192)
            mask += [1 if action else 0] * span
            action = not action
        mask = mask[:length]
        out.append(
            Trajectory(
                task_id=f"t{i // group_size}",
                group_id=f"g{i // group_size}",
                token_ids=[rng.randrange(vocab) for _ in range(length)],
                loss_mask=mask,
                behavior_logprobs=[around + rng.uniform(-0.2, 0.2) if m else 0.0 for m in mask],
                prompt_len=prompt,
                reward=float(i % 2),
                passed=bool(i % 2),
                finish_reason="submitted",
                policy_version=0,
            )
        )
    return out


def synthesize_grpo(
    groups: int, group_size: int, prompt_len: int, min_rest: int, max_rest: int, vocab: int, seed: int
) -> list[Any]:
    """A GRPO batch of agentic episodes: per group one prompt (mask 0) that all its episodes start with, then
    each episode's own sampled spans (mask 1) and observations (mask 0); rewards 0/1 alternating in a group."""
    from agentrl.rollout.trajectory import Trajectory

    rng = random.Random(seed)
    around = -math.log(vocab)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        for i in range(group_size):
            rest = rng.randint(min_rest, max_rest)
            mask: list[int] = []
            action = True
            while len(mask) < rest:
                span = rng.randint(16, 256) if action else rng.randint(8, 192)
                mask += [1 if action else 0] * span
                action = not action
            mask = [0] * prompt_len + mask[:rest]
            out.append(
                Trajectory(
                    task_id=f"t{g}",
                    group_id=f"g{g}",
                    token_ids=prompt + [rng.randrange(vocab) for _ in range(rest)],
                    loss_mask=mask,
                    behavior_logprobs=[around + rng.uniform(-0.2, 0.2) if m else 0.0 for m in mask],
                    prompt_len=prompt_len,
                    reward=float(i % 2),
                    passed=bool(i % 2),
                    finish_reason="submitted",
                    policy_version=0,
                )
            )
    return out


# --- FLOPs, timing, memory --------------------------------------------------------------------------


def matmul_params(cfg: dict[str, Any]) -> int:
    """Parameters that take part in a matmul per token: attention and MLP projections, and the head."""
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * i  # q, k, v, o; gate, up, down
    return layers * per_layer + cfg["vocab_size"] * h


def step_flops(cfg: dict[str, Any], lengths: list[int]) -> float:
    """Model FLOPs of one forward+backward over sequences of these lengths (causal attention)."""
    p = matmul_params(cfg)
    d = cfg["hidden_size"]  # heads x head_dim
    return float(sum(6 * p * n + 6 * cfg["num_hidden_layers"] * d * n * n for n in lengths))


def shared_step_flops(cfg: dict[str, Any], trajs: list[Any], max_tokens: int | None) -> tuple[float, int]:
    """(model FLOPs, positions) of one forward+backward over `trajs` as the shared-prefix plan lays them out:
    per micro-batch its common prefix once (causal within itself), and each remainder attending to the
    prefix (a full rectangle) and causally to itself."""
    from agentrl.train.packing import common_prefix, plan_micro_batches

    p = matmul_params(cfg)
    d = cfg["hidden_size"]
    flops, positions = 0.0, 0
    for mb in plan_micro_batches(trajs, 1, max_tokens=max_tokens, packed=True, share_prefix=True).for_rank(0):
        ids = sorted(t.token_ids for t in mb)
        prefix = common_prefix(ids[0], ids[-1]) if len(mb) > 1 else 0
        rests = [len(i) - prefix for i in ids]
        n = prefix + sum(rests)
        attention = prefix * prefix + sum(r * r + 2 * r * prefix for r in rests)
        flops += 6 * p * n + 6 * cfg["num_hidden_layers"] * d * attention
        positions += n
    return flops, positions


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS if k in name), None)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


@dataclass
class Variant:
    """A way to train: `build()` makes (model, optimizer); `step(model, opt)` takes one optimizer step."""

    name: str
    build: Callable[[], tuple[Any, Any]]
    step: Callable[[Any, Any], None]
    computed: list[float] = field(default_factory=list)
    """Positions the model ran in each step (a shared prefix once, padding included), as the step reports them."""


def _timing(
    times: list[float], tokens: int, flops: float, peak: float | None, computed: list[float] | None = None
) -> dict[str, Any]:
    step_s = statistics.median(times)
    out = {
        "ok": True,
        "step_s": round(step_s, 4),
        "step_s_all": [round(t, 4) for t in times],
        "tokens_per_s": round(tokens / step_s, 1),
        "mfu": round(flops / step_s / (peak * 1e12), 4) if peak else None,
    }
    if computed:
        out["computed_tokens_per_step"] = round(computed[-1])
        out["computed_tokens_per_s"] = round(computed[-1] / step_s, 1)
    return out


def _timed_step(v: Variant, model: Any, opt: Any, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    v.step(model, opt)
    sync(device)
    return time.perf_counter() - t0


def cpu_peak_memory(v: Variant) -> float:
    """GiB of process heap that building the variant and one step take (an untimed pass)."""
    from agentrl.train.peak_memory import HeapPeak

    with HeapPeak() as mem:  # sampling after every op costs time: never in a timed pass
        model, opt = v.build()
        v.step(model, opt)
    del model, opt
    gc.collect()
    return round(mem.peak / 2**30, 4)


def measure(
    v: Variant, device: torch.device, tokens: int, flops: float, peak: float | None, args: Any
) -> dict[str, Any]:
    """Build, `warmup` untimed steps, `steps` timed ones; peak memory from model creation on."""
    free(device)
    times: list[float] = []
    oom: str | None = None
    model = opt = None
    try:
        model, opt = v.build()
        for i in range(args.warmup + args.steps):
            t = _timed_step(v, model, opt, device)
            if i >= args.warmup:
                times.append(t)
    except torch.OutOfMemoryError as exc:
        oom = str(exc).splitlines()[0]
    # Out of the except block: the traceback (and the frames holding activations) is gone.
    peak_alloc = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    peak_reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
    del model, opt
    free(device)
    if oom is not None:
        return {
            "ok": False,
            "error": f"out of memory: {oom}",
            "peak_memory_gib": round(peak_alloc / 2**30, 3) if peak_alloc is not None else None,
        }
    out = _timing(times, tokens, flops, peak, v.computed)
    if peak_alloc is not None and peak_reserved is not None:
        out["peak_memory_gib"] = round(peak_alloc / 2**30, 3)
        out["peak_reserved_gib"] = round(peak_reserved / 2**30, 3)
    else:
        out["peak_memory_gib"] = cpu_peak_memory(v)
    return out


def measure_interleaved(
    variants: list[Variant], device: torch.device, tokens: int, flops: float, peak: float | None, args: Any
) -> dict[str, dict[str, Any]]:
    """All variants built at once and stepped in turn, round after round: on a shared machine every
    variant sees the same background load (the CPU mode; a GPU could not hold them all)."""
    built = [(v, *v.build()) for v in variants]
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for i in range(args.warmup + args.steps):
        for v, model, opt in built:
            t = _timed_step(v, model, opt, device)
            if i >= args.warmup:
                times[v.name].append(t)
    del built
    free(device)
    out = {}
    for v in variants:
        out[v.name] = _timing(times[v.name], tokens, flops, peak, v.computed)
        out[v.name]["peak_memory_gib"] = cpu_peak_memory(v) if device.type != "cuda" else None
    return out


def profile_step(v: Variant, device: torch.device, path: str) -> dict[str, Any]:
    """One more step of `v` under torch.profiler after a warm-up: its operator table (by GPU time; CPU
    time on a CPU) to `path`, and how much of the step the GPU spent in kernels and in matrix products."""
    from torch.profiler import ProfilerActivity, profile

    free(device)
    model, opt = v.build()
    v.step(model, opt)  # warm-up: kernels chosen, allocator and optimizer state in place
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step_s = _timed_step(v, model, opt, device)
    del model, opt
    free(device)
    table = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    with open(path, "w") as f:
        f.write(table.table(sort_by=key, row_limit=45, max_name_column_width=70) + "\n")
    # An operator's self GPU time includes its kernels, which are listed again on their own: the total
    # counts the kernels (events on the device), as the profiler's own table does.
    on_device = [
        e for e in table if e.device_type != torch.autograd.DeviceType.CPU and not e.is_user_annotation
    ]
    total = sum(getattr(e, key) for e in (on_device if cuda else table)) / 1e6
    matmul = sum(getattr(e, key) for e in table if e.key in ("aten::mm", "aten::addmm", "aten::bmm")) / 1e6
    return {
        "table": path,
        "profiled_step_s": round(step_s, 3),  # the profiler's own overhead included
        "busy_s": round(total, 3),  # GPU kernel time (CPU: operator time)
        "matmul_share": round(matmul / total, 3) if total else None,
    }


# --- the variants -----------------------------------------------------------------------------------


def model_config(shape: dict[str, Any]) -> Any:
    from transformers import Qwen2Config

    cfg = Qwen2Config(**shape, attention_dropout=0.0, use_cache=False)
    cfg._attn_implementation = "sdpa"
    return cfg


def new_model(shape: dict[str, Any], device: torch.device, seed: int) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(model_config(shape), dtype=torch.float32)
    model.train()
    return model


def ours(name: str, shape: dict[str, Any], trajs: list[Any], info: Any, args: Any, **optim: Any) -> Variant:
    from agentrl.train.compiled import resolve_compile
    from agentrl.train.config import TrainConfig
    from agentrl.train.distributed import shard_model
    from agentrl.train.update import grpo_step

    budget = (
        {"max_tokens_per_micro_batch": args.max_tokens_per_micro_batch}
        if args.max_tokens_per_micro_batch
        else {}
    )
    cfg = TrainConfig(model="(random init)", optim={"lr": 1e-6, **budget, **optim})

    def build() -> tuple[Any, Any]:
        model = new_model(shape, info.device, args.seed)
        shard_model(
            model,
            activation_checkpointing=cfg.optim.activation_checkpointing,
            bf16=cfg.optim.bf16,
            compiled=resolve_compile(cfg.optim.compile, info.device),
        )
        return model, torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)

    def step(model: Any, opt: Any) -> None:
        metrics = grpo_step(model, opt, trajs, cfg, info, pad_id=0)
        variant.computed.append(metrics["batch/tokens_computed"])

    variant = Variant(name, build, step)
    return variant


def plain(shape: dict[str, Any], trajs: list[Any], device: torch.device, args: Any) -> Variant:
    """What one would write first: fixed-count padded micro-batches, full logits, fp32 log-softmax."""
    from agentrl.train.batch import collate, sequence_logprobs
    from agentrl.train.config import LossSettings
    from agentrl.train.grpo import group_advantages, policy_loss

    bf16 = device.type == "cuda"
    adv = group_advantages(torch.tensor([t.reward for t in trajs]), [t.group_id for t in trajs])  # [N]
    tokens = float(sum(sum(t.loss_mask) for t in trajs))

    def build() -> tuple[Any, Any]:
        model = new_model(shape, device, args.seed)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-6)

    def step(model: Any, opt: Any) -> None:
        k = args.plain_micro_batch
        for s in range(0, len(trajs), k):
            batch = collate(trajs[s : s + k], pad_id=0).to(device)
            positions.append(batch.input_ids.numel())
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = model(
                    input_ids=batch.input_ids, attention_mask=batch.attention_mask
                ).logits  # [B, T, V]
            logp = sequence_logprobs(logits, batch.input_ids)  # [B, T] fp32
            loss, _ = policy_loss(
                logp,
                batch.behavior_logprobs,
                adv[s : s + k].to(device),
                batch.loss_mask,
                LossSettings(),  # the defaults, as `ours` trains with (TIS capped at 2)
                old_logprobs=logp.detach(),
                logits=logits.detach(),
                denominator=tokens,
            )
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        variant.computed.append(float(sum(positions)))
        positions.clear()

    positions: list[int] = []
    variant = Variant("plain", build, step)
    return variant


# --- one shape ----------------------------------------------------------------------------------------


def run_shape(name: str, info: Any, args: Any) -> dict[str, Any]:
    from agentrl.train.compiled import resolve_compile
    from agentrl.train.config import OptimSettings
    from agentrl.train.packing import resolve_packing, resolve_share_prefix

    shape = SHAPES[name]
    device = info.device
    peak = peak_tflops(device, args.peak_tflops)
    defaults = OptimSettings()
    bf16 = device.type == "cuda"
    packs_here = resolve_packing(defaults.packing, device, bf16)
    result: dict[str, Any] = {
        "matmul_params": matmul_params(shape),
        "defaults": {
            "max_tokens_per_micro_batch": defaults.max_tokens_per_micro_batch,
            "micro_batch_size": defaults.micro_batch_size,
            "packing": defaults.packing,
            "packs_here": packs_here,
            "shares_prefix_here": resolve_share_prefix(defaults.share_prefix, packs_here, device, bf16),
            "compiles_here": resolve_compile(defaults.compile, device),
            "bf16": bf16,
        },
        "plain_micro_batch": args.plain_micro_batch,
        "max_tokens_per_micro_batch": args.max_tokens_per_micro_batch or defaults.max_tokens_per_micro_batch,
    }
    if not args.skip_agentic:
        result.update(run_agentic(name, shape, info, args, peak, result["defaults"]))
    if not args.skip_long:
        long = synthesize(
            args.long_trajectories,
            args.long_trajectories,
            0,
            0,
            shape["vocab_size"],
            args.seed + 1,
            fixed_len=args.long_len,
        )
        long_args = argparse.Namespace(**{**vars(args), "warmup": 0, "steps": 1})
        log(f"{name}: long ({args.long_trajectories} x {args.long_len} tokens) ...")
        result["long"] = {
            "trajectories": len(long),
            "tokens": args.long_len,
            **measure(
                ours("long", shape, long, info, args),
                device,
                len(long) * args.long_len,
                step_flops(shape, [args.long_len] * len(long)),
                peak,
                long_args,
            ),
        }
        log(f"{name}: long {result['long']}")
    if not args.skip_grpo:
        result["grpo"] = run_grpo(name, shape, info, args, peak, result["defaults"])
    return result


def _measure_all(
    name: str, variants: list[Variant], info: Any, args: Any, tokens: int, flops: dict[str, float], peak: Any
) -> dict[str, dict[str, Any]]:
    """Every variant on one batch; `flops[v.name]` (or `flops["*"]`) is what that variant computes."""
    device = info.device
    if args.interleave:
        log(f"{name}: {', '.join(v.name for v in variants)}, interleaved ...")
        out = measure_interleaved(variants, device, tokens, flops["*"], peak, args)
        for v in variants:  # measure_interleaved takes one FLOP count; MFU of the others from it
            if v.name in flops and out[v.name].get("mfu") is not None:
                out[v.name]["mfu"] = round(out[v.name]["mfu"] * flops[v.name] / flops["*"], 4)
        return out
    out = {}
    for v in variants:
        log(f"{name}: {v.name} ...")
        out[v.name] = measure(v, device, tokens, flops.get(v.name, flops["*"]), peak, args)
        log(f"{name}: {v.name} {out[v.name]}")
    return out


def run_agentic(
    name: str, shape: dict[str, Any], info: Any, args: Any, peak: Any, defaults: dict[str, Any]
) -> dict[str, Any]:
    """The agentic batch: 8 groups x 8 trajectories of 1,024-3,072 tokens with nothing in common."""
    trajs = synthesize(
        args.trajectories, args.group_size, args.min_len, args.max_len, shape["vocab_size"], args.seed
    )
    lengths = [len(t.token_ids) for t in trajs]
    tokens = sum(lengths)
    result: dict[str, Any] = {
        "trajectories": len(trajs),
        "tokens_per_step": tokens,
        "action_tokens_per_step": sum(sum(t.loss_mask) for t in trajs),
        "length_range": [min(lengths), max(lengths)],
    }
    variants = [ours("ours", shape, trajs, info, args), plain(shape, trajs, info.device, args)]
    if not args.quick:
        # The packing mode the defaults do not pick here, to show what the choice is worth.
        other = "off" if defaults["packs_here"] else "on"
        variants.insert(1, ours(f"ours_packing_{other}", shape, trajs, info, args, packing=other))
        if defaults["compiles_here"]:  # what the fused elementwise kernels are worth
            variants.insert(2, ours("ours_compile_off", shape, trajs, info, args, compile="off"))
        variants.append(
            ours("ours_activation_checkpointing", shape, trajs, info, args, activation_checkpointing=True)
        )
    got = _measure_all(name, variants, info, args, tokens, {"*": step_flops(shape, lengths)}, peak)
    result["variants"] = got
    if got["ours"].get("ok") and got["plain"].get("ok"):
        result["speedup_vs_plain"] = round(got["ours"]["tokens_per_s"] / got["plain"]["tokens_per_s"], 3)
    ac = got.get("ours_activation_checkpointing", {})
    if ac.get("ok") and got["ours"].get("ok"):
        result["activation_checkpointing_memory_cut"] = round(
            1 - ac["peak_memory_gib"] / got["ours"]["peak_memory_gib"], 3
        )
    if args.profile:
        result["profile"] = profile_step(
            ours("ours", shape, trajs, info, args), info.device, f"{args.profile}.{name}.txt"
        )
    return result


def run_grpo(
    name: str, shape: dict[str, Any], info: Any, args: Any, peak: Any, defaults: dict[str, Any]
) -> dict[str, Any]:
    """The GRPO-shaped batch: groups of `--grpo-group-size` episodes sharing a `--grpo-prompt-len` prompt."""
    trajs = synthesize_grpo(
        args.grpo_groups,
        args.grpo_group_size,
        args.grpo_prompt_len,
        args.grpo_min_rest,
        args.grpo_max_rest,
        shape["vocab_size"],
        args.seed + 2,
    )
    lengths = [len(t.token_ids) for t in trajs]
    tokens = sum(lengths)
    budget = args.max_tokens_per_micro_batch or defaults["max_tokens_per_micro_batch"]
    unshared = step_flops(shape, lengths)
    shared, positions = shared_step_flops(shape, trajs, budget)
    result: dict[str, Any] = {
        "groups": args.grpo_groups,
        "group_size": args.grpo_group_size,
        "prompt_len": args.grpo_prompt_len,
        "rest_range": [args.grpo_min_rest, args.grpo_max_rest],
        "trajectories": len(trajs),
        "tokens_per_step": tokens,
        "shared_plan_positions": positions,
        "flops_convention": "MFU counts the FLOPs of what each variant computes: a shared prompt once for ours "
        "where it shares, every episode whole otherwise",
    }
    variants = [ours("ours", shape, trajs, info, args), plain(shape, trajs, info.device, args)]
    if not args.quick:
        variants.insert(1, ours("ours_share_prefix_off", shape, trajs, info, args, share_prefix="off"))
    flops = {"*": unshared, "ours": shared if defaults["shares_prefix_here"] else unshared}
    got = _measure_all(f"{name}/grpo", variants, info, args, tokens, flops, peak)
    result["variants"] = got
    if got["ours"].get("ok") and got["plain"].get("ok"):
        result["trained_speedup_vs_plain"] = round(
            got["ours"]["tokens_per_s"] / got["plain"]["tokens_per_s"], 3
        )
    off = got.get("ours_share_prefix_off", {})
    if off.get("ok") and got["ours"].get("ok"):
        result["speedup_from_sharing"] = round(got["ours"]["tokens_per_s"] / off["tokens_per_s"], 3)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="The tiny model on short trajectories (CPU, CI).")
    ap.add_argument("--shapes", default=None, help="Comma-separated: 0.5B,1.5B (default) or tiny.")
    ap.add_argument("--trajectories", type=int, default=None, help="Batch size (default 64; tiny 16).")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--min-len", type=int, default=None, help="Shortest trajectory (default 1024; tiny 64).")
    ap.add_argument("--max-len", type=int, default=None, help="Longest trajectory (default 3072; tiny 192).")
    ap.add_argument("--steps", type=int, default=3, help="Timed optimizer steps per variant.")
    ap.add_argument(
        "--warmup", type=int, default=1, help="Untimed steps first (kernels, allocator, optimizer state)."
    )
    ap.add_argument(
        "--plain-micro-batch",
        type=int,
        default=None,
        help="Sequences per plain micro-batch (default 2; tiny 4).",
    )
    ap.add_argument(
        "--long-len", type=int, default=None, help="Tokens of each long trajectory (default 8192; tiny 512)."
    )
    ap.add_argument("--long-trajectories", type=int, default=8)
    ap.add_argument("--skip-long", action="store_true", help="Skip the long-trajectory check.")
    ap.add_argument("--skip-agentic", action="store_true", help="Skip the agentic batch (its variants).")
    ap.add_argument("--skip-grpo", action="store_true", help="Skip the GRPO-shaped batch.")
    ap.add_argument(
        "--grpo-groups", type=int, default=None, help="Groups of the GRPO batch (default 8; tiny 2)."
    )
    ap.add_argument("--grpo-group-size", type=int, default=8, help="Episodes per group of the GRPO batch.")
    ap.add_argument(
        "--grpo-prompt-len",
        type=int,
        default=None,
        help="Tokens of each group's prompt (default 1000; tiny 64).",
    )
    ap.add_argument(
        "--grpo-rest",
        default=None,
        help="MIN,MAX tokens of each episode after the prompt (default 256,2048; tiny 16,96).",
    )
    ap.add_argument("--quick", action="store_true", help="Only ours and plain.")
    ap.add_argument(
        "--peak-tflops", type=float, default=None, help="Dense bf16 peak for MFU (default: by device name)."
    )
    ap.add_argument(
        "--interleave",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Step the variants in turn, all built at once (default: on with --tiny, off on a GPU).",
    )
    ap.add_argument(
        "--max-tokens-per-micro-batch",
        type=int,
        default=None,
        help="Token budget of our micro-batches (default: the trainer's, optim.max_tokens_per_micro_batch).",
    )
    ap.add_argument(
        "--profile",
        default=None,
        help="Profile one more step of `ours` per shape: the operator table to PROFILE.<shape>.txt.",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="Also write the JSON to this file.")
    args = ap.parse_args()
    tiny = args.tiny
    args.shapes = args.shapes or ("tiny" if tiny else "0.5B,1.5B")
    args.trajectories = args.trajectories or (16 if tiny else 64)
    args.min_len = args.min_len or (64 if tiny else 1024)
    args.max_len = args.max_len or (192 if tiny else 3072)
    args.plain_micro_batch = args.plain_micro_batch or (4 if tiny else 2)
    args.long_len = args.long_len or (512 if tiny else 8192)
    args.grpo_groups = args.grpo_groups or (2 if tiny else 8)
    args.grpo_prompt_len = args.grpo_prompt_len or (64 if tiny else 1000)
    try:
        args.grpo_min_rest, args.grpo_max_rest = (
            int(x) for x in (args.grpo_rest or ("16,96" if tiny else "256,2048")).split(",")
        )
    except ValueError:
        ap.error(f"--grpo-rest takes MIN,MAX (two integers), got {args.grpo_rest!r}")
    if not 1 <= args.grpo_min_rest <= args.grpo_max_rest:
        ap.error(f"--grpo-rest needs 1 <= MIN <= MAX, got {args.grpo_rest!r}")
    if args.interleave is None:
        args.interleave = tiny
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}; choose from {sorted(SHAPES)}")

    import torch.distributed as dist
    import transformers

    from agentrl.train.distributed import init_distributed

    info = init_distributed()
    if info.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = (
            True  # the fp32 parts (optimizer, norms) as a user would run them
        )
    results: dict[str, Any] = {}
    try:
        for name in names:
            results[name] = run_shape(name, info, args)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    device_name = torch.cuda.get_device_name(info.device) if info.device.type == "cuda" else "cpu"
    targets = {
        "speedup_vs_plain_1.5B": 1.3,
        "mfu_1.5B": 0.35,
        "grpo_trained_speedup_vs_plain_1.5B": 2.0,
        "activation_checkpointing_memory_cut": 0.40,
    }
    meets: dict[str, Any] = {}
    if "1.5B" in results:
        r = results["1.5B"]
        if "variants" in r:
            meets["speedup_vs_plain_1.5B"] = r.get("speedup_vs_plain", 0) >= 1.3
            mfu = r["variants"]["ours"].get("mfu")
            meets["mfu_1.5B"] = mfu is not None and mfu >= 0.35
        if "long" in r:
            meets["long_8k_fits_1.5B"] = bool(r["long"].get("ok"))
        if "activation_checkpointing_memory_cut" in r:
            meets["activation_checkpointing_memory_cut_1.5B"] = (
                r["activation_checkpointing_memory_cut"] >= 0.40
            )
        if "grpo" in r:
            meets["grpo_trained_speedup_vs_plain_1.5B"] = r["grpo"].get("trained_speedup_vs_plain", 0) >= 2.0
    out = {
        "benchmark": "train_gpu",
        "mode": "tiny" if tiny else "gpu",
        "device": device_name,
        "peak_tflops": peak_tflops(info.device, args.peak_tflops),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "batch": {
            "trajectories": args.trajectories,
            "group_size": args.group_size,
            "length_range": [args.min_len, args.max_len],
            "steps": args.steps,
            "warmup": args.warmup,
            "interleaved": args.interleave,
        },
        "grpo_batch": None
        if args.skip_grpo
        else {
            "groups": args.grpo_groups,
            "group_size": args.grpo_group_size,
            "prompt_len": args.grpo_prompt_len,
            "rest_range": [args.grpo_min_rest, args.grpo_max_rest],
        },
        "flops_convention": "6 x matmul params x tokens + 6 x layers x hidden x length^2 per sequence (causal)",
        "shapes": results,
        "targets": targets,
        "meets_targets": meets,
    }
    text = json.dumps(out, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
