"""Evaluation summaries and reports: pass@k with confidence intervals, agent metrics, plots, Markdown.

Input is what an evaluation wrote: per-episode records (`Trajectory`), several samples per
task. Everything here is a pure function of those records, so a report can be rebuilt from
the JSONL files at any time.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agentrl.eval.passk import bootstrap_ci, pass_at_k_per_task, pass_hat_k_per_task
from agentrl.rollout.trajectory import Trajectory


@dataclass
class PassAtK:
    k: int
    pass_at_k: float
    ci_low: float
    ci_high: float
    pass_hat_k: float


@dataclass
class ModelSummary:
    model: str
    num_tasks: int
    samples_per_task: int
    mean_reward: float
    pass_at: list[PassAtK]
    task_pass_rate: dict[str, float]
    mean_turns: float
    mean_tool_calls: float
    tool_error_rate: float  # tool errors per tool call
    tool_timeouts: int
    format_errors: int
    mean_tokens: float
    mean_action_tokens: float
    finish_reasons: dict[str, int]
    wall_s: float
    extra: dict[str, float] = field(default_factory=dict)

    def pass_at_dict(self) -> dict[str, float]:
        return {f"pass@{p.k}": p.pass_at_k for p in self.pass_at}


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path, dpi: int = 120) -> Path:
    """Lay out, write and close `fig`; returns `path`."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return Path(path)


def summarize(
    model: str,
    trajectories: Sequence[Trajectory],
    ks: Sequence[int],
    *,
    wall_s: float = 0.0,
    success_threshold: float = 1.0,
    seed: int = 0,
) -> ModelSummary:
    """pass@k per k (unbiased, bootstrap CI over tasks) and agent metrics of one model's episodes."""
    if not trajectories:
        raise ValueError(f"no episodes for model {model!r}: nothing to summarize")
    by_task: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        by_task[t.task_id].append(t)
    task_ids = sorted(by_task)
    n = np.array([len(by_task[t]) for t in task_ids])  # [T]
    c = np.array([sum(x.reward >= success_threshold for x in by_task[t]) for t in task_ids])  # [T]
    n_min = int(n.min())
    pass_at = []
    for k in sorted(set(ks)):
        if k > n_min:
            raise ValueError(f"pass@{k} needs at least {k} samples per task; the smallest task has {n_min}")
        per = pass_at_k_per_task(n, c, k)  # [T]
        lo, hi = bootstrap_ci(per, seed=seed)
        pass_at.append(PassAtK(k, float(per.mean()), lo, hi, float(pass_hat_k_per_task(n, c, k).mean())))
    calls = sum(t.tool_calls for t in trajectories)
    return ModelSummary(
        model=model,
        num_tasks=len(task_ids),
        samples_per_task=n_min,
        mean_reward=float(np.mean([t.reward for t in trajectories])),
        pass_at=pass_at,
        task_pass_rate={t: float(cc / nn) for t, nn, cc in zip(task_ids, n, c, strict=True)},
        mean_turns=float(np.mean([t.turns for t in trajectories])),
        mean_tool_calls=float(np.mean([t.tool_calls for t in trajectories])),
        tool_error_rate=float(sum(t.tool_errors for t in trajectories) / calls) if calls else 0.0,
        tool_timeouts=sum(t.tool_timeouts for t in trajectories),
        format_errors=sum(t.format_errors for t in trajectories),
        mean_tokens=float(np.mean([len(t.token_ids) for t in trajectories])),
        mean_action_tokens=float(np.mean([t.num_action_tokens for t in trajectories])),
        finish_reasons=dict(Counter(t.finish_reason for t in trajectories)),
        wall_s=wall_s,
    )


# Distinct in colour, marker and line style, so models stay apart in print and for colour-blind readers.
_STYLES = [("tab:blue", "o", "-"), ("tab:orange", "s", "--"), ("tab:green", "^", "-."), ("tab:red", "D", ":")]


def _style(i: int) -> tuple[str, str, str]:
    color, marker, line = _STYLES[i % len(_STYLES)]
    return (color if i < len(_STYLES) else f"C{i % 10}", marker, line)


def plot_pass_at_k(summaries: Sequence[ModelSummary], path: str | Path, title: str = "") -> Path:
    """pass@k against k for each model, its 95% bootstrap CI as error bars.

    Readable at a glance with several models: each has its own colour, marker and line style; the
    models are nudged apart along k (a few percent on the log axis), so equal curves and
    overlapping intervals stay visible side by side instead of merging into one shaded area.
    """
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    n = len(summaries)
    for i, s in enumerate(summaries):
        color, marker, line = _style(i)
        ks = np.array([p.k for p in s.pass_at], dtype=float)  # [K]
        shift = 2.0 ** ((i - (n - 1) / 2) * 0.06)  # multiplicative: the same offset at every k on log2
        x = ks * shift  # [K]
        y = np.array([p.pass_at_k for p in s.pass_at])  # [K]
        lo = np.array([p.ci_low for p in s.pass_at])  # [K]
        hi = np.array([p.ci_high for p in s.pass_at])  # [K]
        ax.errorbar(
            x,
            y,
            yerr=[y - lo, hi - y],
            color=color,
            marker=marker,
            linestyle=line,
            markersize=6,
            capsize=4,
            elinewidth=1.2,
            label=f"{s.model} (pass@{s.pass_at[0].k} {y[0]:.3f})",
        )
    ax.set_xscale("log", base=2)
    all_ks = sorted({p.k for s in summaries for p in s.pass_at})
    ax.set_xticks(all_ks, [str(k) for k in all_ks])  # k itself, not 2^i
    ax.minorticks_off()
    ax.set_xlabel("k (samples per task)")
    ax.set_ylabel("pass@k (fraction of tasks solved)")
    ax.set_ylim(-0.02, 1.02)  # a model at 0 stays visible on the axis
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    tasks = summaries[0].num_tasks if summaries else 0
    ax.set_title(title or f"pass@k on {tasks} tasks (bars: 95% bootstrap CI over tasks)")
    return save_figure(fig, path)


def plot_task_scatter(before: ModelSummary, after: ModelSummary, path: str | Path) -> Path:
    """Per-task pass rate, before (x) against after (y); points above the diagonal improved.

    Pass rates are multiples of 1/samples, so many tasks share a point: each point's area grows
    with the number of tasks on it, and that number is written on it.
    """
    plt = pyplot()

    tasks = sorted(set(before.task_pass_rate) & set(after.task_pass_rate))
    pairs = Counter((round(before.task_pass_rate[t], 6), round(after.task_pass_rate[t], 6)) for t in tasks)
    better = sum(after.task_pass_rate[t] > before.task_pass_rate[t] for t in tasks)
    worse = sum(after.task_pass_rate[t] < before.task_pass_rate[t] for t in tasks)
    fig, ax = plt.subplots(figsize=(5.2, 5.2))
    ax.plot([0, 1], [0, 1], color="grey", lw=1, ls="--", zorder=0)
    if pairs:
        xy = np.array(list(pairs))  # [P, 2]
        counts = np.array(list(pairs.values()))  # [P]
        colors = ["tab:green" if y > x else "tab:red" if y < x else "tab:grey" for x, y in xy]
        ax.scatter(
            xy[:, 0], xy[:, 1], s=60 + 340 * counts / counts.max(), c=colors, alpha=0.55, edgecolors="k"
        )
        for (x, y), c in zip(xy, counts, strict=True):
            ax.annotate(str(c), (x, y), ha="center", va="center", fontsize=8, fontweight="bold")
    ax.set_xlabel(f"pass rate per task: {before.model}")
    ax.set_ylabel(f"pass rate per task: {after.model}")
    ax.set_xlim(-0.08, 1.08)
    ax.set_ylim(-0.08, 1.08)
    ax.set_aspect("equal")
    ax.grid(alpha=0.3)
    ax.set_title(
        f"{len(tasks)} tasks (number on a point: tasks there)\n"
        f"improved {better} (green), worse {worse} (red), same {len(tasks) - better - worse}",
        fontsize=10,
    )
    return save_figure(fig, path)


def markdown_report(
    summaries: Sequence[ModelSummary], *, env_id: str, split: str, budget: dict[str, object] | None = None
) -> str:
    """A short Markdown summary: one row per model; `budget`, if given, is listed under it."""
    ks = [p.k for p in summaries[0].pass_at]
    lines = [
        f"# Evaluation on `{env_id}` ({split} split)",
        "",
        f"{summaries[0].num_tasks} tasks, {summaries[0].samples_per_task} samples per task; "
        "pass@k is the unbiased estimator (Chen et al., 2021), [95% bootstrap CI over tasks].",
        "",
        "| model | "
        + " | ".join(f"pass@{k}" for k in ks)
        + " | mean reward | turns | tool calls | tool err | timeouts |",
        "|---|" + "---|" * (len(ks) + 5),
    ]
    for s in summaries:
        cells = [f"{p.pass_at_k:.3f} [{p.ci_low:.2f}, {p.ci_high:.2f}]" for p in s.pass_at]
        lines.append(
            f"| {s.model} | " + " | ".join(cells) + f" | {s.mean_reward:.3f} | {s.mean_turns:.2f} | "
            f"{s.mean_tool_calls:.2f} | {s.tool_error_rate:.2f} | {s.tool_timeouts} |"
        )
    lines.append("")
    for s in summaries:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(s.finish_reasons.items()))
        lines.append(
            f"- **{s.model}**: finish reasons {reasons}; {s.mean_tokens:.0f} tokens per episode "
            f"({s.mean_action_tokens:.0f} sampled); {s.format_errors} format errors; {s.wall_s:.0f}s wall."
        )
    if budget:
        # The conditions every model above was held to: what makes the rows comparable.
        lines += [
            "",
            "Budget (identical for every model): " + ", ".join(f"{k}={v}" for k, v in budget.items()) + ".",
        ]
    return "\n".join(lines) + "\n"


def write_summary_json(summaries: Sequence[ModelSummary], path: str | Path, **meta: object) -> Path:
    Path(path).write_text(json.dumps({**meta, "models": [asdict(s) for s in summaries]}, indent=2))
    return Path(path)
