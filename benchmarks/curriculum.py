"""Task samplers (the learnability band, uniform, DAPO alone, ...) against each other at equal generation.

    .venv/bin/python benchmarks/curriculum.py                 # 3 seeds x 4 arms (how long: benchmarks/RESULTS.md)
    .venv/bin/python benchmarks/curriculum.py --quick         # the same code path in 1-3 minutes (CI)
    .venv/bin/python benchmarks/curriculum.py --arms band,uniform --seeds 0 --budget-tokens 20000
    .venv/bin/python benchmarks/curriculum.py --arms band-cheap,band,uniform --env-kwargs '{"mix": "swe-like"}'

Every arm starts from the same warm start (the calc-v0 model of `agentrl.kit.warm_start`, cached under
`--out`), runs with the same seeds, and stops once it has *generated* `--budget-tokens` tokens
(every token the policy sampled: probes, dropped groups and refills included). The environment is
`agentrl/calc-levels-v0`: calc's arithmetic in difficulty levels, task i's level a pure function of
i, so every arm draws from the same pool. For this model the levels range from mostly solved
through the band to never solved; `--env-kwargs '{"mix": "swe-like"}'` weights the levels so that most
of the pool is never solved, as a small model's SWE-style pool. The arms differ only in
`curriculum.*` settings of `agentrl train`'s config:

- `band`:       the learnability band (probes, re-probes, draws in 0.2 <= p̂ <= 0.8 weighted p̂(1-p̂))
                with dynamic sampling: the demo's curriculum (examples/calc_grpo.yaml);
- `band-cheap`: the band whose probes are half a group, each taking of the next 8 new tasks the one
                whose level's pass rate so far is nearest 1/2 (`probe_group_size`, `prior_key`);
- `uniform`:    every group a task drawn uniformly, every group trained on (`sampler: uniform`);
- `dapo`:       uniform draws, zero-variance groups dropped and the batch refilled (`sampler: dapo`);
- `pools`:      prime-rl's easy/normal/hard pools (`sampler: pools`);
- `mgpo`:       uniform draws, each group's advantages weighted by its pass rate's closeness to 1/2;
- `adaptive`:   the band, plus probes at a difficulty level the curriculum steers so that probes pass
                about half the time (`sampler: leveled`);
- any other name: that sampler (`curriculum.sampler`, a plugin's too) with its defaults.

The real pipeline in one process: a vLLM engine (in-process), the rollout engine and the sandbox
backend (`--backend`, default bwrap), the trainer's `grpo_step` under FSDP2 (one gloo rank), and the
weight push after every update; the engine is shared by the runs, which reload the warm start.
Held-out pass@1 (the test split of the mixed pool, the same episodes and seeds for every model) is
measured at `--eval-points` marks of the budget. Arms run interleaved (seed by seed, arm order
rotated), so the shared box's load drifts over all of them alike.

Prints ONE JSON object (also written to `--out`/curriculum.json), and draws `--out`/curriculum.png:
per arm and seed, held-out pass@1 against generated tokens, the tokens to reach the target, the band
occupancy and the informative groups per generated token; paired comparisons of the band against
each other arm at the end of the budget (`agentrl.eval.paired`, all seeds' episodes pooled, tasks resampled).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ENV = "agentrl/calc-levels-v0"  # the default pool; `--env agentrl/calc-v0` compares the arms on the demo's

# The arms: `curriculum.*` overrides on top of the base config below (the demo's GRPO settings). Any
# other arm name is a sampler (`curriculum.sampler`: a plugin's, say) with its defaults.
ARMS: dict[str, dict[str, Any]] = {
    "band": {},
    # The band with cheaper probes: half a group for a new task (`arm_settings`), chosen by the pass rate
    # of its level so far.
    "band-cheap": {"prior_key": "level"},
    "uniform": {"sampler": "uniform"},
    "dapo": {"sampler": "dapo"},
    "pools": {"sampler": "pools"},
    "mgpo": {"sampler": "mgpo"},
    "adaptive": {"sampler": "leveled"},
}


def arm_settings(arm: str, group_size: int) -> dict[str, Any]:
    if arm == "band-cheap":
        return {**ARMS[arm], "probe_group_size": max(2, group_size // 2)}
    return ARMS.get(arm, {"sampler": arm})


def base_config(args: argparse.Namespace, model: str, out: Path, seed: int, arm: str) -> Any:
    from agentrl.train.config import TrainConfig

    return TrainConfig(
        env=args.env,
        env_kwargs={"backend": args.backend, **args.env_kwargs},
        model=model,
        out=str(out),
        steps=10_000,  # the token budget stops a run, not the step count
        seed=seed,
        rollout={
            "group_size": args.group_size,
            "temperature": 1.0,
            "max_tokens_per_turn": args.max_tokens_per_turn,
            "max_total_tokens": 1024,
            "episode_timeout_s": 120,
            "concurrency": 32,
        },
        curriculum={
            "batch_groups": args.batch_groups,
            "max_gen_factor": 2.0,
            "band_low": 0.2,
            "band_high": 0.8,
            "probe_prob": 0.3,
            "reprobe_prob": 0.1,
            "seed": seed,
            **arm_settings(arm, args.group_size),
        },
        optim={
            "lr": 1e-4,
            "warmup_steps": 2,
            # The demo's update size: 2 epochs of mini-batches of 8 groups (64 episodes at group size 8).
            "epochs": 2,
            "mini_batches": max(1, args.batch_groups // 8),
            "micro_batch_size": 8,
            "grad_clip": 1.0,
        },
        loss={
            "clip_low": 0.2,
            "clip_high": 0.28,
            "agg": "token-mean",
            "negative_weight": 0.0,
            "tis_cap": 2.0,
        },
        resume=False,
    )


# --- held-out evaluation: fixed episodes, outcomes kept per episode for the paired comparisons ---------------


class HeldOut:
    """Tasks 0..n-1 of the test split x `samples`, each episode seeded by its key alone (as `agentrl eval`)."""

    def __init__(self, args: argparse.Namespace):
        from agentrl.eval.evaluate import EvalBudget, resolve_tasks
        from agentrl.rollout.config import RolloutConfig

        env_kwargs = {"backend": args.backend, **args.env_kwargs}
        self.tasks, turns = resolve_tasks(args.env, "test", args.eval_tasks, env_kwargs, None)
        self.budget = EvalBudget(
            env=args.env,
            env_kwargs=env_kwargs,
            split="test",
            num_tasks=args.eval_tasks,
            n=args.eval_samples,
            max_turns=turns,
            seed=12345,
            task_ids=[t.id for t in self.tasks],
            rollout=RolloutConfig(
                temperature=1.0,
                top_p=1.0,
                max_tokens_per_turn=args.max_tokens_per_turn,
                max_total_tokens=1024,
                episode_timeout_s=120,
                concurrency=32,
            ),
        )
        self.keys = [(i, j) for i in range(args.eval_tasks) for j in range(args.eval_samples)]
        self.task_of = {k: self.tasks[k[0]].id for k in self.keys}

    def run(self, policy: Any) -> dict[tuple[int, int], bool]:
        import asyncio

        from agentrl.eval.evaluate import run_episodes

        outcomes: dict[tuple[int, int], bool] = {}

        def keep(rec: Any) -> None:
            outcomes[rec.key] = rec.trajectory.reward >= 1.0

        asyncio.run(run_episodes(policy, self.budget, self.tasks, self.keys, on_episode=keep))
        return outcomes

    def levels(self, outcomes: dict[tuple[int, int], bool]) -> dict[str, float]:
        """Pass@1 by difficulty level (calc-levels-v0), or by task kind for a pool without levels."""
        by: dict[str, list[bool]] = {}
        for (i, _), ok in outcomes.items():
            meta = self.tasks[i].metadata
            by.setdefault(str(meta.get("level", meta.get("kind", "all"))), []).append(ok)
        return {key: round(sum(v) / len(v), 3) for key, v in sorted(by.items())}

    def histogram(self, outcomes: dict[tuple[int, int], bool]) -> dict[str, Any]:
        """How the tasks' pass rates over their samples spread: never, sometimes, always solved (shares),
        and the count of tasks at each number of passes."""
        passes: dict[int, int] = {}
        samples: dict[int, int] = {}
        for (i, _), ok in outcomes.items():
            passes[i] = passes.get(i, 0) + ok
            samples[i] = samples.get(i, 0) + 1
        n = len(passes)
        never = sum(1 for i in passes if passes[i] == 0)
        always = sum(1 for i in passes if passes[i] == samples[i])
        return {
            "tasks": n,
            "samples_per_task": max(samples.values(), default=0),
            "never": round(never / n, 3),
            "sometimes": round((n - never - always) / n, 3),
            "always": round(always / n, 3),
            "tasks_by_passes": [
                sum(1 for i in passes if passes[i] == k) for k in range(max(samples.values(), default=0) + 1)
            ],
        }


# --- one run ------------------------------------------------------------------------------------------------


def run_arm(
    arm: str, seed: int, args: argparse.Namespace, model_dir: str, policy: Any, held_out: HeldOut, out: Path
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import agentrl
    from agentrl.rollout.weight_sync import WeightSync
    from agentrl.train.curriculum import build_curriculum
    from agentrl.train.distributed import init_distributed, shard_model
    from agentrl.train.producer import RolloutProducer
    from agentrl.train.trainer import train_placement
    from agentrl.train.update import grpo_step

    cfg = base_config(args, model_dir, out / f"{arm}-seed{seed}", seed, arm)
    info = init_distributed()
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    shard_model(model, bf16=False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    sync = WeightSync(train_placement(cfg, 1), policy, model, info)  # the trainer's push (rpc on CPU)
    sync.push()  # the engine holds the previous run's weights

    env = agentrl.make(cfg.env, **{**cfg.env_kwargs, "backend": "local", "use_pool": False})
    curriculum = build_curriculum(env.tasks, cfg.curriculum)
    env.close()

    sampled = {"tokens": 0, "episodes": 0}

    def count(t: Any) -> None:  # every finished episode, whether it is trained on or not
        sampled["tokens"] += t.num_action_tokens
        sampled["episodes"] += 1

    gen = RolloutProducer(cfg, policy, on_trajectory=count)
    # Which kind of draw (probe, re-probe, band) each group came from, and whether it was informative:
    # how well the curriculum's choices pay for their generation.
    by_kind: dict[str, dict[str, int]] = {}
    generate = gen.groups

    def groups_by_kind(draws: list[Any]) -> list[Any]:
        kinds = {d.task_id: d.kind for d in draws}
        out = generate(draws)
        for g in out:
            tally = by_kind.setdefault(kinds[g[0].task_id], {"groups": 0, "informative": 0, "episodes": 0})
            tally["episodes"] += len(g)
            tally["groups"] += 1
            tally["informative"] += len({t.reward for t in g if t.trainable}) > 1
        return out

    gen.groups = groups_by_kind  # type: ignore[method-assign]
    marks = [args.budget_tokens * (i + 1) / args.eval_points for i in range(args.eval_points)]
    steps: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    outcomes_at_end: dict[tuple[int, int], bool] = {}
    updates = 0
    t_run = time.perf_counter()
    train_s = rollout_s = eval_s = 0.0
    while sampled["tokens"] < args.budget_tokens:
        t0 = time.perf_counter()
        batch = gen.batch(curriculum)
        rollout_s += time.perf_counter() - t0
        trajs = batch.result.trajectories
        signal = 0.0  # sum over trained groups of the group's reward variance p(1-p): GRPO's signal
        for g in batch.result.groups:
            p = sum(t.reward >= 1.0 for t in g) / len(g)
            signal += p * (1 - p)
        row: dict[str, Any] = {
            "step": len(steps) + 1,
            "tokens": sampled["tokens"],
            "episodes": sampled["episodes"],
            "generated_groups": batch.result.generated_groups,
            "trained_groups": len(batch.result.groups),
            "informative_groups": sum(1 for g in batch.result.groups if len({t.reward for t in g}) > 1),
            "reward_variance_sum": round(signal, 4),
            "reward_mean": round(batch.metrics.get("charts/reward_mean", 0.0), 4),
            "band_occupancy": round(batch.metrics.get("curriculum/band_occupancy", 0.0), 4),
            "tracked": int(batch.metrics.get("curriculum/num_tracked", 0)),
            "in_band": int(batch.metrics.get("curriculum/num_in_band", 0)),
            "draws": {
                k: int(batch.metrics.get(f"curriculum/{k}_draws", 0))
                for k in ("probe", "reprobe", "band", "revisit")
            },
        }
        if "curriculum/level" in batch.metrics:
            row["level"] = batch.metrics["curriculum/level"]
        if trajs:
            t0 = time.perf_counter()
            m = grpo_step(model, opt, trajs, cfg, info, pad_id, updates_done=updates, seed=seed + len(steps))
            updates += cfg.optim.epochs * cfg.optim.mini_batches
            sync.after_update()
            train_s += time.perf_counter() - t0
            row["loss"] = round(m.get("losses/policy_loss", 0.0), 5)
        steps.append(row)
        _log(
            f"{arm} seed {seed} step {row['step']}: {row['tokens']} tokens, {row['trained_groups']} groups "
            f"({row['informative_groups']} informative of {row['generated_groups']} generated), "
            f"band {row['band_occupancy']:.2f}" + (f", level {row['level']:.0f}" if "level" in row else "")
        )
        while marks and sampled["tokens"] >= marks[0]:
            marks.pop(0)
            t0 = time.perf_counter()
            outcomes = held_out.run(policy)
            eval_s += time.perf_counter() - t0
            pass1 = sum(outcomes.values()) / len(outcomes)
            evals.append(
                {
                    "step": row["step"],
                    "tokens": sampled["tokens"],
                    "pass_at_1": round(pass1, 4),
                    "by_level": held_out.levels(outcomes),
                }
            )
            outcomes_at_end = outcomes
            _log(f"{arm} seed {seed}: held-out pass@1 {pass1:.3f} at {sampled['tokens']} tokens")
    del model, opt
    return {
        "arm": arm,
        "seed": seed,
        "curriculum": {k: v for k, v in cfg.curriculum.model_dump().items() if k != "seed"},
        "steps": steps,
        "evals": evals,
        "final_pass_at_1": evals[-1]["pass_at_1"] if evals else None,
        "tokens": sampled["tokens"],
        "episodes": sampled["episodes"],
        "informative_groups": sum(r["informative_groups"] for r in steps),
        "informative_groups_per_1k_tokens": round(
            1000 * sum(r["informative_groups"] for r in steps) / max(sampled["tokens"], 1), 3
        ),
        "reward_variance_per_1k_tokens": round(
            1000 * sum(r["reward_variance_sum"] for r in steps) / max(sampled["tokens"], 1), 4
        ),
        "band_occupancy_mean": round(statistics.fmean(r["band_occupancy"] for r in steps), 4),
        "groups_by_draw_kind": by_kind,
        "informative_fraction": round(
            sum(r["informative_groups"] for r in steps) / max(sum(r["generated_groups"] for r in steps), 1), 4
        ),
        "wall_s": round(time.perf_counter() - t_run, 1),
        "time_s": {"rollout": round(rollout_s, 1), "train": round(train_s, 1), "eval": round(eval_s, 1)},
        "_outcomes": outcomes_at_end,
    }


def tokens_to_target(run: dict[str, Any], target: float) -> int | None:
    """Generated tokens at the first evaluation at or above `target` (None: never within the budget)."""
    for e in run["evals"]:
        if e["pass_at_1"] >= target:
            return e["tokens"]
    return None


# --- the whole benchmark -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    from agentrl.core.runlog import quiet_libraries

    quiet_libraries(out / "engine.log")
    model_dir, warm = prepare_model(args, out)

    from agentrl.eval.paired import compare
    from agentrl.rollout.policy import VLLMPolicy
    from agentrl.train.distributed import init_distributed

    init_distributed()  # before the in-process engine, which joins this one-rank group
    held_out = HeldOut(args)
    policy = VLLMPolicy(
        model_dir,
        in_process=True,
        dtype="float32",
        seed=0,
        max_model_len=1024 + args.max_tokens_per_turn,
        engine_kwargs={"use_tqdm_on_load": False},
    )
    try:
        t0 = time.perf_counter()
        start_outcomes = held_out.run(policy)
        start = sum(start_outcomes.values()) / len(start_outcomes)
        _log(f"warm start: held-out pass@1 {start:.3f} ({time.perf_counter() - t0:.0f}s)")
        runs: list[dict[str, Any]] = []
        for s_i, seed in enumerate(args.seeds):
            order = args.arms[s_i % len(args.arms) :] + args.arms[: s_i % len(args.arms)]  # rotate
            for arm in order:
                runs.append(run_arm(arm, seed, args, model_dir, policy, held_out, out))
    finally:
        policy.close()

    target = start + args.target_points / 100
    arms: dict[str, Any] = {}
    for arm in args.arms:
        mine = [r for r in runs if r["arm"] == arm]
        finals = [r["final_pass_at_1"] for r in mine]
        reach = [tokens_to_target(r, target) for r in mine]
        arms[arm] = {
            "final_pass_at_1_mean": round(statistics.fmean(finals), 4),
            "final_pass_at_1_by_seed": finals,
            "gain_points_mean": round(100 * (statistics.fmean(finals) - start), 2),
            "tokens_to_target_by_seed": reach,
            "seeds_reaching_target": sum(x is not None for x in reach),
            "tokens_by_seed": [r["tokens"] for r in mine],
            "band_occupancy_mean": round(statistics.fmean(r["band_occupancy_mean"] for r in mine), 4),
            "informative_fraction_mean": round(statistics.fmean(r["informative_fraction"] for r in mine), 4),
            "informative_groups_per_1k_tokens": round(
                statistics.fmean(r["informative_groups_per_1k_tokens"] for r in mine), 3
            ),
            "reward_variance_per_1k_tokens": round(
                statistics.fmean(r["reward_variance_per_1k_tokens"] for r in mine), 4
            ),
            "steps_mean": round(statistics.fmean(len(r["steps"]) for r in mine), 2),
            "wall_s_mean": round(statistics.fmean(r["wall_s"] for r in mine), 1),
        }
    # The band against each other arm on the same held-out episodes, every seed pooled (tasks resampled).
    paired = []
    reference = "band" if "band" in args.arms else args.arms[0]
    for arm in args.arms:
        if arm == reference:
            continue

        def pooled(name: str) -> dict[tuple[int, int, int], bool]:
            return {(r["seed"], *k): v for r in runs if r["arm"] == name for k, v in r["_outcomes"].items()}

        a, b = pooled(arm), pooled(reference)
        task_of = {k: held_out.task_of[k[1:]] for k in a}
        paired.append(compare(arm, a, reference, b, task_of, seed=0).as_dict(per_task=False))
    for r in runs:
        del r["_outcomes"]
    result = {
        "benchmark": "curriculum_band_vs_uniform",
        "env": args.env,
        "quick": args.quick,
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "model": model_dir,
        "warm_start": warm,
        "budget_tokens": args.budget_tokens,
        "seeds": args.seeds,
        "settings": {
            "group_size": args.group_size,
            "batch_groups": args.batch_groups,
            "max_tokens_per_turn": args.max_tokens_per_turn,
            "backend": args.backend,
            "env_kwargs": args.env_kwargs,
            "eval": f"{args.eval_tasks} test tasks x {args.eval_samples} samples, T=1, fixed episode seeds",
            "eval_points": args.eval_points,
        },
        "start_pass_at_1": round(start, 4),
        "start_by_level": held_out.levels(start_outcomes),
        "start_pass_rate_histogram": held_out.histogram(start_outcomes),
        "target_pass_at_1": round(target, 4),
        "arms": arms,
        "paired_vs_" + reference: paired,
        "runs": runs,
        "wall_s": round(time.perf_counter() - t_all, 1),
    }
    (out / "curriculum.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "curriculum.png")
    result["png"] = str(out / "curriculum.png")
    return result


def prepare_model(args: argparse.Namespace, out: Path) -> tuple[str, dict[str, Any]]:
    """The warm start every arm starts from: `--model`, a random tiny model (`--quick`), or the calc-v0
    warm start (built once under `--out`, ~7-10 minutes, then cached)."""
    if args.model:
        return args.model, {"path": args.model, "given": True}
    if args.quick:
        from agentrl.kit.tiny_model import init_tiny

        path = init_tiny(out / "tiny", seed=0)
        return str(path), {"path": str(path), "random_init": True}
    from agentrl.kit.warm_start import WarmStartRecipe, warm_start

    ws = warm_start(out / "warm-start", WarmStartRecipe(), threads=1)
    return ws.path, {
        "path": ws.path,
        "reused": ws.reused,
        "build_s": ws.build_s,
        "pass_at_1_calc": ws.pass_at_1,
    }


_COLORS = {
    "band": "tab:blue",
    "band-cheap": "tab:cyan",
    "uniform": "tab:orange",
    "dapo": "tab:green",
    "pools": "tab:brown",
    "mgpo": "tab:pink",
    "adaptive": "tab:purple",
}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15.5, 4.4))
    start = result["start_pass_at_1"]
    ax = axes[0]
    for arm in result["arms"]:
        color = _COLORS.get(arm)
        runs = [r for r in result["runs"] if r["arm"] == arm]
        for r in runs:
            xs = [0] + [e["tokens"] / 1000 for e in r["evals"]]
            ys = [start] + [e["pass_at_1"] for e in r["evals"]]
            ax.plot(xs, ys, color=color, alpha=0.35, lw=1, marker=".", label=None)
        n = min(len(r["evals"]) for r in runs)
        xs = [0] + [statistics.fmean(r["evals"][i]["tokens"] for r in runs) / 1000 for i in range(n)]
        ys = [start] + [statistics.fmean(r["evals"][i]["pass_at_1"] for r in runs) for i in range(n)]
        ax.plot(xs, ys, color=color, lw=2.4, marker="o", label=f"{arm} (mean of {len(runs)} seeds)")
    ax.axhline(result["target_pass_at_1"], color="grey", ls=":", lw=1, label="target")
    ax.set_xlabel("generated tokens (thousands)")
    ax.set_ylabel("held-out pass@1")
    ax.set_title("held-out pass@1 against generation (thin: seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    for ax, key, title in (
        (axes[1], "band_occupancy", "band occupancy (tracked tasks with 0.2 <= p̂ <= 0.8)"),
        (axes[2], "informative_per_1k", "informative groups trained per 1k generated tokens"),
    ):
        for arm in result["arms"]:
            runs = [r for r in result["runs"] if r["arm"] == arm]
            for i, r in enumerate(runs):
                xs = [s["tokens"] / 1000 for s in r["steps"]]
                if key == "band_occupancy":
                    ys = [s["band_occupancy"] for s in r["steps"]]
                else:
                    prev = [0] + [s["tokens"] for s in r["steps"][:-1]]
                    ys = [
                        1000 * s["informative_groups"] / max(s["tokens"] - p, 1)
                        for s, p in zip(r["steps"], prev, strict=True)
                    ]
                ax.plot(xs, ys, color=_COLORS.get(arm), alpha=0.8, marker=".", label=arm if i == 0 else None)
        ax.set_xlabel("generated tokens (thousands)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[1].set_ylim(-0.02, 1.02)
    fig.suptitle(
        f"{result['env']}{_pool(result)}: {len(result['seeds'])} seeds, {result['budget_tokens']} generated tokens per run, "
        f"from the same warm start (held-out pass@1 {start:.3f})",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pool(result: dict[str, Any]) -> str:
    """The pool's settings for a title (e.g. ` (mix=swe-like)`), when any were given."""
    given = result.get("settings", {}).get("env_kwargs") or {}
    return f" ({', '.join(f'{k}={v}' for k, v in given.items())})" if given else ""


def _log(msg: str) -> None:
    print(f"[curriculum-bench] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="Tiny budgets and a random tiny model (CI smoke run)."
    )
    p.add_argument(
        "--arms",
        default="band,uniform,dapo,adaptive",
        help=f"Comma-separated arms out of {', '.join(ARMS)}, or sampler names.",
    )
    p.add_argument("--seeds", default="0,1,2", help="Comma-separated seeds (one run per arm and seed).")
    p.add_argument("--budget-tokens", type=int, default=None, help="Generated tokens per run.")
    p.add_argument(
        "--eval-points", type=int, default=None, help="Held-out evaluations per run (evenly spaced)."
    )
    p.add_argument("--eval-tasks", type=int, default=None, help="Held-out test tasks.")
    p.add_argument("--eval-samples", type=int, default=None, help="Samples per held-out task.")
    p.add_argument("--batch-groups", type=int, default=None, help="Informative groups per batch.")
    p.add_argument("--group-size", type=int, default=None, help="Episodes per group.")
    p.add_argument("--max-tokens-per-turn", type=int, default=None)
    p.add_argument(
        "--target-points", type=float, default=5.0, help="Target: warm-start pass@1 + this many points."
    )
    p.add_argument(
        "--env", default=ENV, help="Task pool (the adaptive arm needs an environment with a difficulty knob)."
    )
    p.add_argument("--backend", default="bwrap", help="Sandbox backend of the python tool (bwrap, docker).")
    p.add_argument(
        "--env-kwargs", default="{}", help='Environment settings as JSON, e.g. \'{"mix": "swe-like"}\'.'
    )
    p.add_argument("--model", default=None, help="Start from this checkpoint instead of the calc warm start.")
    p.add_argument("--out", default="runs/bench-curriculum", help="Run directory (warm start cached here).")
    args = p.parse_args(argv)
    quick = {"budget_tokens": 600, "eval_points": 1, "eval_tasks": 4, "eval_samples": 1, "batch_groups": 2,
             "group_size": 2, "max_tokens_per_turn": 16}  # fmt: skip
    full = {"budget_tokens": 60_000, "eval_points": 3, "eval_tasks": 64, "eval_samples": 4, "batch_groups": 16,
            "group_size": 8, "max_tokens_per_turn": 64}  # fmt: skip
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    from agentrl.train.curriculum import available_samplers

    unknown = [a for a in args.arms if a not in ARMS and a not in available_samplers()]
    if unknown:
        p.error(f"unknown arm(s) {unknown}; choose from {', '.join(ARMS)} or a sampler name")
    try:
        args.env_kwargs = json.loads(args.env_kwargs)
    except json.JSONDecodeError as exc:
        p.error(f"--env-kwargs is not JSON: {exc}")
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.quick and args.seeds == [0, 1, 2]:
        args.seeds = [0]
    return args


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
