"""Model selection on the validation split: which trained checkpoint `eval.keep_best` keeps.

The trainer evaluates the policy on held-out validation tasks every `eval.every` steps (and after the
last step) and appends a row to `out/eval.jsonl`. The best row names the checkpoint to keep: its
weights are protected from `keep_last`'s pruning and copied to `out/best` when the run ends. The
candidates are the trained steps and, with `eval.at_start`, the starting model (step 0; the trainer
writes `checkpoint-0` for it): a run in which no trained step beats the model it started from keeps
that model and says so, rather than handing on a model that validation found worse.

The choice is a function of eval.jsonl alone, so a resumed run (whose eval.jsonl is cut back to the
checkpoint it resumes from) makes the same choice as the uninterrupted run. Ties keep the earlier step:
with 128 validation episodes, pass@1 moves in steps of 1/128, and a later step with the same score has
no evidence of being better (so a trained step must beat the starting model, not tie it).

Selection happens on validation only (the config refuses `keep_best` with `eval.split: test`): a
checkpoint chosen on the split it is judged on scores too high there.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METRIC = "eval/pass@1"
RECORD = "agentrl_selection.json"


def rule(start: bool) -> str:
    """The selection rule in words, as the run and the demo print it."""
    among = "the trained steps and the starting model (step 0)" if start else "the trained steps"
    return f"the best validation pass@1 among {among}; ties keep the earlier step"


@dataclass(frozen=True)
class Choice:
    """The checkpoint selection keeps: its step and its validation score."""

    step: int
    score: float


def eval_rows(out: str | Path) -> list[dict[str, Any]]:
    """The rows of `out/eval.jsonl`, oldest first ([] when there are none)."""
    path = Path(out) / "eval.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def best_of(rows: list[dict[str, Any]], metric: str = METRIC, *, start: bool = False) -> Choice | None:
    """The best step of the evaluation rows by `metric` (ties: the earlier step), or None. The trained
    steps are the candidates, and the starting model's row (step 0) too when `start`."""
    best: Choice | None = None
    first = 0 if start else 1
    for row in rows:
        step, score = int(row.get("step", -1)), row.get(metric)
        if step < first or score is None:
            continue
        if best is None or float(score) > best.score:
            best = Choice(step, float(score))
    return best


def evaluated(rows: list[dict[str, Any]], step: int) -> bool:
    return any(int(r.get("step", -1)) == step for r in rows)


def write_best(out: str | Path, choice: Choice, rows: list[dict[str, Any]], *, start: bool = False) -> Path:
    """Copy the weights of `out/checkpoint-<step>` (not its trainer state) to `out/best`, with a record of
    the choice (`agentrl_selection.json`: the rule, the step, its score, every candidate; `start`: the
    starting model was one). Atomic: the copy is renamed into place."""
    from agentrl.train.checkpoint import STATE_DIR

    out = Path(out)
    source = out / f"checkpoint-{choice.step}"
    if not source.is_dir():
        raise FileNotFoundError(
            f"{source} is gone, so the best checkpoint (step {choice.step}) cannot be kept; it is protected "
            "from pruning while training, so something else deleted it"
        )
    tmp = out / ".best.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp, ignore=shutil.ignore_patterns(STATE_DIR))
    record = {
        "rule": rule(start),
        "metric": METRIC,
        "step": choice.step,
        "score": choice.score,
        "start_is_candidate": start,
        "candidates": [
            {"step": int(r["step"]), "score": r.get(METRIC)}
            for r in rows
            if int(r.get("step", -1)) >= (0 if start else 1)
        ],
        "baseline": next(
            ({"step": 0, "score": r.get(METRIC)} for r in rows if int(r.get("step", -1)) == 0), None
        ),
    }
    (tmp / RECORD).write_text(json.dumps(record, indent=2))
    best = out / "best"
    shutil.rmtree(best, ignore_errors=True)
    tmp.rename(best)
    return best


def read_choice(model_dir: str | Path) -> dict[str, Any] | None:
    """The selection record of a kept checkpoint (`out/best`), or None for any other directory."""
    try:
        return json.loads((Path(model_dir) / RECORD).read_text())
    except (OSError, ValueError):
        return None
