"""ToolEnv keeps the Gymnasium contract and turns everything the model writes into observations."""

from __future__ import annotations

import docker
import pytest

import agentrl
from agentrl.agents import tool_call
from agentrl.env import ToolEnv
from agentrl.task import Task
from agentrl.tools import ToolContext, tool

TASK = Task(
    id="unit/1", prompt="Compute 6*7 and submit it.", answer="42", files={"notes/hint.txt": "six times seven"}
)


@tool
def explode(ctx: ToolContext, n: int) -> str:
    """Raise an exception (a crashed tool).

    Args:
        n: Anything.
    """
    raise RuntimeError(f"tool crashed with {n}")


def make_env(**kw) -> ToolEnv:
    kw.setdefault("tools", ["bash", "python", "read_file", "write_file", "str_replace", "submit", explode])
    kw.setdefault("verifier", "numeric")
    kw.setdefault("max_turns", 6)
    kw.setdefault("exec_timeout_s", 2.0)
    return ToolEnv(tasks=[TASK], **kw)


@pytest.fixture
def env():
    e = make_env()
    yield e
    e.close()


pytestmark = pytest.mark.docker


def test_reset_gives_system_with_tool_schemas_then_task(env):
    obs, info = env.reset(seed=0)
    assert [m["role"] for m in obs] == ["system", "user"]
    assert "<tools>" in obs[0]["content"] and '"name": "str_replace"' in obs[0]["content"]
    assert obs[1]["content"] == TASK.prompt
    assert info["task_id"] == "unit/1" and len(info["tools"]) == 7
    assert env.observation_space.contains(obs)
    # Task files are in the workspace.
    out, *_ = env.step(tool_call("bash", command="cat notes/hint.txt"))
    assert out[0]["content"] == "six times seven"


def test_full_episode_reward_only_at_the_end(env):
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(tool_call("python", code="print(6*7)"))
    assert obs == [{"role": "tool", "name": "python", "tool_call_id": "call_0", "content": "42"}]
    assert (reward, terminated, truncated) == (0.0, False, False)
    obs, reward, terminated, truncated, info = env.step(tool_call("submit", answer="42"))
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info["verdict"].passed and info["finish_reason"] == "submitted"
    assert info["tool_calls"] == 2 and info["tools_used"] == {"python": 1, "submit": 1}
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("more")


def test_file_tools(env):
    env.reset(seed=0)
    env.step(tool_call("write_file", path="a.py", content="x = 1\nprint(x + 1)\n"))
    obs, *_ = env.step(tool_call("str_replace", path="a.py", old="x = 1", new="x = 41"))
    assert obs[0]["content"] == "Replaced 1 occurrence in a.py."
    obs, *_ = env.step(tool_call("read_file", path="a.py"))
    assert obs[0]["content"] == "x = 41\nprint(x + 1)\n"
    obs, *_ = env.step(tool_call("bash", command="python3 a.py"))
    assert obs[0]["content"] == "42"
    obs, *_ = env.step(tool_call("str_replace", path="a.py", old="nothere", new=""))
    assert "occurs 0 times" in obs[0]["content"]


def test_parallel_calls_run_in_order_and_submit_stops_the_rest(env):
    env.reset(seed=0)
    action = (
        tool_call("bash", command="echo one > f")
        + tool_call("bash", command="cat f")
        + tool_call("submit", answer="42")
        + tool_call("bash", command="echo never")
    )
    obs, reward, terminated, _, info = env.step(action)
    assert [m["content"] for m in obs[:2]] == ["[no output]", "one"]
    assert "1 later tool call(s) in the same message were not run" in obs[2]["content"]
    assert terminated and reward == 1.0 and info["tool_calls"] == 3


@pytest.mark.parametrize(
    ("label", "action", "needle"),
    [
        ("empty", "", "no tool call found"),
        ("one megabyte", "x" * (1 << 20), "the limit is"),
        (
            "broken json",
            '<tool_call>{"name": "bash", "arguments": {"command": "ls"</tool_call>',
            "not valid JSON",
        ),
        ("unknown tool", tool_call("bsh", command="ls"), "unknown tool 'bsh'. Did you mean 'bash'?"),
        ("wrong argument types", tool_call("python", code=123), "bad arguments for tool 'python'"),
        ("crashing tool", tool_call("explode", n=1), "RuntimeError: tool crashed with 1"),
        ("hanging tool", tool_call("bash", command="sleep 1000"), "timed out after 2s"),
    ],
)
def test_garbage_actions_are_error_observations_and_the_env_stays_usable(env, label, action, needle):
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(action)
    assert any(needle in m["content"] for m in obs), (label, obs)
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert info["step_tool_errors"] >= 1
    if label == "hanging tool":
        assert info["tool_timeouts"] == 1
    # The same episode goes on and can still be solved.
    obs, *_ = env.step(tool_call("python", code="print(6*7)"))
    assert obs[0]["content"] == "42"
    _, reward, terminated, _, _ = env.step(tool_call("submit", answer="42"))
    assert terminated and reward == 1.0


def test_turn_limit_truncates_and_still_verifies():
    env = make_env(max_turns=2)
    try:
        env.reset(seed=0)
        assert env.step(tool_call("python", code="print(1)"))[3] is False
        obs, reward, terminated, truncated, info = env.step(tool_call("python", code="print(2)"))
        assert (terminated, truncated, info["finish_reason"]) == (False, True, "max_turns")
        assert reward == 0.0 and "nothing submitted" in info["verdict"].details
    finally:
        env.close()


def test_sandbox_dying_mid_episode_ends_it_with_env_error(env):
    env.reset(seed=0)
    docker.from_env().containers.get(env.sandbox.id).remove(force=True)
    obs, reward, terminated, truncated, info = env.step(tool_call("bash", command="echo hi"))
    assert truncated and not terminated and reward == 0.0
    assert info["finish_reason"] == "env_error" and "sandbox died" in info["error"]
    # The env is usable again after reset.
    env.reset(seed=0)
    assert env.step(tool_call("python", code="print(6*7)"))[0][0]["content"] == "42"


def test_close_is_idempotent_reset_after_close_and_with_statement():
    with make_env() as env:
        env.reset(seed=0)
        sid = env.sandbox.id
        env.close()
        env.close()
        assert env.sandbox is None
        env.reset(seed=0)
        assert env.sandbox.id != sid
    assert env.sandbox is None


def test_a_used_sandbox_is_never_reused(env):
    env.reset(seed=0)
    env.step(tool_call("bash", command="echo secret > leftover.txt"))
    first = env.sandbox.id
    env.reset(seed=0)
    assert env.sandbox.id != first
    obs, *_ = env.step(tool_call("bash", command="ls leftover.txt"))
    assert "No such file" in obs[0]["content"]


def test_tools_outside_the_prompt_for_template_rendering():
    env = make_env(tools_in_prompt=False, backend="local", use_pool=False)
    try:
        obs, info = env.reset(seed=0)
        assert "<tools>" not in obs[0]["content"]
        assert info["tools"][0]["function"]["name"] == "bash"
    finally:
        env.close()


def test_check_env_passes_on_a_custom_env(env):
    agentrl.check_env(env)
