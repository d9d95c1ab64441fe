"""The training run's plot: batch reward, band occupancy and policy loss per step (out/training.png).

plot_training("runs/x/metrics.jsonl", "runs/x/training.png")
"""

from __future__ import annotations

import json
from pathlib import Path

from agentrl.eval.report import pyplot, save_figure


def plot_training(metrics_path: str | Path, out_png: str | Path) -> Path:
    """Batch reward, band occupancy and policy loss per step, from a run's metrics.jsonl.

    Steps are integers on the x axis; a step without an update (no informative group) has no loss
    and is marked with a grey x on the loss panel.
    """
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    rows = [json.loads(x) for x in Path(metrics_path).read_text().splitlines() if x.strip()]
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12.5, 3.6))
    panels = (
        ("charts/reward_mean", "mean reward of the batch", "batch reward", (-0.02, 1.02)),
        (
            "curriculum/band_occupancy",
            "share of tracked tasks in band",
            "band occupancy (0.2 <= p̂ <= 0.8)",
            (-0.02, 1.02),
        ),
        ("losses/policy_loss", "policy loss", "policy loss", None),
    )
    for ax, (key, ylabel, title, ylim) in zip(axes, panels, strict=True):
        values = [r.get(key, float("nan")) for r in rows]
        ax.plot(steps, values, marker="o", ms=4)
        if key == "losses/policy_loss":
            skipped = [s for s, r in zip(steps, rows, strict=True) if key not in r]
            if skipped:
                ax.plot(skipped, [0.0] * len(skipped), "x", color="grey", ms=7, label="no update")
                ax.legend(loc="best", fontsize=8)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if ylim is not None:
            ax.set_ylim(*ylim)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if steps:
            ax.set_xlim(min(steps) - 0.5, max(steps) + 0.5)
        ax.grid(alpha=0.3)
    return save_figure(fig, out_png, dpi=110)
