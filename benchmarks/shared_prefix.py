"""The GRPO update with the common prefix of each packed micro-batch held once, against every sequence whole.

    .venv/bin/python benchmarks/shared_prefix.py                 # ~2 minutes on 2 CPU cores
    .venv/bin/python benchmarks/shared_prefix.py --groups 4 --steps 2

The batch is the demo's: calc-v0 oracle episodes (system prompt with the tool schemas, the question,
a python call, its output, a submit) tokenized for the demo's tiny model (the warm start's sizes,
random init), in groups of `--group-size` with rewards that vary within each group. Every episode is
of another task, so the sequences share their system prompt and no more: the demo's groups (samples
of one task) share their question too, so the demo saves at least this much. The optimizer
settings are `examples/calc_grpo.yaml`'s (two epochs of two mini-batches, 8 sequences a micro-batch,
positives only). Both arms (`optim.share_prefix` on and off) are built from the same weights and
stepped in turn, round after round, so they see the same machine load; the timed part is
`agentrl.train.update.grpo_step` (one process, FSDP2 on a one-rank gloo group, as the demo's ranks run it).

Prints ONE JSON object: tokens of the batch, how many of them the shared prefixes save, per arm the
median step time, the speed-up, and how far apart the two arms' parameters are after the same steps
(the same computation in another order: float32 rounding only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def demo_batch(model_dir: Path, groups: int, group_size: int, work: Path) -> list[Any]:
    """`groups` x `group_size` calc-v0 oracle episodes, each of another task (so the sequences of a
    group share the system prompt only: no more than sampled episodes of one task share), rewards
    alternating within each group."""
    import dataclasses

    from transformers import AutoTokenizer

    from agentrl.kit.demonstrations import generate_demos

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    demos, _ = generate_demos(
        "agentrl/calc-v0", groups * group_size, work / "demos.jsonl", tokenizer, backend="local"
    )
    return [
        dataclasses.replace(
            demo,
            group_id=f"g{i // group_size}",
            reward=float(i % 2),
            passed=bool(i % 2),
            behavior_logprobs=[-1.0 if m else 0.0 for m in demo.loss_mask],
        )
        for i, demo in enumerate(demos)
    ]


def build(model_dir: Path, info: Any, share: str) -> tuple[Any, Any, Any]:
    from transformers import AutoModelForCausalLM

    from agentrl.train.config import TrainConfig
    from agentrl.train.distributed import shard_model

    cfg = TrainConfig(
        model=str(model_dir),
        optim={"lr": 1e-4, "epochs": 2, "mini_batches": 2, "micro_batch_size": 8, "share_prefix": share},
        loss={"negative_weight": 0.0, "tis_cap": 2.0},
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    shard_model(model)
    return model, torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr), cfg


def prefix_savings(batch: list[Any], cfg: Any, info: Any) -> dict[str, int]:
    """Tokens the update's forward passes run per pass over the batch, whole and with prefixes held once."""
    from agentrl.train.batch import collate
    from agentrl.train.packing import shared_prefix_length
    from agentrl.train.update import trainer_micro_batches

    whole = shared = 0
    for mb in trainer_micro_batches(batch, cfg, info, True, shares_prefix=True):
        rows = collate(mb, 0)
        prefix = shared_prefix_length(rows) if len(mb) > 1 else 0
        n = int(rows.lengths.sum())
        whole += n
        shared += n - prefix * (len(mb) - 1)
    return {"tokens_whole": whole, "tokens_shared": shared}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=16, help="GRPO groups in the batch (the demo: 16).")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="Timed grpo_step calls per arm (after one warm-up).")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the demo's ranks run 1 each).")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from agentrl.kit.tiny_model import init_tiny
    from agentrl.kit.warm_start import WarmStartRecipe
    from agentrl.train.distributed import init_distributed
    from agentrl.train.update import grpo_step

    info = init_distributed()
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-prefix-") as tmp:
        work = Path(tmp)
        model_dir = init_tiny(work / "model", seed=0, **WarmStartRecipe().model_overrides)
        batch = demo_batch(model_dir, args.groups, args.group_size, work)
        arms = {share: build(model_dir, info, share) for share in ("off", "on")}
        times: dict[str, list[float]] = {share: [] for share in arms}
        for step in range(1 + args.steps):
            for share, (model, opt, cfg) in arms.items():
                t0 = time.perf_counter()
                grpo_step(model, opt, batch, cfg, info, pad_id=0, updates_done=step, seed=step)
                if step:
                    times[share].append(time.perf_counter() - t0)
        params = [dict(arm[0].named_parameters()) for arm in arms.values()]
        drift = max(
            float((params[0][k].full_tensor() - params[1][k].full_tensor()).abs().max().detach())
            for k in params[0]
        )
        lengths = [len(t.token_ids) for t in batch]
        out = {
            "benchmark": "shared_prefix",
            "machine": {"threads": args.threads, "cpus": os.cpu_count()},
            "batch": {
                "trajectories": len(batch),
                "groups": args.groups,
                "group_size": args.group_size,
                "length_range": [min(lengths), max(lengths)],
                **prefix_savings(batch, arms["on"][2], info),
            },
            "step_s": {share: round(statistics.median(t), 3) for share, t in times.items()},
            "step_s_all": {share: [round(x, 3) for x in t] for share, t in times.items()},
            "speedup": round(statistics.median(times["off"]) / statistics.median(times["on"]), 2),
            "max_param_difference_after_steps": drift,
        }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
