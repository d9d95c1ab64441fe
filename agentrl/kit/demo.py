"""The demo: train a small tool-using agent with GRPO and report pass@k before and after.

    make demo                       # = agentrl demo: set-up, then everything below, cached where it can be

1. warm start: the tiny Qwen2 model, SFT on oracle demonstrations of `agentrl/calc-v0` into the
   learnability band (cached by recipe hash; `agentrl.kit.warm_start`);
2. GRPO (`agentrl train`, examples/calc_grpo.yaml) under torchrun with 2 processes (FSDP2, gloo),
   sandboxes of the config's `env_kwargs.backend` (docker containers, reset and reused between episodes),
   vLLM rollouts, the learnability-band curriculum;
3. held-out evaluation of the warm start and the trained model under one budget
   (`agentrl.eval.evaluate`: same tasks, seeds, decoding and limits): pass@1 and pass@k with CIs;
4. plots: reward and band occupancy during training, pass@k before/after, per-task scatter and
   per-task differences; a Markdown report and `demo.json` with every number, the paired verdict
   (difference of pass@1 on the same episodes, its paired bootstrap interval, McNemar's p) included.

Every stage writes under `--out` (default runs/demo) and a second run reuses what is there.

The console shows one line per stage, repeated as it progresses, with an ETA at the pace so far
("[demo] 2/3 GRPO: step 2/12, 1m43s, ETA 8m35s"), then the results. Everything else (engine
logs, library warnings, the training ranks' output) goes to `--out`/demo.log, whose last lines are
shown if a stage fails; `agentrl --debug demo` leaves it all on the console.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from agentrl.kit.numerics import Numerics, pin

EXAMPLE_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "calc_grpo.yaml"


EVAL_TASKS = 160
"""Held-out test tasks of the demo's verdict (x 4 samples): enough paired episodes to detect a 5-point
gain of pass@1 with ~80% power at the discordance GRPO leaves on calc-v0 (docs/DEMO.md)."""


def run_demo(
    out_dir: str = "runs/demo",
    *,
    quick: bool = False,
    nproc: int = 2,
    eval_tasks: int | None = None,
    eval_samples: int | None = None,
    steps: int | None = None,
    seed: int = 0,
    numerics: Numerics = "pinned",
    overrides: Sequence[str] = (),
) -> int:
    """The demo in `out_dir`; `seed` is the warm start's, `numerics` its and the training's CPU kernel paths
    (`agentrl.kit.numerics`), `overrides` change the GRPO config (`optim.lr=5e-5`). Returns an exit code."""
    from agentrl.core.runlog import console_to_file, tail

    # Before anything below imports torch: this process (the evaluation's engines) and every process it
    # starts (the SFT, the torchrun ranks) take the same kernel paths.
    pin(numerics)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log_file = out / "demo.log"
    with console_to_file(log_file) as console:
        print(
            f"[demo] {out}: stage lines here, engine and library logs in {log_file}", file=console, flush=True
        )
        try:
            settings = _Settings(
                quick, nproc, eval_tasks, eval_samples, steps, seed, numerics, tuple(overrides)
            )
            return _run(out, console, log_file, settings)
        except KeyboardInterrupt:
            print(
                f"[demo] interrupted; run it again to resume (what was saved: {log_file})",
                file=console,
                flush=True,
            )
            raise
        except Exception as e:
            from agentrl.core.errors import UserError

            if not isinstance(e, UserError):  # a one-line error says it all; anything else needs the log
                print(f"[demo] failed; the last lines of {log_file}:", file=console)
                print(tail(log_file, 30), file=console, flush=True)
            raise


@dataclass(frozen=True)
class _Settings:
    quick: bool
    nproc: int
    eval_tasks: int | None
    eval_samples: int | None
    steps: int | None
    seed: int
    numerics: Numerics
    overrides: tuple[str, ...]


def _run(out: Path, console: TextIO, log_file: Path, s: _Settings) -> int:
    from agentrl.core.runlog import Stage
    from agentrl.kit.warm_start import WarmStartRecipe, warm_start

    def _say(msg: str) -> None:
        print(f"[demo] {msg}", file=console, flush=True)

    t_all = time.time()
    report: dict = {"quick": s.quick, "seed": s.seed, "numerics": s.numerics, "overrides": list(s.overrides)}

    # 1. warm start (cached)
    t0 = time.time()
    # Step 3 measures the warm start on the held-out tasks, paired with the trained model, so the
    # recipe's own measurement would be a second, smaller one. The oracle's tool calls are trusted code
    # (print(<expression>)); bubblewrap starts the sandbox's python3 faster than a host whose `python3`
    # goes through a version-manager shim and its site hooks (44 s against 71 s for 1,024
    # demonstrations on a 2-core box).
    backend = "bwrap" if shutil.which("bwrap") else "local"
    sizes = {"short_demos": 64, "demos": 32} if s.quick else {}
    recipe = WarmStartRecipe(**sizes, eval_tasks=0, backend=backend, seed=s.seed, numerics=s.numerics)
    with Stage(console, "1/3 warm start", _milestones(log_file, "[warm-start] ")):
        # One OpenMP thread: the same reductions on any box (a sum split over two threads rounds
        # otherwise), and no spin-waiting on a busy one: two threads that wait for each other at every
        # operation took 9-23 s an SFT step beside other work, where one took ~0.3 s.
        ws = warm_start(out / "warm-start", recipe, threads=1)
    report["warm_start"] = {
        "path": ws.path,
        "reused": ws.reused,
        "build_s": round(ws.build_s, 1),
        "seconds": round(time.time() - t0, 1),
    }
    _say(f"warm start: {ws.path} ({'reused' if ws.reused else f'built in {ws.build_s:.0f}s'})")

    cfg, selected = _train(out, console, log_file, s, ws.path, report, _say)
    before, after, paired = _evaluate(out, console, s, cfg, ws.path, selected, report)
    report["total_s"] = round(time.time() - t_all, 1)
    (out / "demo.json").write_text(json.dumps(report, indent=2))

    _say("")
    _say(f"model selection: {report['train']['selection']}")
    _say(f"held-out {cfg.env} (test split, never seen in training): {paired.num_tasks} tasks x "
         f"{paired.episodes // paired.num_tasks} samples, T=1.0")  # fmt: skip
    for m in (before, after):
        cells = "  ".join(f"pass@{p.k} {p.pass_at_k:.3f} [{p.ci_low:.2f},{p.ci_high:.2f}]" for p in m.pass_at)
        _say(f"  {m.model:10s} {cells}")
    _say(f"  {verdict_line(paired, before, after)}")
    _say(
        f"plots: {out / 'training.png'}, {out / 'eval'}; report: {out / 'eval'}/report.md; numbers: {out / 'demo.json'}"
    )
    _say(f"total {report['total_s']:.0f}s")
    return 0


def _train(
    out: Path,
    console: TextIO,
    log_file: Path,
    s: _Settings,
    warm: str,
    report: dict,
    say: Callable[[str], None],
) -> tuple[Any, Path]:
    """2. GRPO under torchrun (resumed from its checkpoint when interrupted; skipped when finished), with
    evaluations on the validation split; returns the config and the checkpoint selection kept."""
    from agentrl.core.runlog import Stage, count_lines
    from agentrl.train.config import load_config
    from agentrl.train.launch import launch
    from agentrl.train.plot import plot_training
    from agentrl.train.selection import read_choice, rule

    overrides = [f"model={warm}", f"out={out / 'train'}"]
    if s.quick:
        overrides += [
            "steps=2",
            "rollout.group_size=4",
            "curriculum.batch_groups=2",
            "rollout.max_tokens_per_turn=32",
            "eval.every=1",
            "eval.tasks=2",
            "eval.samples=2",
        ]
    elif s.steps is not None:
        overrides.append(f"steps={s.steps}")
    cfg = load_config(EXAMPLE_CONFIG, [*overrides, *s.overrides])
    final = out / "train" / "final"
    t0 = time.time()
    if (final / "model.safetensors").exists() and _finished_steps(out / "train") >= cfg.steps:
        say(f"GRPO: reusing {final}")
    else:
        say(
            f"GRPO: {cfg.steps} steps on {cfg.env} with {s.nproc} processes (FSDP2), vLLM rollouts, "
            f"{cfg.env_kwargs.get('backend', 'docker')} sandboxes; validation pass@1 every {cfg.eval.every} steps"
        )
        metrics = out / "train" / "metrics.jsonl"
        with Stage(console, "2/3 GRPO", _counted(lambda: count_lines(metrics), cfg.steps, "step")):
            launch(cfg, nproc=s.nproc)
    choice = read_choice(out / "train" / "best") if cfg.eval.keep_best else None
    selected = out / "train" / "best" if choice is not None else final
    how = (
        f"{cfg.eval.tasks} tasks x {cfg.eval.samples}, every {cfg.eval.every} steps; "
        f"rule: {rule(cfg.eval.at_start)}"
    )
    if choice is None:
        where = f"the last step ({cfg.steps})"
    elif choice["step"] == 0:
        where = (
            f"the warm start itself: no trained step of {cfg.steps} beat its validation pass@1 "
            f"{choice['score']:.3f} ({how})"
        )
    else:
        where = f"step {choice['step']} of {cfg.steps} (validation pass@1 {choice['score']:.3f}, {how})"
    report["train"] = {
        "steps": cfg.steps,
        "seconds": round(time.time() - t0, 1),
        "out": str(out / "train"),
        "selected": str(selected),
        "selected_step": choice["step"] if choice is not None else cfg.steps,
        "selection": where,
        "validation": choice,
    }
    plot_training(out / "train" / "metrics.jsonl", out / "training.png")
    return cfg, selected


def _evaluate(
    out: Path, console: TextIO, s: _Settings, cfg: Any, warm: str, selected: Path, report: dict
) -> tuple[Any, Any, Any]:
    """3. One budget for both checkpoints on the test split; the paired verdict."""
    from agentrl.core.runlog import Stage, count_lines
    from agentrl.eval.evaluate import EvalConfig, evaluate
    from agentrl.eval.paired import load_comparisons
    from agentrl.rollout.config import RolloutConfig

    t0 = time.time()
    n = s.eval_samples or (2 if s.quick else 4)
    ecfg = EvalConfig(
        env=cfg.env,
        env_kwargs=cfg.env_kwargs,  # the training's sandbox backend
        models=[warm, str(selected)],
        names=["warm-start", "grpo"],
        samples=n,
        ks=[k for k in (1, 2, 4, 8, 16, 32) if k <= n],
        split="test",
        tasks=s.eval_tasks or (4 if s.quick else EVAL_TASKS),
        # The training's token limits; the other settings (T=1, the episode timeout) are the defaults.
        rollout=RolloutConfig(
            max_tokens_per_turn=cfg.rollout.max_tokens_per_turn, max_total_tokens=cfg.rollout.max_total_tokens
        ),
        seed=0,
        out=str(out / "eval"),
        # The demo owns runs/demo/eval: episodes of another budget or checkpoint (an earlier demo) go.
        force=True,
        progress=False,
    )
    episodes = 2 * ecfg.tasks * ecfg.samples  # two models, every (task, sample) pair
    written = lambda: count_lines(*(out / "eval").glob("*/episodes.jsonl"))  # noqa: E731
    with Stage(console, "3/3 evaluation", _counted(written, episodes, "episode")):
        before, after = evaluate(ecfg)
    # The paired verdict (same episodes, same seeds): interval of the difference and McNemar's p.
    (paired,) = load_comparisons(out / "eval" / "summary.json")
    delta = after.pass_at_dict()["pass@1"] - before.pass_at_dict()["pass@1"]
    report["eval"] = {
        "seconds": round(time.time() - t0, 1),
        "tasks": ecfg.tasks,
        "samples_per_task": ecfg.samples,
        "before": before.pass_at_dict(),
        "after": after.pass_at_dict(),
    }
    report["paired"] = paired.as_dict(per_task=False)
    report["pass_at_1_gain_points"] = round(100 * delta, 1)
    report["verdict"] = verdict_line(paired, before, after)
    return before, after, paired


def verdict_line(paired: Any, before: Any, after: Any) -> str:
    """The paired verdict on pass@1, with the largest k's pass@k beside it when the two move apart
    (pass@1 up and pass@k down, or the reverse: the update sharpened rather than taught, or the reverse)."""
    a, b = before.pass_at_dict(), after.pass_at_dict()
    k = max(p.k for p in before.pass_at)
    line = paired.verdict
    d1, dk = b["pass@1"] - a["pass@1"], b[f"pass@{k}"] - a[f"pass@{k}"]
    if k > 1 and d1 * dk < 0:
        line += f"; but pass@{k} {a[f'pass@{k}']:.3f} -> {b[f'pass@{k}']:.3f} ({100 * dk:+.1f} points)"
    return line


def _counted(count: Callable[[], int], total: int, unit: str) -> Callable[[], tuple[int, int, str]]:
    """A `Stage` progress: what `count()` has added since now, out of what is left of `total` (a resumed
    stage's ETA is the pace of this session's work, not of what an earlier one finished)."""
    start = count()

    def progress() -> tuple[int, int, str]:
        return count() - start, max(total - start, 0), unit

    return progress


def _milestones(log_file: Path, prefix: str) -> Callable[[], tuple[int, int, str]]:
    """A `Stage` progress for a stage that cannot be counted: its latest line starting with `prefix`
    written to the log from now on (e.g. "main: 40 SFT steps, loss 1.2 -> 0.3")."""
    offset = log_file.stat().st_size if log_file.is_file() else 0
    latest = ""

    def progress() -> tuple[int, int, str]:
        nonlocal offset, latest
        with log_file.open("rb") as f:
            f.seek(offset)
            chunk = f.read()
        cut = chunk.rfind(b"\n") + 1  # whole lines only; the rest is read next time
        offset += cut
        for line in chunk[:cut].decode(errors="replace").splitlines():
            if line.startswith(prefix):
                latest = line[len(prefix) :].strip()
        return 0, 0, latest

    return progress


def _finished_steps(train_dir: Path) -> int:
    from agentrl.train.checkpoint import latest_resumable

    newest = latest_resumable(train_dir)
    return int(json.loads((newest / "trainer_state" / "state.json").read_text())["step"]) if newest else 0


if __name__ == "__main__":
    sys.exit(run_demo())
