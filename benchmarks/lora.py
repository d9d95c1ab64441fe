"""LoRA against full fine-tuning on one GRPO batch: peak memory, tokens/s and the weight push, same run.

    .venv/bin/python benchmarks/lora.py --tiny                         # CPU: the tiny model; pushes into vLLM
    python3 -P benchmarks/lora.py --shapes 1.5B --out $OUT/lora.json   # GPU: the Qwen2.5-1.5B shape

Per shape, two ways to train the same model on the same synthesized agentic batch
(`benchmarks/train_gpu.py`'s: groups of trajectories, sampled spans and tool observations in turn):

- `full`: `agentrl.train.update.grpo_step` at the defaults, every weight in AdamW (fp32 master weights);
- `lora`: the same step with `model.lora` (peft adapters, rank `--rank`, all linear layers), only the
  adapters in AdamW.

Per variant: tokens/s (median over timed steps), peak memory (`torch.cuda.max_memory_allocated` on a
GPU, the process heap on the CPU), trainable parameters, and the push of one step's result:
`gather_s` (the trainer's side: the full state dict, or the adapter's two files, gathered to the CPU
and serialized as an engine outside this process receives them), `bytes`, and where vLLM is installed
`engine_s` (the whole push into a running engine: `update_weights` for full, `load_adapter` for LoRA)
and a check that the engine's log-probs then match the trainer's (`logprob_abs_diff`, mean over the
batch's first action tokens). The GPU machine has no vLLM: there the push is the trainer's side only.
Prints ONE JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_gpu as tg


def log(msg: str) -> None:
    print(f"[lora] {msg}", file=sys.stderr, flush=True)


def load_model(source: dict[str, Any] | str, device: torch.device, seed: int) -> Any:
    """A shape (random init) or a checkpoint directory (the tiny model the engine also serves)."""
    if isinstance(source, dict):
        return tg.new_model(source, device, seed)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).to(device)
    model.train()
    return model


def variant(name: str, source: Any, trajs: list[Any], info: Any, args: Any, rank: int | None) -> tg.Variant:
    from agentrl.train.config import LoraSettings, TrainConfig
    from agentrl.train.distributed import shard_model
    from agentrl.train.lora import apply_lora, trainable_parameters
    from agentrl.train.update import grpo_step

    cfg = TrainConfig(model="(random init)", optim={"lr": 1e-4 if rank else 1e-6})

    def build() -> tuple[Any, Any]:
        model = load_model(source, info.device, args.seed)
        if rank:
            base = source if isinstance(source, str) else "(random init)"
            apply_lora(model, LoraSettings(rank=rank, alpha=2 * rank), base)
        shard_model(model, activation_checkpointing=False, bf16=cfg.optim.bf16)
        return model, torch.optim.AdamW(trainable_parameters(model), lr=cfg.optim.lr)

    def step(model: Any, opt: Any) -> None:
        grpo_step(model, opt, trajs, cfg, info, pad_id=0)

    return tg.Variant(name, build, step)


def gather_full(model: Any) -> tuple[float, int, Any]:
    """The full state dict to the CPU and into the buckets an out-of-process engine receives."""
    from agentrl.rollout.weight_sync import (
        DEFAULT_WEIGHT_CHUNK_BYTES,
        buckets,
        full_state_dict,
        named_tensors,
    )

    t0 = time.perf_counter()
    sd = full_state_dict(model)
    chunks = buckets(named_tensors(sd), DEFAULT_WEIGHT_CHUNK_BYTES, serialize=True)
    dt = time.perf_counter() - t0
    return dt, sum(len(c) for c in chunks), sd


def gather_adapter(model: Any) -> tuple[float, int, Any]:
    from agentrl.train.lora import adapter_files

    t0 = time.perf_counter()
    files = adapter_files(model)
    dt = time.perf_counter() - t0
    return dt, sum(len(b) for b in files.values()), files


def engine_logprob_diff(policy: Any, model: Any, trajs: list[Any], args: Any) -> float:
    """Mean |engine - trainer| log-prob of each trajectory's first sampled token after the push: the engine
    serves what the trainer holds (the push really landed), not only fast."""
    from agentrl.rollout.policy import SamplingConfig
    from agentrl.train.batch import collate
    from agentrl.train.logprobs import action_logprobs

    diffs = []
    for t in trajs[: args.check_trajectories]:
        prompt = t.token_ids[: t.prompt_len]
        gen = asyncio.run(
            policy.generate(prompt, SamplingConfig(temperature=1.0, max_tokens=1, seed=args.seed))
        )
        probe = dataclasses.replace(
            t,
            token_ids=[*prompt, gen.token_ids[0]],
            loss_mask=[0] * len(prompt) + [1],
            behavior_logprobs=[0.0] * (len(prompt) + 1),
        )
        with torch.no_grad():
            rows = collate([probe], pad_id=0).to(next(model.parameters()).device)
            lp = action_logprobs(model, rows, temperature=1.0, packed=False).logprobs  # [1, T]
        diffs.append(abs(float(lp[0, len(prompt)]) - gen.logprobs[0]))
    return statistics.fmean(diffs)


def measure_push(v: tg.Variant, lora: bool, trajs: list[Any], policy: Any, args: Any) -> dict[str, Any]:
    """One step, then `--push-reps` pushes of its result: the trainer's side, and the engine's when there is one."""
    model, opt = v.build()
    v.step(model, opt)
    gathers, engines, size, payload = [], [], 0, None
    for _ in range(args.push_reps):
        dt, size, payload = (gather_adapter if lora else gather_full)(model)
        gathers.append(dt)
        if policy is not None:
            t0 = time.perf_counter()
            if lora:
                policy.load_adapter(payload)
            else:
                policy.update_weights(payload)
            engines.append(time.perf_counter() - t0)
    out: dict[str, Any] = {
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "bytes": size,
        "gather_s": round(statistics.median(gathers), 4),
        "engine_s": round(statistics.median(engines), 4) if engines else None,
    }
    if policy is not None:
        out["logprob_abs_diff"] = engine_logprob_diff(policy, model, trajs, args)
    del model, opt
    return out


def run_shape(name: str, info: Any, args: Any) -> dict[str, Any]:
    shape = tg.SHAPES[name]
    trajs = tg.synthesize(
        args.trajectories, args.group_size, args.min_len, args.max_len, shape["vocab_size"], args.seed
    )
    lengths = [len(t.token_ids) for t in trajs]
    tokens, flops = sum(lengths), tg.step_flops(shape, lengths)
    peak = tg.peak_tflops(info.device, None)
    with contextlib.ExitStack() as stack:
        source: Any = shape
        engines: dict[str, Any] = {"full": None, "lora": None}
        if args.tiny:  # a real checkpoint, so a real engine can serve it and take the pushes
            from agentrl.kit.tiny_model import init_tiny

            source = str(init_tiny(Path(stack.enter_context(tempfile.TemporaryDirectory())) / "tiny", seed=0))
            shape = {**shape, "vocab_size": _vocab(source)}
            trajs = tg.synthesize(
                args.trajectories, args.group_size, args.min_len, args.max_len, shape["vocab_size"], args.seed
            )
            if _has_vllm():
                from agentrl.rollout.config import RolloutConfig
                from agentrl.rollout.engine import make_policy

                rollout = RolloutConfig(max_total_tokens=max(1024, args.max_len + 64))
                engines["full"] = stack.enter_context(make_policy(source, rollout, dtype="float32"))
                engines["lora"] = stack.enter_context(
                    make_policy(source, rollout, dtype="float32", lora_rank=args.rank)
                )
        variants = {
            "full": variant("full", source, trajs, info, args, None),
            "lora": variant("lora", source, trajs, info, args, args.rank),
        }
        if args.interleave:
            timing = tg.measure_interleaved(list(variants.values()), info.device, tokens, flops, peak, args)
        else:
            timing = {k: tg.measure(v, info.device, tokens, flops, peak, args) for k, v in variants.items()}
        result: dict[str, Any] = {"tokens_per_step": tokens, "trajectories": len(trajs), "variants": {}}
        for key, v in variants.items():
            log(f"{name}: {key} push ...")
            result["variants"][key] = {
                **timing[key],
                **measure_push(v, key == "lora", trajs, engines[key], args),
            }
            log(f"{name}: {key} {result['variants'][key]}")
    full, lora = result["variants"]["full"], result["variants"]["lora"]
    if full.get("ok") and lora.get("ok"):
        result["lora_vs_full"] = {
            "tokens_per_s": round(lora["tokens_per_s"] / full["tokens_per_s"], 3),
            "peak_memory": round(lora["peak_memory_gib"] / full["peak_memory_gib"], 3),
            "push_bytes": round(lora["bytes"] / full["bytes"], 5),
            "gather_s": round(lora["gather_s"] / max(full["gather_s"], 1e-9), 3),
        }
    return result


def _vocab(model_dir: str) -> int:
    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


def _has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="The tiny model on short trajectories (CPU, CI).")
    ap.add_argument(
        "--shapes", default=None, help="Comma-separated shapes of train_gpu.py (default 1.5B; tiny)."
    )
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank).")
    ap.add_argument("--trajectories", type=int, default=None, help="Batch size (default 64; tiny 16).")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--min-len", type=int, default=None)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--steps", type=int, default=3, help="Timed optimizer steps per variant.")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--push-reps", type=int, default=3, help="Pushes timed per variant.")
    ap.add_argument("--check-trajectories", type=int, default=8, help="Prompts of the engine log-prob check.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="Also write the JSON to this file.")
    args = ap.parse_args()
    args.shapes = args.shapes or ("tiny" if args.tiny else "1.5B")
    args.trajectories = args.trajectories or (16 if args.tiny else 64)
    args.min_len = args.min_len or (64 if args.tiny else 1024)
    args.max_len = args.max_len or (192 if args.tiny else 3072)
    args.interleave = args.tiny  # CPU: both variants see the same background load
    import torch.distributed as dist

    from agentrl.train.distributed import init_distributed

    info = init_distributed()
    results: dict[str, Any] = {}
    try:
        for name in [s.strip() for s in args.shapes.split(",") if s.strip()]:
            results[name] = run_shape(name, info, args)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    out = {
        "benchmark": "lora",
        "device": torch.cuda.get_device_name(info.device) if info.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "rank": args.rank,
        "engine": "vllm" if args.tiny and _has_vllm() else None,
        "batch": {
            "trajectories": args.trajectories,
            "length_range": [args.min_len, args.max_len],
            "steps": args.steps,
            "warmup": args.warmup,
        },
        "shapes": results,
    }
    text = json.dumps(out, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
