"""Nothing an environment runs can stall it: every tool call and the verifier have a deadline,
host-side Python included, and what overran is recorded. No sandbox: pure tools, host verifiers."""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import pytest

from agentrl.core.task import Task
from agentrl.env.agents import tool_call
from agentrl.env.tool_env import TOOL_DEADLINE_MARGIN_S, ToolEnv
from agentrl.env.tools import ToolContext, tool
from agentrl.verifiers import Verdict
from agentrl.verifiers.base import DEFAULT_VERIFIER_TIMEOUT_S, VERIFIER_DEADLINE_MARGIN_S
from tests.verifiers.test_base import Crashy

TASK = Task(id="d/1", prompt="Say 1.", answer="1")
SLACK_S = 3.0  # what a step may take past the deadline it met, on a loaded 2-core machine


@tool
def nap(ctx: ToolContext, seconds: float) -> str:
    """Sleep on the host, then note it in the episode's state.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    ctx.state.append(f"slept {seconds}")
    return "awake"


@dataclass
class Hangs:
    name: str = "hangs"

    def verify(self, sandbox, task, episode):
        time.sleep(3600)
        return Verdict(1.0, True)


class NapEnv(ToolEnv):
    def initial_state(self, task: Task) -> list[str]:
        return []


def make(**kw) -> ToolEnv:
    kw.setdefault("tools", [nap, "submit"])
    return NapEnv(tasks=[TASK], backend="local", use_pool=False, max_turns=4, **kw)


def test_a_hanging_host_tool_ends_the_episode_within_its_deadline_with_the_reason():
    env = make(tool_timeout_s=1.0)
    assert not env.needs_sandbox  # nothing but the deadline bounds this tool
    env.reset(seed=0)
    t0 = time.monotonic()
    obs, reward, terminated, truncated, info = env.step(tool_call("nap", seconds=3600))
    assert time.monotonic() - t0 < 1.0 + SLACK_S
    assert truncated and not terminated and reward == 0.0
    assert info["finish_reason"] == "env_error" and info["step_tool_timeouts"] == 1
    assert info["error"].startswith("tool 'nap' did not return within its 1s deadline (tool_timeout_s)")
    assert obs[-1]["content"] == "Error: tool 'nap' did not finish within 1s; the episode ends."
    ep = env.episode
    assert ep.error == info["error"] and ep.tool_timeouts == 1
    assert ep.calls[-1].name == "nap" and ep.calls[-1].timed_out
    assert "environment error" in ep.verdict.details and ep.verdict.reward == 0.0
    # The env goes on: the next episode runs its tools as before.
    env.reset(seed=0)
    assert env.step(tool_call("nap", seconds=0.01))[0][0]["content"] == "awake"


def test_an_abandoned_call_finishing_later_changes_nothing_of_any_episode():
    env = make(tool_timeout_s=0.5)
    env.reset(seed=0)
    old_state = env._ctx.state
    env.step(tool_call("nap", seconds=1.5) + tool_call("submit", answer="1"))
    ep = env.episode
    record = (list(ep.messages), list(ep.calls), ep.stats(), ep.verdict, ep.submission)
    assert ep.calls[-1].name == "nap" and ep.submission is None  # the submit after it never ran
    env.reset(seed=0)
    time.sleep(2.0)  # the abandoned call wakes up, writes the old state, returns into nothing
    assert old_state == ["slept 1.5"]  # it ran to its end: a thread is not stopped, only abandoned
    assert (list(ep.messages), list(ep.calls), ep.stats(), ep.verdict, ep.submission) == record
    assert env._ctx.state == [] and env.episode.calls == []


def test_a_hanging_verifier_ends_its_episode_within_its_deadline_with_reward_0():
    env = make(verifier=Hangs(), verifier_timeout_s=1.0)
    env.reset(seed=0)
    t0 = time.monotonic()
    obs, reward, terminated, truncated, info = env.step(tool_call("submit", answer="1"))
    assert time.monotonic() - t0 < 1.0 + SLACK_S
    assert terminated and reward == 0.0 and not info["verdict"].passed
    assert info["verdict"].details.startswith("verifier 'hangs' exceeded its 1s deadline and was abandoned")
    assert env.episode.verdict is info["verdict"]


def test_a_crashing_verifier_is_recorded_with_the_file_and_line_it_raised_at():
    env = make(verifier=Crashy())
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step(tool_call("submit", answer="1"))
    lines, start = inspect.getsourcelines(Crashy.verify)
    line = start + next(i for i, text in enumerate(lines) if "raise " in text)
    assert terminated and reward == 0.0
    file = inspect.getsourcefile(Crashy)
    assert info["verdict"].details == f"verifier 'crashy' crashed: ValueError: boom (at {file}:{line})"


def test_default_deadlines():
    env = make(exec_timeout_s=7.0)
    assert env.tool_deadline_s == 7.0 + TOOL_DEADLINE_MARGIN_S
    assert env.verifier_deadline_s == DEFAULT_VERIFIER_TIMEOUT_S  # exact-match has no timeout of its own
    env = make(verifier=("hidden-tests", {"timeout_s": 600}))
    assert env.verifier_deadline_s == 600 + VERIFIER_DEADLINE_MARGIN_S  # never cut short of its own
    env = make(tool_timeout_s=2.0, verifier=("hidden-tests", {"timeout_s": 600}), verifier_timeout_s=9.0)
    assert (env.tool_deadline_s, env.verifier_deadline_s) == (2.0, 9.0)


@pytest.mark.parametrize("key", ["tool_timeout_s", "verifier_timeout_s"])
def test_a_deadline_must_be_positive(key):
    with pytest.raises(ValueError, match=f"{key} must be > 0 seconds"):
        make(**{key: 0})
