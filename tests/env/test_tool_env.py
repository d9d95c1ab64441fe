"""ToolEnv keeps the Gymnasium contract and turns everything the model writes into observations."""

from __future__ import annotations

import json
import threading
import time
import tracemalloc

import docker
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import agentrl
from agentrl.core.task import Task
from agentrl.env.agents import tool_call
from agentrl.env.parsers import ToolCallFormat
from agentrl.env.tool_env import ToolEnv
from agentrl.env.tools import MAX_OBSERVATION_CHARS, ToolContext, tool
from agentrl.sandbox import pool as pool_module

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


def json_quote_raw(text: str) -> str:
    """A JSON string literal of `text` that keeps lone surrogates as they are (json.dumps escapes them)."""
    return json.dumps(text, ensure_ascii=False)


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


def test_file_tools_take_the_argument_names_other_harnesses_use(env):
    """SWE-agent's, OpenHands' and Anthropic's editors name them file_path, file_text, old_str, new_str."""
    env.reset(seed=0)
    env.step(tool_call("write_file", file_path="b.py", file_text="y = 1\n"))
    obs, *_ = env.step(tool_call("str_replace", file_path="b.py", old_str="y = 1", new_str="y = 2"))
    assert obs[0]["content"] == "Replaced 1 occurrence in b.py."
    obs, *_ = env.step(tool_call("read_file", file_path="b.py"))
    assert obs[0]["content"] == "y = 2\n"
    # The schema the model reads names each parameter once; both names in one call are refused.
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in env.toolbox.schemas}
    assert set(schema["str_replace"]["properties"]) == {"path", "old", "new"}
    obs, *_ = env.step(tool_call("str_replace", path="b.py", old="y = 2", old_str="y = 2", new="y = 3"))
    assert "bad arguments for tool 'str_replace'" in obs[0]["content"] and "old_str" in obs[0]["content"]


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
        ("hanging tool", tool_call("bash", command="sleep 1000"), "timed out after 5s"),
    ],
)
def test_garbage_actions_are_error_observations_and_the_env_stays_usable(env, label, action, needle):
    if label == "hanging tool":
        # The call after the hang runs under the same deadline: 2 s is too little for it on a loaded box.
        own = make_env(exec_timeout_s=5.0)
        try:
            _garbage_then_solve(own, label, action, needle)
        finally:
            own.close()
    else:
        _garbage_then_solve(env, label, action, needle)


def _garbage_then_solve(env, label, action, needle):
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


def test_a_used_sandbox_carries_nothing_into_the_next_episode(env):
    # The pool may hand out a fresh container or, once reset from the host, this same one (which
    # of the two comes first is a race): neither may keep the episode's files or processes.
    env.reset(seed=0)
    env.step(tool_call("bash", command="echo secret > leftover.txt; (sleep 600 &) ; echo started"))
    env.reset(seed=0)
    obs, *_ = env.step(tool_call("bash", command="ls leftover.txt"))
    assert "No such file" in obs[0]["content"]
    obs, *_ = env.step(tool_call("bash", command="ps -eo args | grep -c '^sleep 600' || true"))
    assert obs[0]["content"].strip() == "0"


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


# --- adversarial tool calls: each through env.step, never an exception ------------------

BACKENDS = [pytest.param("docker", id="docker"), pytest.param("bwrap", id="bwrap")]


@pytest.fixture(params=BACKENDS)
def any_env(request):
    if request.param == "bwrap":
        request.getfixturevalue("bwrap_path")
    e = make_env(backend=request.param, use_pool=request.param == "docker")
    yield e
    e.close()


def step_traced(env, action: str):
    """`env.step(action)` and the peak of Python memory allocated during it, in bytes.

    tracemalloc counts every thread's allocations: the pool's background starts and resets (each
    a docker exec with 256 KiB read buffers) are waited out first, or they land in the step's peak."""
    wait_for_quiet_pool()
    tracemalloc.start()
    try:
        out = env.step(action)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return out, peak


def wait_for_quiet_pool(timeout_s: float = 60.0) -> None:
    if pool_module._default_pool is None:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = pool_module._default_pool.stats()
        if stats.starting == stats.resetting == stats.closing == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"the sandbox pool was still busy after {timeout_s:.0f} s: {stats}")


@pytest.mark.parametrize("path", ["/dev/zero", "/dev/urandom", "zero-link", "fifo"])
def test_read_file_of_a_device_or_fifo_is_refused_with_bounded_memory(any_env, path):
    any_env.reset(seed=0)
    any_env.step(tool_call("bash", command="ln -s /dev/zero zero-link; mkfifo fifo"))
    (obs, reward, terminated, truncated, info), peak = step_traced(any_env, tool_call("read_file", path=path))
    assert "is not a regular file" in obs[0]["content"], obs
    assert (terminated, truncated, info["step_tool_errors"]) == (False, False, 1)
    assert peak < 1 << 20  # nothing was read: well under a MiB of Python memory for the whole step


def test_read_file_of_a_huge_file_is_capped(any_env):
    any_env.reset(seed=0)
    any_env.step(tool_call("bash", command="head -c 50000000 /dev/zero | tr '\\0' 'a' > big.txt"))
    (obs, *_), peak = step_traced(any_env, tool_call("read_file", path="big.txt"))
    content = obs[0]["content"]
    assert content.startswith("aaaa") and "is larger than 1048576 bytes; this is its start" in content
    assert len(content) < MAX_OBSERVATION_CHARS + 300
    assert peak < 8 << 20  # read at most 1 MiB + 1 byte of a 50 MB file


def test_deeply_nested_tool_call_is_an_error_observation(env):
    env.reset(seed=0)
    action = (
        '<tool_call>{"name": "python", "arguments": {"code": ' + "[" * 1000 + "]" * 1000 + "}}</tool_call>"
    )
    obs, reward, terminated, truncated, info = env.step(action)
    assert "nests more than 32 levels deep" in obs[0]["content"]
    assert info["format_errors"] == 1 and not (terminated or truncated)
    assert env.step(tool_call("python", code="print(6*7)"))[0][0]["content"] == "42"


def test_tool_calls_past_the_per_step_limit_are_not_run(env):
    env.reset(seed=0)
    assert env.max_tool_calls_per_step == 4
    action = "".join(tool_call("bash", command=f"echo {i} >> log") for i in range(8))
    obs, reward, terminated, truncated, info = env.step(action)
    assert info["step_tool_calls"] == 4 and info["step_tool_calls_not_run"] == 4
    assert "4 tool call(s) of your message were not run" in obs[-1]["content"]
    assert "at most 4 tool call(s) run per message" in obs[-1]["content"]
    assert env.step(tool_call("bash", command="cat log"))[0][0]["content"] == "0\n1\n2\n3"


def test_a_step_is_bounded_in_time_across_its_calls():
    env = make_env(exec_timeout_s=20.0, step_timeout_s=3.0)
    try:
        env.reset(seed=0)
        action = "".join(tool_call("bash", command="sleep 2") for _ in range(3))
        obs, reward, terminated, truncated, info = env.step(action)
        # The first sleeps 2 s; the second gets the second or so left and times out; the third never runs.
        assert obs[0]["content"] == "[no output]"
        assert obs[1]["content"].startswith("[timed out after 0.")
        assert info["step_tool_calls"] == 2 and info["step_tool_timeouts"] == 1
        assert "used up its time budget of 3s" in obs[-1]["content"]
    finally:
        env.close()


def test_docker_kill_mid_command_ends_the_episode(env):
    env.reset(seed=0)
    threading.Timer(1.0, docker.from_env().api.kill, args=(env.sandbox.id,)).start()
    obs, reward, terminated, truncated, info = env.step(tool_call("bash", command="sleep 30"))
    assert truncated and not terminated and info["finish_reason"] == "env_error"
    assert "killed or stopped from outside" in info["error"]
    assert "[exit code" not in obs[0]["content"]


def test_a_frozen_engine_ends_the_episode_with_a_reason_a_person_understands(private_engine, monkeypatch):
    from agentrl.sandbox import reaper
    from agentrl.sandbox.engine import engine

    monkeypatch.setenv("DOCKER_HOST", private_engine.address)
    monkeypatch.setenv("AGENTRL_DOCKER_TIMEOUT_S", "2")
    engine().check_health()
    env = make_env(use_pool=False)
    try:
        env.reset(seed=0)
        with private_engine.frozen():
            obs, reward, terminated, truncated, info = env.step(tool_call("bash", command="echo hi"))
        assert truncated and info["finish_reason"] == "env_error" and reward == 0.0
        assert "the Docker engine stopped answering: restart it" in info["error"]
        assert "ReadTimeout" not in info["error"] and "urllib3" not in info["error"]
        assert "engine stopped answering" in obs[0]["content"]
    finally:
        env.close()
        engine().check_health()
        reaper.retry_deferred()
    # Closed while the engine was frozen: its container was owed a removal, and got it.
    assert private_engine.containers(f"agentrl.run_id={reaper.run_id()}") == []


@tool(needs_sandbox=False)
def add(ctx: ToolContext, a: int, b: float) -> str:
    """Add two numbers.

    Args:
        a: An integer.
        b: A float.
    """
    return str(a + b)


@tool(needs_sandbox=False)
def echo(ctx: ToolContext, text: str) -> str:
    """Say it back.

    Args:
        text: Anything.
    """
    return text[:100]


# Raw JSON text, not Python values: what a model may write, valid or not.
ADVERSARIAL_JSON = st.one_of(
    st.integers(min_value=0, max_value=3000).map(lambda d: "[" * d + "]" * d),
    st.integers(min_value=0, max_value=3000).map(lambda d: '{"a":' * d + "1" + "}" * d),
    st.integers(min_value=1, max_value=20000).map(lambda n: "9" * n),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e400", "1e-999", "0.1e309"]),
    st.sampled_from(['"\\ud800"', '"\\udfff\\ud800"', '"\\ud83d\\ude00"', '"\\u0000"', '"\\x"', '"\\']),
    st.integers(min_value=0, max_value=60000).map(lambda n: '"' + "x" * n + '"'),
    # Any text, lone surrogates included (hypothesis' own text never holds them), as a JSON string.
    st.lists(st.one_of(st.characters(), st.integers(0xD800, 0xDFFF).map(chr)), max_size=50)
    .map("".join)
    .map(json_quote_raw),
    st.text(max_size=30),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    parser=st.sampled_from(["hermes", "llama3-json"]),
    name=st.one_of(st.sampled_from(['"add"', '"echo"', '"submit"']), ADVERSARIAL_JSON),
    key=st.sampled_from(['"a"', '"b"', '"text"', '"answer"', '"\\ud800"']),
    value=ADVERSARIAL_JSON,
    repeat=st.integers(min_value=1, max_value=6),
)
def test_step_never_raises_on_adversarial_tool_calls(parser, name, key, value, repeat):
    env = ToolEnv(tasks=[TASK], tools=[add, echo, "submit"], verifier="numeric", parser=parser, max_turns=3)
    env.reset(seed=0)
    args_key = "arguments" if parser == "hermes" else "parameters"
    call = f'{{"name": {name}, "{args_key}": {{{key}: {value}, "b": {value}}}}}'
    action = (f"<tool_call>{call}</tool_call>" if parser == "hermes" else call + "; ") * repeat
    obs, reward, terminated, truncated, info = env.step(action)
    assert isinstance(obs, list) and obs and isinstance(reward, float)
    for message in obs:
        message["content"].encode("utf-8")  # every observation is encodable text
    assert info["step_tool_calls"] <= env.max_tool_calls_per_step


class ExplodingParser(ToolCallFormat):
    """A third-party parser with a bug: it raises on some model text."""

    name = "exploding"
    format_hint = "<call>"

    def parse(self, text: str):
        raise RecursionError("maximum recursion depth exceeded")


def test_a_parser_that_raises_is_a_format_error_not_an_exception(monkeypatch):
    from agentrl.env import parsers

    monkeypatch.setitem(parsers.PARSERS, "exploding", ExplodingParser)
    env = ToolEnv(tasks=[TASK], tools=[add, "submit"], parser="exploding", max_turns=2)
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("anything")
    assert "could not be parsed (RecursionError)" in obs[0]["content"]
    assert info["format_errors"] == 1 and not terminated and not truncated
