"""Paired comparison of two models evaluated on the same episodes: did the second one really get better?

`agentrl eval` runs every model on the same tasks with the same per-episode seeds, so episode
(task i, sample j) of model A and of model B form a pair. Two models' separate bootstrap intervals
ignore that pairing and overlap long before the difference is in doubt: most of the spread of a
pass@1 estimate comes from which tasks were drawn (easy or hard), and that spread is shared by both
models. Comparing within pairs removes it. This module reports, for a baseline A and a model B:

- the per-task differences d_t = (pass rate of B on task t) - (pass rate of A on task t);
- the pass@1 difference (the mean of d_t, since every task has the same number of samples) with a
  **paired bootstrap** interval: tasks are resampled with replacement, each keeping its episodes
  and their pairing, so the interval covers the task-to-task variation of the *difference* and the
  correlation of the samples within a task;
- **McNemar's exact test** on the paired episodes: of the discordant pairs (B passed where A
  failed: `b_only`; A passed where B failed: `a_only`), under "no difference" each is equally
  likely to go either way, so `b_only` ~ Binomial(b_only + a_only, 1/2); the two-sided p-value is
  min(1, 2 P[X <= min(b_only, a_only)]). It treats episodes as independent pairs; when the samples
  of one task are strongly correlated the task-level bootstrap interval is the safer of the two,
  which is why the verdict gives both;
- a one-line verdict: "grpo vs warm-start: +11.7 points, 95% CI [+2.3, +21.1], p = 0.012 ...".

Everything here is a pure function of the pass/fail outcomes (and a seed for the bootstrap); the
plot and the Markdown section render a finished `PairedComparison`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np


def mcnemar_exact(b_only: int, a_only: int) -> float:
    """Two-sided exact McNemar p-value from the two discordant counts (exact binomial, p = 1/2).

    p = min(1, 2 * sum_{i=0}^{min(b, a)} C(b + a, i) / 2^(b + a)); 1.0 when there is no discordant pair.
    """
    if b_only < 0 or a_only < 0:
        raise ValueError(f"discordant counts must be >= 0, got {b_only} and {a_only}")
    n = b_only + a_only
    if n == 0:
        return 1.0
    low = min(b_only, a_only)
    # Exact integers: C(n, i) stays exact however large n is; only the final division rounds.
    tail = sum(math.comb(n, i) for i in range(low + 1))
    return min(1.0, (2 * tail) / 2**n)  # int / int: correctly rounded, however large


def paired_bootstrap_ci(
    task_differences: Sequence[float] | np.ndarray,
    *,
    weights: Sequence[float] | np.ndarray | None = None,
    confidence: float = 0.95,
    reps: int = 10_000,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean per-task difference, resampling tasks.

    `task_differences[t]` is task t's difference in pass rate (B - A) over its paired episodes;
    resampling whole tasks keeps every task's episodes, and their pairing, together. `weights[t]`
    (its episodes) weighs each resampled task when tasks have unequal samples; None: equal weights.
    """
    d = np.asarray(task_differences, dtype=np.float64)  # [T]
    if d.size == 0:
        raise ValueError("no tasks to compare: the paired bootstrap needs at least one task")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, d.size, size=(reps, d.size))  # [reps, T]
    if weights is None:
        means = d[idx].mean(axis=1)  # [reps]
    else:
        w = np.asarray(weights, dtype=np.float64)  # [T]
        means = (d[idx] * w[idx]).sum(axis=1) / w[idx].sum(axis=1)  # [reps]
    alpha = (1.0 - confidence) / 2
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1.0 - alpha))


@dataclass
class TaskDifference:
    """One task's paired outcome: pass rates of both models over the same episodes."""

    task_id: str
    episodes: int
    baseline_rate: float
    model_rate: float

    @property
    def difference(self) -> float:
        return self.model_rate - self.baseline_rate


@dataclass
class PairedComparison:
    """`model` against `baseline` on the same episodes (see the module docstring)."""

    baseline: str
    model: str
    num_tasks: int
    episodes: int  # paired episodes
    baseline_pass_at_1: float
    model_pass_at_1: float
    difference: float  # model - baseline, as a fraction (x100 for points)
    ci_low: float
    ci_high: float
    confidence: float
    b_only: int  # pairs the model passed and the baseline failed
    a_only: int  # pairs the baseline passed and the model failed
    both: int
    neither: int
    p_value: float  # McNemar's exact test on the paired episodes
    tasks_better: int
    tasks_worse: int
    tasks_same: int
    tasks: list[TaskDifference]
    bootstrap_reps: int
    seed: int

    @property
    def significant(self) -> bool:
        """Both tests agree: the interval excludes 0 and p < 1 - confidence."""
        return (self.ci_low > 0 or self.ci_high < 0) and self.p_value < 1.0 - self.confidence

    @property
    def verdict(self) -> str:
        """One line: "grpo vs warm-start: +11.7 points, 95% CI [+2.3, +21.1], p = 0.012 (...)"."""
        return (
            f"{self.model} vs {self.baseline}: {100 * self.difference:+.1f} points, "
            f"{round(100 * self.confidence)}% CI [{100 * self.ci_low:+.1f}, {100 * self.ci_high:+.1f}], "
            f"p = {format_p(self.p_value)} (pass@1 {self.baseline_pass_at_1:.3f} -> {self.model_pass_at_1:.3f}; "
            f"McNemar exact, {self.b_only} vs {self.a_only} discordant of {self.episodes} paired episodes; "
            f"paired bootstrap over {self.num_tasks} tasks)"
        )

    def as_dict(self, per_task: bool = True) -> dict[str, Any]:
        d = asdict(self)
        d["difference_points"] = round(100 * self.difference, 2)
        d["significant"] = self.significant
        d["verdict"] = self.verdict
        if per_task:
            d["tasks"] = [{**asdict(t), "difference": t.difference} for t in self.tasks]
        else:
            del d["tasks"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PairedComparison:
        fields = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        fields["tasks"] = [
            TaskDifference(t["task_id"], t["episodes"], t["baseline_rate"], t["model_rate"])
            for t in d.get("tasks", [])
        ]
        return cls(**fields)


def format_p(p: float) -> str:
    """Three significant digits; below 0.001 in scientific notation (never a bare 0)."""
    return f"{p:.3g}" if p >= 1e-3 else f"{p:.1e}"


def compare(
    baseline: str,
    baseline_outcomes: Mapping[Hashable, bool],
    model: str,
    model_outcomes: Mapping[Hashable, bool],
    task_of: Mapping[Hashable, str],
    *,
    confidence: float = 0.95,
    reps: int = 10_000,
    seed: int = 0,
) -> PairedComparison:
    """Compare two models' pass/fail outcomes on the same episodes.

    The outcome mappings are keyed by episode (e.g. `(task_index, sample)`); both must hold the
    same keys, each a pair. `task_of[key]` names the episode's task (the bootstrap's unit).
    """
    keys = list(baseline_outcomes)
    if set(keys) != set(model_outcomes):
        only_a = sorted(map(str, set(keys) - set(model_outcomes)))[:3]
        only_b = sorted(map(str, set(model_outcomes) - set(keys)))[:3]
        raise ValueError(
            f"{baseline!r} and {model!r} were not run on the same episodes (only in {baseline}: {only_a}; "
            f"only in {model}: {only_b}); a paired comparison needs identical task and seed lists"
        )
    if not keys:
        raise ValueError(f"no episodes to compare for {model!r} vs {baseline!r}")
    by_task: dict[str, list[tuple[bool, bool]]] = {}
    for key in keys:
        by_task.setdefault(task_of[key], []).append((bool(baseline_outcomes[key]), bool(model_outcomes[key])))
    tasks = [
        TaskDifference(
            task_id=t,
            episodes=len(pairs),
            baseline_rate=sum(a for a, _ in pairs) / len(pairs),
            model_rate=sum(b for _, b in pairs) / len(pairs),
        )
        for t, pairs in by_task.items()
    ]
    pairs = [p for ps in by_task.values() for p in ps]
    b_only = sum(1 for a, b in pairs if b and not a)
    a_only = sum(1 for a, b in pairs if a and not b)
    both = sum(1 for a, b in pairs if a and b)
    diffs = np.array([t.difference for t in tasks])  # [T]
    weights = np.array([t.episodes for t in tasks], dtype=np.float64)  # [T]
    lo, hi = paired_bootstrap_ci(
        diffs,
        # Unequal samples per task: each resampled task weighs as many as its episodes.
        weights=None if np.all(weights == weights[0]) else weights,
        confidence=confidence,
        reps=reps,
        seed=seed,
    )
    eps = 1e-12  # rates are ratios of small integers; a float tie is a tie
    return PairedComparison(
        baseline=baseline,
        model=model,
        num_tasks=len(tasks),
        episodes=len(pairs),
        baseline_pass_at_1=sum(a for a, _ in pairs) / len(pairs),
        model_pass_at_1=sum(b for _, b in pairs) / len(pairs),
        difference=(b_only - a_only) / len(pairs),
        ci_low=lo,
        ci_high=hi,
        confidence=confidence,
        b_only=b_only,
        a_only=a_only,
        both=both,
        neither=len(pairs) - b_only - a_only - both,
        p_value=mcnemar_exact(b_only, a_only),
        tasks_better=sum(1 for t in tasks if t.difference > eps),
        tasks_worse=sum(1 for t in tasks if t.difference < -eps),
        tasks_same=sum(1 for t in tasks if abs(t.difference) <= eps),
        tasks=tasks,
        bootstrap_reps=reps,
        seed=seed,
    )


def compare_trajectories(
    baseline: str,
    baseline_episodes: Mapping[Hashable, Any],
    model: str,
    model_episodes: Mapping[Hashable, Any],
    *,
    success_threshold: float = 1.0,
    confidence: float = 0.95,
    reps: int = 10_000,
    seed: int = 0,
) -> PairedComparison:
    """`compare` on trajectories keyed by episode: a pass is reward >= success_threshold (as pass@k counts it)."""
    return compare(
        baseline,
        {k: t.reward >= success_threshold for k, t in baseline_episodes.items()},
        model,
        {k: t.reward >= success_threshold for k, t in model_episodes.items()},
        {k: t.task_id for k, t in baseline_episodes.items()},
        confidence=confidence,
        reps=reps,
        seed=seed,
    )


def load_comparisons(summary_json: str | Path) -> list[PairedComparison]:
    """The paired comparisons an evaluation's summary.json holds (empty for a one-model evaluation)."""
    data = json.loads(Path(summary_json).read_text())
    return [PairedComparison.from_dict(d) for d in data.get("paired", [])]


# --- rendering -----------------------------------------------------------------------------------------


def markdown_section(comparisons: Sequence[PairedComparison]) -> str:
    """The report's paired section: the verdicts, the 2x2 episode table, the per-task differences."""
    if not comparisons:
        return ""
    lines = [
        "## Paired comparison (same tasks, same episode seeds)",
        "",
        "Difference of pass@1 with a paired bootstrap interval (tasks resampled, each keeping its "
        "paired episodes) and McNemar's exact test on the discordant episode pairs.",
        "",
    ]
    for c in comparisons:
        lines.append(f"- **{c.verdict}**" if c.significant else f"- {c.verdict}")
    for c in comparisons:
        lines += [
            "",
            f"### {c.model} vs {c.baseline}",
            "",
            f"| episodes | {c.model} passed | {c.model} failed |",
            "|---|---|---|",
            f"| **{c.baseline} passed** | {c.both} | {c.a_only} |",
            f"| **{c.baseline} failed** | {c.b_only} | {c.neither} |",
            "",
            f"Tasks better {c.tasks_better}, worse {c.tasks_worse}, same {c.tasks_same}.",
            "",
            "<details><summary>per-task pass rates</summary>",
            "",
            f"| task | episodes | {c.baseline} | {c.model} | difference |",
            "|---|---|---|---|---|",
        ]
        for t in sorted(c.tasks, key=lambda t: (-t.difference, t.task_id)):
            lines.append(
                f"| {t.task_id} | {t.episodes} | {t.baseline_rate:.2f} | {t.model_rate:.2f} | "
                f"{100 * t.difference:+.0f} |"
            )
        lines += ["", "</details>"]
    return "\n".join(lines) + "\n"


def plot_differences(comparisons: Sequence[PairedComparison], path: str | Path) -> Path:
    """Per-task difference in pass rate (points), one panel per comparison, tasks sorted by it.

    Green bars: tasks the model does better on; red: worse; a grey tick: the same. The black line is
    the mean (the pass@1 difference) with its paired-bootstrap interval shaded; the title is the verdict.
    """
    from agentrl.eval.report import pyplot, save_figure

    plt = pyplot()

    if not comparisons:
        raise ValueError("no paired comparison to plot")
    fig, axes = plt.subplots(len(comparisons), 1, figsize=(9.0, 3.6 * len(comparisons)), squeeze=False)
    for ax, c in zip(axes[:, 0], comparisons, strict=True):
        tasks = sorted(c.tasks, key=lambda t: (-t.difference, t.task_id))
        d = np.array([100 * t.difference for t in tasks])  # [T]
        x = np.arange(len(tasks))  # [T]
        colors = ["tab:green" if v > 1e-9 else "tab:red" if v < -1e-9 else "tab:grey" for v in d]
        ax.bar(x, d, color=colors, width=0.8, edgecolor="none")
        same = np.abs(d) <= 1e-9
        ax.plot(x[same], d[same], "_", color="tab:grey", ms=8, mew=2)  # a zero bar is invisible: mark it
        mean, lo, hi = 100 * c.difference, 100 * c.ci_low, 100 * c.ci_high
        ax.axhspan(
            lo, hi, color="black", alpha=0.12, lw=0, label=f"{round(100 * c.confidence)}% paired bootstrap CI"
        )
        ax.axhline(mean, color="black", lw=1.6, label=f"pass@1 difference {mean:+.1f} [{lo:+.1f}, {hi:+.1f}]")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xlim(-0.7, len(tasks) - 0.3)
        ax.set_ylim(-105, 105)
        ax.set_xticks([])
        ax.set_xlabel(
            f"{c.num_tasks} tasks, sorted by difference: better {c.tasks_better} (green), "
            f"worse {c.tasks_worse} (red), same {c.tasks_same} (grey)"
        )
        ax.set_ylabel(f"{c.model} - {c.baseline}\npass rate per task (points)", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(loc="upper right", fontsize=9)
        ax.set_title(
            f"{c.model} vs {c.baseline}: {mean:+.1f} points, {round(100 * c.confidence)}% CI "
            f"[{lo:+.1f}, {hi:+.1f}], McNemar p = {format_p(c.p_value)} "
            f"({c.b_only} vs {c.a_only} discordant episodes)",
            fontsize=10,
        )
    return save_figure(fig, path)
