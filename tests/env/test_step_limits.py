"""The limits of a step as pieces: each on its own, composed, and composed by a ToolEnv subclass.

No sandbox: the pieces are pure, and the environments here have in-process tools only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from agentrl.core.episode import Episode
from agentrl.core.task import Task
from agentrl.env.agents import tool_call
from agentrl.env.step_limits import (
    MessageLengthLimit,
    Refusal,
    StepLimit,
    StepLimits,
    StepState,
    StepTimeLimit,
    ToolCallLimit,
    TurnLimit,
)
from agentrl.env.tool_env import ToolEnv
from agentrl.env.tools import ToolContext, tool

TASK = Task(id="limits/0", prompt="Say 1.", answer="1")


@tool(needs_sandbox=False)
def nap(ctx: ToolContext, seconds: float) -> str:
    """Sleep a while.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return f"slept {seconds}"


def test_the_message_length_limit_refuses_a_message_past_it_as_a_format_error():
    limit = MessageLengthLimit(5)
    assert limit.check_action("12345") is None
    refusal = limit.check_action("123456")
    assert refusal == Refusal(
        "your message is 6 characters long; the limit is 5. Nothing was run. Send a shorter message with one "
        "tool call",
        format_error=True,
    )
    assert limit.admit_call(99, StepState()) is None and limit.ends_episode(Episode("t", turns=99)) is None


def test_the_tool_call_limit_refuses_the_call_past_it_and_the_rest():
    limit = ToolCallLimit(2)
    assert limit.admit_call(0, StepState()) is None and limit.admit_call(1, StepState()) is None
    refusal = limit.admit_call(2, StepState())
    assert refusal is not None and refusal.format_error
    assert refusal.reason.startswith("at most 2 tool call(s) run per message")
    assert limit.check_action("x" * 10**6) is None


def test_the_time_limit_shares_its_budget_and_refuses_once_it_is_spent():
    limit = StepTimeLimit(10.0)
    fresh = StepState()
    assert limit.admit_call(0, fresh) is None
    assert 9.0 < limit.cap_exec_timeout(30.0, fresh) <= 10.0  # what is left of the budget
    assert limit.cap_exec_timeout(2.0, fresh) == 2.0  # never more than the call's own timeout
    spent = StepState(started_s=time.monotonic() - 11.0)
    refusal = limit.admit_call(0, spent)
    assert refusal == Refusal(
        "this message's tool calls used up its time budget of 10s"
    )  # not the model's fault
    assert limit.cap_exec_timeout(30.0, spent) > 0  # a spent budget never hands the sandbox a timeout <= 0


def test_the_turn_limit_ends_the_episode_at_its_last_turn():
    limit = TurnLimit(3)
    assert limit.ends_episode(Episode("t", turns=2)) is None
    assert limit.ends_episode(Episode("t", turns=3)) == "max_turns"


def test_composed_limits_answer_in_order_and_cap_by_all():
    limits = StepLimits((ToolCallLimit(1), StepTimeLimit(0.0), TurnLimit(1)))
    step = StepState()
    assert limits.admit_call(1, step).format_error  # the call limit comes first
    assert not limits.admit_call(0, step).format_error  # then the spent time budget
    assert StepLimits((StepTimeLimit(5.0), StepTimeLimit(1.0))).cap_exec_timeout(30.0, StepState()) <= 1.0
    assert limits.ends_episode(Episode("t", turns=1)) == "max_turns"
    assert StepLimits(()).check_action("anything") is None


def make_env(**kw) -> ToolEnv:
    return ToolEnv(tasks=[TASK], tools=[nap, "submit"], backend="local", use_pool=False, **kw)


def test_the_env_applies_its_settings_as_the_four_limits():
    env = make_env(max_turns=3, max_action_chars=100, max_tool_calls_per_step=2, step_timeout_s=7.0)
    assert env.step_limits() == [MessageLengthLimit(100), ToolCallLimit(2), StepTimeLimit(7.0), TurnLimit(3)]
    env.max_turns = 5  # the limits follow the settings
    assert TurnLimit(5) in env.step_limits()


def test_the_limits_end_and_refuse_through_step():
    env = make_env(max_turns=2, max_tool_calls_per_step=1, step_timeout_s=0.3)
    env.reset(seed=0)
    obs, _, _, truncated, info = env.step(tool_call("nap", seconds=0.4) + tool_call("nap", seconds=0))
    assert (
        info["step_tool_calls"] == 1 and info["step_tool_calls_not_run"] == 1 and info["format_errors"] == 1
    )
    assert "at most 1 tool call(s) run per message" in obs[-1]["content"] and not truncated
    obs, reward, terminated, truncated, info = env.step("x" * 70000)
    assert "characters long; the limit is 65536" in obs[0]["content"]
    assert truncated and not terminated and info["finish_reason"] == "max_turns" and reward == 0.0


@dataclass(frozen=True)
class EpisodeCallLimit(StepLimit):
    """A limit of one's own: at most `max_calls` tool calls in the whole episode."""

    max_calls: int
    episode: Episode

    def admit_call(self, index: int, step: StepState) -> Refusal | None:
        if self.episode.tool_calls < self.max_calls:
            return None
        return Refusal(f"this episode's {self.max_calls} tool calls are used up")


class FrugalEnv(ToolEnv):
    def step_limits(self) -> list[StepLimit]:
        return [*super().step_limits(), EpisodeCallLimit(2, self.episode)]


@pytest.mark.parametrize("calls_first", [1, 3])
def test_a_subclass_composes_a_limit_of_its_own(calls_first):
    env = FrugalEnv(tasks=[TASK], tools=[nap, "submit"], backend="local", use_pool=False)
    env.reset(seed=0)
    first = "".join(tool_call("nap", seconds=0) for _ in range(calls_first))
    obs, _, _, _, info = env.step(first)
    assert info["step_tool_calls"] == min(calls_first, 2)
    obs, _, terminated, _, info = env.step(tool_call("submit", answer="1"))
    if calls_first == 1:
        assert terminated and info["verdict"].passed
    else:
        assert not terminated and "tool calls are used up" in obs[-1]["content"]
        assert info["step_tool_calls_not_run"] == 1 and info["format_errors"] == 0
