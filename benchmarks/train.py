"""Trainer throughput and where a step's time goes; asynchronous against synchronous on a long-tailed env.

    .venv/bin/python benchmarks/train.py                 # ~5 minutes on 2 CPU cores
    .venv/bin/python benchmarks/train.py --steps 3 --nproc 1

Runs `agentrl train` (the real loop: curriculum, vLLM rollouts, FSDP2 update, weight push) twice
on `bench/LongTail-v0` from the same tiny model and seed, once `asynchronous.mode=sync` and once
`async`, and prints ONE JSON object: per mode the wall-clock, trainer tokens/s (action tokens
trained per second of update), and the split of step time into waiting for rollouts, training,
weight sync and the rest; plus the async/sync wall-clock ratio. The first step is excluded from
the averages (engine warm-up).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from agentrl.kit.tiny_model import init_tiny
from agentrl.train.config import TrainConfig
from agentrl.train.launch import launch


def run_mode(mode: str, model: Path, out: Path, args: argparse.Namespace) -> dict:
    cfg = TrainConfig(
        env="benchmarks.longtail_env:bench/LongTail-v0",
        model=str(model),
        out=str(out),
        steps=args.steps,
        rollout={
            "group_size": args.group_size,
            "max_tokens_per_turn": 16,
            "max_total_tokens": 512,
            "concurrency": args.group_size * args.batch_groups * 2,
        },
        curriculum={
            "batch_groups": args.batch_groups,
            "max_gen_factor": 2.0,
            "probe_prob": 1.0,
            "reprobe_prob": 0.0,
        },
        optim={"lr": 1e-4, "micro_batch_size": 8},
        asynchronous={"mode": mode},
        resume=False,
    )
    t0 = time.perf_counter()
    launch(cfg, nproc=args.nproc)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][1:]  # skip warm-up step

    def mean(key: str) -> float:
        vals = [r.get(key, 0.0) for r in rows]
        return statistics.fmean(vals) if vals else 0.0

    step, wait, train, sync = (
        mean("time/step_s"),
        mean("time/wait_for_batch_s"),
        mean("time/train_s"),
        mean("time/weight_sync_s"),
    )
    tokens = sum(r.get("batch/action_tokens", 0.0) for r in rows)
    all_tokens = sum(r.get("batch/sequences", 0.0) * r.get("charts/episode_tokens", 0.0) for r in rows)
    train_time = sum(r.get("time/train_s", 0.0) for r in rows)
    return {
        "mode": mode,
        "wall_s": round(wall, 2),
        "steps": args.steps,
        # Action tokens carry the loss; every token of the sequences goes through forward and backward.
        "trainer_action_tokens_per_s": round(tokens / train_time, 1) if train_time else None,
        "trainer_tokens_per_s": round(all_tokens / train_time, 1) if train_time else None,
        "step_s_mean": round(step, 3),
        "time_split": {
            "rollout_wait": round(wait / step, 3) if step else None,
            "train": round(train / step, 3) if step else None,
            "weight_sync": round(sync / step, 3) if step else None,
            "other": round(max(0.0, step - wait - train - sync) / step, 3) if step else None,
        },
        "rollout_s_mean": round(mean("time/rollout_s"), 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--batch-groups", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-train-") as tmp:
        model = init_tiny(Path(tmp) / "tiny", seed=0)
        results = {m: run_mode(m, model, Path(tmp) / m, args) for m in ("sync", "async")}
    out = {
        "benchmark": "train",
        "env": "bench/LongTail-v0",
        "nproc": args.nproc,
        **results,
        "async_over_sync_wall": round(results["async"]["wall_s"] / results["sync"]["wall_s"], 3),
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
