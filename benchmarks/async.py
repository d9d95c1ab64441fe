"""Asynchronous training against synchronous: time to N steps, who waited on whom, and what was learned.

    .venv/bin/python benchmarks/async.py                         # the long-tailed env: sync, k = 1, 2, 4
    .venv/bin/python benchmarks/async.py --env calc --model runs/demo/warm-start --steps 6
    .venv/bin/python benchmarks/async.py --quick                 # smoke: 2 steps, sync and k2 (CI)

Arms: `sync`; `kN`: `asynchronous.max_staleness: N` with `overlap: true` (every batch the bound admits is
built at once); `kN-seq`: the same bound, batches built one after another; `kN-restart`: kN with
`rollout.on_push: restart` (an episode a push reaches is played again, all its tokens from one version). Every arm runs the real
`agentrl train` (curriculum, vLLM rollouts, FSDP2 update under torchrun, weight push) from the same model,
seed and settings, on the long-tailed env (`benchmarks/longtail_env.py`: each step waits a Pareto time)
or on calc-v0 (which needs a model that already solves some tasks: `--model`, the demo's warm start; the arms run
the demo's recipe, examples/calc_grpo.yaml, with their own asynchronous settings).

Per arm, from its metrics.jsonl: the time to N steps (the sum of the step times, engine start-up left
out) and steps per hour; the trainer's idle share (its waits for a batch) and the engines' (the time no
batch was being generated); staleness; trained samples. Then every arm's final model is evaluated on the
same held-out episodes (one `agentrl eval`, each arm paired against sync): pass@1 at equal trained
samples, with the paired verdict. Prints ONE JSON object; `--out F` also writes it and F's .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The long-tailed env is imported by its module path, from the checkout.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
LONGTAIL = "benchmarks.longtail_env:bench/LongTail-v0"


def arm_settings(arm: str) -> dict[str, Any]:
    """The `asynchronous` section of an arm: sync, kN (overlapping batches), kN-seq or kN-restart."""
    if arm == "sync":
        return {"mode": "sync"}
    k, _, kind = arm[1:].partition("-")
    if not arm.startswith("k") or not k.isdigit() or kind not in ("", "seq", "restart"):
        raise SystemExit(f"unknown arm {arm!r}: sync, kN, kN-seq or kN-restart (N the staleness bound)")
    return {"mode": "async", "max_staleness": int(k), "overlap": kind != "seq"}


def arm_rollout(arm: str) -> dict[str, Any]:
    """The rollout settings an arm changes: kN-restart plays an episode again when a push reaches it."""
    return {"on_push": "restart"} if arm.endswith("-restart") else {}


def train_config(args: argparse.Namespace, arm: str, model: str, out: Path) -> dict[str, Any]:
    """An arm's `agentrl train` config. calc-v0 runs the demo's recipe (examples/calc_grpo.yaml: its
    batch, loss and optimizer) with the steps and the asynchronous section of the arm."""
    per_arm = {
        "model": model,
        "out": str(out),
        "steps": args.steps,
        "seed": args.seed,
        "asynchronous": arm_settings(arm),
        "stop_uninformative_after": 0,
        "resume": False,
    }
    if args.env == "calc":
        import yaml

        recipe = yaml.safe_load((ROOT / "examples" / "calc_grpo.yaml").read_text())
        recipe["env_kwargs"] = {**recipe.get("env_kwargs", {}), "backend": args.backend}
        recipe["rollout"] = {**recipe.get("rollout", {}), **arm_rollout(arm)}
        return {**recipe, **per_arm}
    return {
        "env": LONGTAIL,
        "env_kwargs": {"scale_s": args.scale_s, "alpha": args.alpha, "cap_s": args.cap_s},
        "rollout": {
            "group_size": args.group_size,
            "max_tokens_per_turn": 16,
            "max_total_tokens": 512,
            "concurrency": args.concurrency,
            **arm_rollout(arm),
        },
        "curriculum": {"batch_groups": args.batch_groups, "max_gen_factor": 2.0},
        "optim": {"lr": args.lr, "micro_batch_size": 8},
        **per_arm,
    }


def run_arm(args: argparse.Namespace, arm: str, model: str, work: Path) -> dict[str, Any]:
    out = work / arm
    cfg = train_config(args, arm, model, out)
    (work / f"{arm}.json").write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    proc = subprocess.run(
        [str(ROOT / ".venv/bin/agentrl"), "train", str(work / f"{arm}.json"), "--nproc", str(args.nproc)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"arm {arm} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return summarize(arm, rows, wall)


def summarize(arm: str, rows: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """An arm's numbers from its metrics rows (every step; the first one includes no start-up)."""

    def total(key: str) -> float:
        return sum(r.get(key, 0.0) for r in rows)

    steps_s = total("time/step_s")
    return {
        "arm": arm,
        "steps": len(rows),
        "wall_s": round(wall, 1),  # start-up included
        "time_to_n_steps_s": round(steps_s, 1),
        "steps_per_hour": round(3600 * len(rows) / steps_s, 1) if steps_s else None,
        "step_s_median": round(statistics.median(r["time/step_s"] for r in rows), 2) if rows else None,
        "trainer_idle_frac": round(total("time/trainer_wait_s") / steps_s, 3) if steps_s else None,
        "engine_idle_frac": round(min(1.0, total("time/engine_idle_s") / steps_s), 3) if steps_s else None,
        "train_s": round(total("time/train_s"), 1),
        "staleness_mean": round(statistics.fmean(r.get("async/staleness_mean", 0.0) for r in rows), 3),
        "staleness_max": max((r.get("async/staleness_max", 0.0) for r in rows), default=0.0),
        # Sampled tokens that came from weights newer than their episode's first token (pushes mid-episode).
        "tokens_after_push": round(statistics.fmean(r.get("async/tokens_after_push", 0.0) for r in rows), 3),
        "restarts": int(total("rollout/restarts")),
        "trained_samples": int(total("batch/sequences")),
        "reward_mean": round(statistics.fmean(r.get("charts/reward_mean", 0.0) for r in rows), 3),
    }


def evaluate_arms(args: argparse.Namespace, arms: list[str], work: Path) -> dict[str, Any]:
    """Every arm's final model on the same held-out episodes; each arm paired against the first."""
    env = LONGTAIL if args.env == "longtail" else "agentrl/calc-v0"
    cmd = [str(ROOT / ".venv/bin/agentrl"), "eval", "--env", env, "--tasks", str(args.eval_tasks)]
    cmd += ["--samples", str(args.eval_samples), "--k", "1", "--out", str(work / "eval")]
    cmd += ["--max-tokens-per-turn", "16" if args.env == "longtail" else "64"]
    cmd += ["--max-total-tokens", "512" if args.env == "longtail" else "1024"]
    if args.env != "longtail":
        cmd += ["--backend", args.backend]
    for arm in arms:
        cmd += ["--model", str(work / arm / "final"), "--name", arm]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"evaluation failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((work / "eval" / "summary.json").read_text())
    pass1 = {m["model"]: next(p["pass_at_k"] for p in m["pass_at"] if p["k"] == 1) for m in summary["models"]}
    paired = {
        p["model"]: {k: p[k] for k in ("difference_points", "ci_low", "ci_high", "p_value", "verdict")}
        for p in summary.get("paired", [])
    }
    return {"pass_at_1": pass1, "paired_vs_first": paired}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a["arm"] for a in result["arms"]]
    passes = result.get("eval", {}).get("pass_at_1", {})
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    bars = left.bar(arms, [a["steps_per_hour"] for a in result["arms"]], color="#4c72b0")
    for bar, arm in zip(bars, arms, strict=True):  # what each arm learned, at equal trained samples
        if arm in passes:
            left.annotate(f"pass@1 {passes[arm]:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                          ha="center", va="bottom", fontsize=8)  # fmt: skip
    left.set_ylabel("training steps per hour")
    left.set_title(
        f"{result['env'].rpartition(':')[2]}, {result['steps']} steps, {result['nproc']} processes"
    )
    width = 0.38
    xs = range(len(arms))
    right.bar(
        [x - width / 2 for x in xs], [a["trainer_idle_frac"] for a in result["arms"]], width, label="trainer"
    )
    right.bar(
        [x + width / 2 for x in xs], [a["engine_idle_frac"] for a in result["arms"]], width, label="engines"
    )
    right.set_xticks(list(xs), arms)
    right.set_ylabel("share of the run spent waiting")
    right.set_title("who waited")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", choices=("longtail", "calc"), default="longtail")
    ap.add_argument("--arms", default="sync,k1,k2,k4", help="Comma-separated: sync, kN, kN-seq, kN-restart.")
    ap.add_argument(
        "--model", default=None, help="Start model (default: a fresh tiny model; calc needs one)."
    )
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--group-size", type=int, default=4, help="Long-tailed env (calc-v0: the demo's recipe).")
    ap.add_argument("--batch-groups", type=int, default=4, help="Long-tailed env.")
    ap.add_argument("--concurrency", type=int, default=32, help="Long-tailed env.")
    ap.add_argument("--lr", type=float, default=1e-4, help="Long-tailed env.")
    ap.add_argument("--scale-s", type=float, default=0.2, help="Long-tailed env: Pareto scale (seconds).")
    ap.add_argument("--alpha", type=float, default=1.3, help="Long-tailed env: Pareto shape.")
    ap.add_argument("--cap-s", type=float, default=4.0, help="Long-tailed env: the longest step (seconds).")
    ap.add_argument("--backend", default="docker", help="calc-v0's sandbox backend.")
    ap.add_argument("--eval-tasks", type=int, default=64)
    ap.add_argument("--eval-samples", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="2 steps, sync and k2, a small evaluation.")
    ap.add_argument("--out", default=None, help="Also write the JSON here, and the plot next to it (.png).")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.arms, args.eval_tasks, args.eval_samples = 2, "sync,k2", 8, 2
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    for arm in arms:
        arm_settings(arm)  # a bad arm is refused before anything runs
    if args.env == "calc" and args.model is None:
        raise SystemExit("--env calc needs --model: a model that solves some tasks (the demo's warm start)")
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-async-") as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            from agentrl.kit.tiny_model import init_tiny

            model = str(init_tiny(work / "tiny", seed=0))
        results = []
        for arm in arms:
            print(f"[async] {arm} ...", file=sys.stderr, flush=True)
            results.append(run_arm(args, arm, model, work))
            print(f"[async] {arm}: {results[-1]}", file=sys.stderr, flush=True)
        evaluation = evaluate_arms(args, arms, work)
    base = results[0]["steps_per_hour"] or 0.0
    for r in results:
        r["speedup_vs_first"] = round(r["steps_per_hour"] / base, 3) if base and r["steps_per_hour"] else None
    out = {
        "benchmark": "async",
        "env": LONGTAIL if args.env == "longtail" else "agentrl/calc-v0",
        "steps": args.steps,
        "nproc": args.nproc,
        "seed": args.seed,
        # What every arm ran with, its asynchronous section aside.
        "config": {
            k: v
            for k, v in train_config(args, "sync", "m", Path(".")).items()
            if k not in ("model", "out", "asynchronous")
        },
        "arms": results,
        "eval": {"tasks": args.eval_tasks, "samples": args.eval_samples, **evaluation},
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
        plot(out, Path(args.out).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
