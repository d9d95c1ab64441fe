"""Paired comparison: McNemar's exact test and the paired bootstrap by hand, the verdict, the report pieces."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from agentrl.eval.evaluate import EvalBudget, write_report
from agentrl.eval.paired import (
    PairedComparison,
    compare,
    compare_trajectories,
    format_p,
    load_comparisons,
    markdown_section,
    mcnemar_exact,
    paired_bootstrap_ci,
    plot_differences,
)
from agentrl.eval.report import summarize
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.trajectory import Trajectory

# --- McNemar ---------------------------------------------------------------------------------------------


def test_mcnemar_one_against_nine_by_hand():
    # 10 discordant pairs, 1 one way: 2 * (C(10,0) + C(10,1)) / 2^10 = 2 * 11 / 1024
    assert mcnemar_exact(1, 9) == pytest.approx(22 / 1024, abs=0, rel=1e-15)
    assert mcnemar_exact(9, 1) == mcnemar_exact(1, 9)  # two-sided: symmetric


def test_mcnemar_small_tables_by_hand():
    assert mcnemar_exact(0, 5) == pytest.approx(2 / 32)  # 2 * C(5,0) / 2^5
    assert mcnemar_exact(2, 8) == pytest.approx(2 * (1 + 10 + 45) / 1024)
    assert mcnemar_exact(0, 1) == 1.0  # 2 * 1/2


def test_mcnemar_balanced_and_empty_tables_are_one():
    assert mcnemar_exact(3, 3) == 1.0  # 2 * 42/64 > 1 is capped
    assert mcnemar_exact(0, 0) == 1.0  # no discordant pair: no evidence either way


def test_mcnemar_large_counts_do_not_overflow():
    p = mcnemar_exact(500, 640)
    assert 0.0 < p < 1e-4 and math.isfinite(p)


def test_mcnemar_rejects_negative_counts():
    with pytest.raises(ValueError, match=">= 0"):
        mcnemar_exact(-1, 3)


# --- the paired bootstrap --------------------------------------------------------------------------------


def test_bootstrap_of_equal_differences_is_that_difference():
    assert paired_bootstrap_ci([0.25] * 7, seed=3) == (0.25, 0.25)


def test_bootstrap_of_two_tasks_spans_their_range():
    # Two tasks with differences 0 and 1: resampled means are 0, 1/2, 1 with chances 1/4, 1/2, 1/4,
    # so the 2.5% and 97.5% quantiles are the two ends.
    assert paired_bootstrap_ci([0.0, 1.0], reps=10_000, seed=0) == (0.0, 1.0)


def test_bootstrap_is_deterministic_under_its_seed():
    d = np.random.default_rng(1).uniform(-1, 1, size=40)
    assert paired_bootstrap_ci(d, seed=7) == paired_bootstrap_ci(d, seed=7)
    assert paired_bootstrap_ci(d, seed=7) != paired_bootstrap_ci(d, seed=8)


def test_bootstrap_interval_narrows_with_confidence():
    d = np.random.default_rng(2).uniform(-1, 1, size=30)
    lo95, hi95 = paired_bootstrap_ci(d, seed=0)
    lo50, hi50 = paired_bootstrap_ci(d, confidence=0.5, seed=0)
    assert lo95 < lo50 < d.mean() < hi50 < hi95


def test_bootstrap_rejects_no_tasks():
    with pytest.raises(ValueError, match="at least one task"):
        paired_bootstrap_ci([])


# --- compare ---------------------------------------------------------------------------------------------

# 3 tasks x 4 paired episodes (baseline, model):
#   t0: (1,1) (0,1) (0,1) (1,0)  -> rates 0.50 -> 0.75
#   t1: (0,0) (0,0) (0,1) (0,0)  -> rates 0.00 -> 0.25
#   t2: (1,1) (1,1) (1,1) (1,1)  -> rates 1.00 -> 1.00
PAIRS = {
    "t0": [(1, 1), (0, 1), (0, 1), (1, 0)],
    "t1": [(0, 0), (0, 0), (0, 1), (0, 0)],
    "t2": [(1, 1), (1, 1), (1, 1), (1, 1)],
}


def _outcomes():
    a, b, task = {}, {}, {}
    for i, (t, pairs) in enumerate(PAIRS.items()):
        for j, (x, y) in enumerate(pairs):
            a[(i, j)], b[(i, j)], task[(i, j)] = bool(x), bool(y), t
    return a, b, task


def test_compare_hand_computed_table():
    a, b, task = _outcomes()
    c = compare("warm-start", a, "grpo", b, task, seed=0)
    assert (c.num_tasks, c.episodes) == (3, 12)
    assert (c.b_only, c.a_only, c.both, c.neither) == (3, 1, 5, 3)
    assert c.baseline_pass_at_1 == pytest.approx(6 / 12) and c.model_pass_at_1 == pytest.approx(8 / 12)
    assert c.difference == pytest.approx(2 / 12)
    assert c.p_value == pytest.approx(2 * (1 + 4) / 16)  # McNemar: 3 vs 1 discordant
    assert (c.tasks_better, c.tasks_worse, c.tasks_same) == (2, 0, 1)
    rates = {t.task_id: (t.baseline_rate, t.model_rate) for t in c.tasks}
    assert rates == {"t0": (0.5, 0.75), "t1": (0.0, 0.25), "t2": (1.0, 1.0)}
    # The per-task differences are 0.25, 0.25 and 0: every resampled mean lies in [0, 0.25].
    assert 0.0 <= c.ci_low <= c.difference <= c.ci_high <= 0.25
    assert not c.significant  # p = 0.625


def test_verdict_is_one_line_in_the_issue_format():
    a, b, task = _outcomes()
    c = compare("warm-start", a, "grpo", b, task)
    line = c.verdict
    assert "\n" not in line
    assert line.startswith(
        f"grpo vs warm-start: +16.7 points, 95% CI [{100 * c.ci_low:+.1f}, {100 * c.ci_high:+.1f}], p = 0.625 "
    )
    assert "3 vs 1 discordant of 12 paired episodes" in line


def test_a_clear_win_is_significant():
    # 20 tasks x 4 samples: the baseline passes 1 of each task's 4, the model 3 of them.
    a = {(i, j): j == 0 for i in range(20) for j in range(4)}
    b = {(i, j): j < 3 for i in range(20) for j in range(4)}
    task = {k: f"t{k[0]}" for k in a}
    c = compare("before", a, "after", b, task)
    assert c.difference == pytest.approx(0.5) and (c.ci_low, c.ci_high) == (0.5, 0.5)
    assert c.p_value == pytest.approx(2 / 2**40) and c.significant
    assert format_p(c.p_value) == "1.8e-12"


def test_episodes_that_do_not_pair_are_refused():
    a, b, task = _outcomes()
    del b[(0, 0)]
    with pytest.raises(ValueError, match="not run on the same episodes"):
        compare("a", a, "b", b, task)


def test_unequal_samples_per_task_weigh_tasks_by_episodes():
    # t0: 1 pair (0 -> 1); t1: 3 pairs (0 -> 0): difference 1/4 by episodes, not 1/2 by tasks.
    a = {(0, 0): False, (1, 0): False, (1, 1): False, (1, 2): False}
    b = {(0, 0): True, (1, 0): False, (1, 1): False, (1, 2): False}
    task = {k: f"t{k[0]}" for k in a}
    c = compare("a", a, "b", b, task)
    assert c.difference == pytest.approx(0.25)
    assert c.ci_low == pytest.approx(0.0) and c.ci_high == pytest.approx(1.0)


def test_as_dict_round_trips_and_carries_the_verdict():
    a, b, task = _outcomes()
    c = compare("warm-start", a, "grpo", b, task)
    d = json.loads(json.dumps(c.as_dict()))
    assert d["verdict"] == c.verdict and d["difference_points"] == pytest.approx(16.67)
    assert d["significant"] is False and len(d["tasks"]) == 3
    assert PairedComparison.from_dict(d) == c
    assert "tasks" not in c.as_dict(per_task=False)


def test_format_p():
    assert format_p(1.0) == "1" and format_p(0.0123456) == "0.0123" and format_p(0.00042) == "4.2e-04"


# --- the report --------------------------------------------------------------------------------------------


def traj(task: str, passed: bool) -> Trajectory:
    return Trajectory(
        task_id=task,
        group_id=task,
        token_ids=[1, 2, 3],
        loss_mask=[0, 1, 1],
        behavior_logprobs=[0.0, -0.5, -0.1],
        prompt_len=1,
        reward=float(passed),
        passed=passed,
        finish_reason="submitted",
        policy_version=0,
    )


def test_report_json_markdown_and_plot(tmp_path):
    a_out, b_out, _ = _outcomes()
    keys = sorted(a_out)
    names = {i: t for i, t in enumerate(PAIRS)}
    before = {k: traj(names[k[0]], a_out[k]) for k in keys}
    after = {k: traj(names[k[0]], b_out[k]) for k in keys}
    comparison = compare_trajectories("warm-start", before, "grpo", after)
    summaries = [summarize(n, list(e.values()), [1, 2]) for n, e in (("warm-start", before), ("grpo", after))]
    budget = EvalBudget(
        env="agentrl/calc-v0",
        env_kwargs={},
        split="test",
        num_tasks=3,
        n=4,
        max_turns=4,
        seed=0,
        rollout=RolloutConfig(max_tokens_per_turn=64, max_total_tokens=1024, episode_timeout_s=60),
        task_ids=list(PAIRS),
    )
    paths = write_report(tmp_path, summaries, budget, {"warm-start": "a", "grpo": "b"}, [comparison])
    assert paths["paired_diff"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (loaded,) = load_comparisons(tmp_path / "summary.json")
    assert loaded == comparison
    md = (tmp_path / "report.md").read_text()
    assert "## Paired comparison" in md and comparison.verdict in md
    assert "| **warm-start passed** | 5 | 1 |" in md and "| **warm-start failed** | 3 | 3 |" in md
    assert "| t0 | 4 | 0.50 | 0.75 | +25 |" in md


def test_one_model_has_no_paired_section(tmp_path):
    assert markdown_section([]) == ""
    with pytest.raises(ValueError, match="no paired comparison"):
        plot_differences([], tmp_path / "x.png")
