"""The demo: train a small tool-using agent with GRPO and report pass@k before and after.

    make demo                       # = agentrl demo: set-up, then everything below, cached where it can be

1. warm start: the tiny Qwen2 model, SFT on oracle demonstrations of `agentrl/calc-v0` into the
   learnability band (cached by recipe hash; `agentrl.warm_start`);
2. GRPO (`agentrl train`, examples/calc_grpo.yaml) under torchrun with 2 processes (FSDP2, gloo),
   docker sandboxes, vLLM rollouts, the learnability-band curriculum;
3. held-out evaluation of the warm start and the trained model under one budget
   (`agentrl.evaluate`: same tasks, seeds, decoding and limits): pass@1 and pass@k with CIs;
4. plots: reward and band occupancy during training, pass@k before/after, per-task scatter and
   per-task differences; a Markdown report and `demo.json` with every number, the paired verdict
   (difference of pass@1 on the same episodes, its paired bootstrap interval, McNemar's p) included.

Every stage writes under `--out` (default runs/demo) and a second run reuses what is there.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

EXAMPLE_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "calc_grpo.yaml"


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def run_demo(
    out_dir: str = "runs/demo",
    *,
    quick: bool = False,
    nproc: int = 2,
    eval_tasks: int | None = None,
    eval_samples: int | None = None,
    steps: int | None = None,
) -> int:
    from agentrl.evaluate import EvalConfig, evaluate
    from agentrl.report import plot_training
    from agentrl.train import launch
    from agentrl.train_config import load_config
    from agentrl.warm_start import WarmStartRecipe, warm_start

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.time()
    report: dict = {"quick": quick}

    # 1. warm start (cached)
    t0 = time.time()
    recipe = WarmStartRecipe(short_demos=64, demos=32, eval_tasks=0) if quick else WarmStartRecipe()
    ws = warm_start(out / "warm-start", recipe, threads=2)
    report["warm_start"] = {
        "path": ws.path,
        "reused": ws.reused,
        "build_s": round(ws.build_s, 1),
        "pass_at_1": ws.pass_at_1,
        "seconds": round(time.time() - t0, 1),
    }
    _say(
        f"warm start: {ws.path} ({'reused' if ws.reused else f'built in {ws.build_s:.0f}s'}); "
        f"held-out pass@1 at T=1: {ws.pass_at_1}"
    )

    # 2. GRPO under torchrun (resumes from its checkpoint when interrupted; skipped when finished)
    overrides = [f"model={ws.path}", f"out={out / 'train'}"]
    if quick:
        overrides += [
            "steps=2",
            "rollout.group_size=4",
            "curriculum.batch_groups=2",
            "rollout.max_tokens_per_turn=32",
        ]
    elif steps is not None:
        overrides.append(f"steps={steps}")
    cfg = load_config(EXAMPLE_CONFIG, overrides)
    final = out / "train" / "final"
    t0 = time.time()
    if (final / "model.safetensors").exists() and _finished_steps(out / "train") >= cfg.steps:
        _say(f"GRPO: reusing {final}")
    else:
        _say(
            f"GRPO: {cfg.steps} steps on {cfg.env} with {nproc} processes (FSDP2), vLLM rollouts, docker sandboxes"
        )
        launch(cfg, nproc=nproc)
    report["train"] = {"steps": cfg.steps, "seconds": round(time.time() - t0, 1), "out": str(out / "train")}
    plot_training(out / "train" / "metrics.jsonl", out / "training.png")

    # 3. one budget for both checkpoints
    t0 = time.time()
    n = eval_samples or (2 if quick else 4)
    ecfg = EvalConfig(
        env=cfg.env,
        models=[ws.path, str(final)],
        names=["warm-start", "grpo"],
        n=n,
        ks=[k for k in (1, 2, 4, 8, 16, 32) if k <= n],
        split="test",
        num_tasks=eval_tasks or (4 if quick else 32),
        temperature=1.0,
        max_tokens_per_turn=cfg.rollout.max_tokens_per_turn,
        max_total_tokens=cfg.rollout.max_total_tokens,
        seed=0,
        out=str(out / "eval"),
        progress=False,
    )
    before, after = evaluate(ecfg)
    report["eval"] = {
        "seconds": round(time.time() - t0, 1),
        "tasks": ecfg.num_tasks,
        "samples_per_task": ecfg.n,
        "before": before.pass_at_dict(),
        "after": after.pass_at_dict(),
    }
    # The paired verdict (same episodes, same seeds): interval of the difference and McNemar's p.
    from agentrl.paired import load_comparisons

    (paired,) = load_comparisons(out / "eval" / "summary.json")
    report["paired"] = paired.as_dict(per_task=False)
    report["total_s"] = round(time.time() - t_all, 1)
    delta = after.pass_at_dict()["pass@1"] - before.pass_at_dict()["pass@1"]
    report["pass_at_1_gain_points"] = round(100 * delta, 1)
    (out / "demo.json").write_text(json.dumps(report, indent=2))

    _say("")
    _say(f"held-out {cfg.env} (test split): {ecfg.num_tasks} tasks x {ecfg.n} samples, T=1.0")
    for s in (before, after):
        cells = "  ".join(f"pass@{p.k} {p.pass_at_k:.3f} [{p.ci_low:.2f},{p.ci_high:.2f}]" for p in s.pass_at)
        _say(f"  {s.model:10s} {cells}")
    _say(f"  pass@1 change: {100 * delta:+.1f} points")
    _say(f"  {paired.verdict}")
    _say(
        f"plots: {out / 'training.png'}, {out / 'eval'}; report: {out / 'eval'}/report.md; numbers: {out / 'demo.json'}"
    )
    _say(f"total {report['total_s']:.0f}s")
    return 0


def _finished_steps(train_dir: Path) -> int:
    from agentrl.checkpoint import latest_resumable

    newest = latest_resumable(train_dir)
    return int(json.loads((newest / "trainer_state" / "state.json").read_text())["step"]) if newest else 0


if __name__ == "__main__":
    sys.exit(run_demo())
