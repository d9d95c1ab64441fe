import json

import pytest

from agentrl.eval.report import (
    markdown_report,
    plot_pass_at_k,
    plot_task_scatter,
    summarize,
    write_summary_json,
)
from agentrl.rollout.trajectory import Trajectory


def traj(task: str, reward: float, *, turns=2, tool_calls=2, tool_errors=0, finish="submitted") -> Trajectory:
    return Trajectory(
        task_id=task,
        group_id=task,
        token_ids=[1, 2, 3, 4],
        loss_mask=[0, 0, 1, 1],
        behavior_logprobs=[0, 0, -0.5, -0.1],
        prompt_len=2,
        reward=reward,
        passed=reward >= 1,
        finish_reason=finish,
        policy_version=0,
        turns=turns,
        tool_calls=tool_calls,
        tool_errors=tool_errors,
    )


def episodes(rates: dict[str, int], n: int = 4) -> list[Trajectory]:
    return [traj(t, 1.0 if i < c else 0.0) for t, c in rates.items() for i in range(n)]


def test_summarize_hand_computed():
    # task a: 4/4, task b: 2/4, task c: 0/4
    s = summarize("m", episodes({"a": 4, "b": 2, "c": 0}), ks=[1, 2, 4])
    p = {x.k: x for x in s.pass_at}
    assert p[1].pass_at_k == pytest.approx((1 + 0.5 + 0) / 3)
    # b at k=2: 1 - C(2,2)/C(4,2) = 1 - 1/6
    assert p[2].pass_at_k == pytest.approx((1 + 5 / 6 + 0) / 3)
    assert p[4].pass_at_k == pytest.approx(2 / 3)
    # pass^2 for b: C(2,2)/C(4,2) = 1/6
    assert p[2].pass_hat_k == pytest.approx((1 + 1 / 6 + 0) / 3)
    assert p[1].ci_low <= p[1].pass_at_k <= p[1].ci_high
    assert s.task_pass_rate == {"a": 1.0, "b": 0.5, "c": 0.0}
    assert s.mean_reward == pytest.approx(0.5) and s.samples_per_task == 4 and s.num_tasks == 3
    assert s.finish_reasons == {"submitted": 12} and s.mean_action_tokens == 2


def test_summarize_errors():
    with pytest.raises(ValueError, match="needs at least 8 samples per task"):
        summarize("m", episodes({"a": 1}), ks=[8])
    with pytest.raises(ValueError, match="no episodes"):
        summarize("m", [], ks=[1])


def test_plots_and_reports(tmp_path):
    before = summarize("warm-start", episodes({"a": 1, "b": 0, "c": 2}), ks=[1, 2, 4])
    after = summarize("trained", episodes({"a": 3, "b": 1, "c": 4}), ks=[1, 2, 4])
    for path in (
        plot_pass_at_k([before, after], tmp_path / "passk.png"),
        plot_task_scatter(before, after, tmp_path / "scatter.png"),
    ):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = markdown_report([before, after], env_id="agentrl/calc-v0", split="test")
    assert "| trained |" in md and "pass@4" in md and "3 tasks, 4 samples per task" in md
    data = json.loads(write_summary_json([before, after], tmp_path / "s.json", env="x").read_text())
    assert data["env"] == "x" and data["models"][1]["pass_at"][0]["k"] == 1


def test_markdown_lists_the_budget():
    s = summarize("m", episodes({"a": 1}), ks=[1])
    md = markdown_report(
        [s], env_id="agentrl/calc-v0", split="test", budget={"temperature": 0.7, "max_turns": 4}
    )
    assert "Budget (identical for every model): temperature=0.7, max_turns=4." in md
    assert "Budget" not in markdown_report([s], env_id="agentrl/calc-v0", split="test")
