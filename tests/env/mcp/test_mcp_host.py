"""Tools from a real MCP server (the reference `mcp-server-time`, from PyPI) run on the host: no sandbox.

Each test checks one property: the schemas are the server's, a call reaches it and its answer is the
observation, arguments are checked against the server's schema, a server that dies or hangs ends the
episode with the reason, one that will not start fails the reset with its own words, the server dies
with the episode, and names are validated. The sandbox cases (docker, bwrap) are in test_mcp_sandbox.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

import pytest

import agentrl
from agentrl.env.agents import tool_call
from agentrl.env.mcp import MCPServer, client
from agentrl.env.settings import EnvSettingsError
from agentrl.env.tool_env import EnvError, ToolEnv
from tests import fixtures_model

tiny_model_dir = fixtures_model.tiny_model_dir

TIME = [sys.executable, "-m", "mcp_server_time", "--local-timezone", "Etc/UTC"]
TASK = {"id": "time/0", "prompt": "What time is it in Tokyo?", "answer": "x"}


def make_env(**kw) -> ToolEnv:
    kw.setdefault("mcp_servers", [MCPServer(command=TIME, where="host", name="time")])
    kw.setdefault("exec_timeout_s", 5.0)
    return ToolEnv(tasks=[TASK], tools=["submit"], backend="local", **kw)


def server_process(env: ToolEnv):
    (conn,) = env._mcp.connections
    return conn._bridge.stream.proc


def test_schemas_are_the_servers_calls_return_its_answers_and_arguments_meet_its_schema():
    with make_env() as env:
        obs, info = env.reset(seed=0)
        names = [s["function"]["name"] for s in info["tools"]]
        assert names == ["submit", "get_current_time", "convert_time"]
        schema = next(s for s in info["tools"] if s["function"]["name"] == "get_current_time")["function"]
        assert schema["parameters"]["required"] == ["timezone"] and "IANA" in str(schema)
        assert "get_current_time" in obs[0]["content"]  # the system prompt advertises them
        obs, *_ = env.step(tool_call("get_current_time", timezone="Asia/Tokyo"))
        assert '"timezone": "Asia/Tokyo"' in obs[0]["content"] and "+09:00" in obs[0]["content"]
        assert env.episode.calls_ran("get_current_time") == 1 and env.episode.tool_errors == 0
        # Checked against the server's schema before anything is sent: refused, not run.
        obs, *_ = env.step(tool_call("get_current_time", zone="Asia/Tokyo"))
        assert "bad arguments for tool 'get_current_time'" in obs[0]["content"]
        assert "'timezone' is a required property" in obs[0]["content"]
        assert env.episode.calls[-1].status == "invalid_arguments"
        # The server's own error answer (isError) is a tool error the model reads.
        obs, *_ = env.step(
            tool_call("convert_time", source_timezone="Nowhere/X", time="12:00", target_timezone="UTC")
        )
        assert "Invalid timezone" in obs[0]["content"]
        assert env.episode.calls[-1].status == "ran" and env.episode.calls[-1].is_error
        # The server dies with the episode: it exits when its stdin closes.
        proc = server_process(env)
        *_, terminated, _, _ = env.step(tool_call("submit", answer="x"))
        assert terminated and proc.wait(10) is not None


def test_a_server_that_dies_ends_the_episode_with_the_reason():
    with make_env() as env:
        env.reset(seed=0)
        proc = server_process(env)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        obs, reward, terminated, truncated, info = env.step(tool_call("get_current_time", timezone="UTC"))
        assert truncated and not terminated and reward == 0.0
        assert info["finish_reason"] == "env_error"
        assert info["error"].startswith("MCP server 'time' exited"), info["error"]
        assert "the episode ends" in obs[0]["content"]


def test_a_server_that_hangs_ends_the_episode_after_the_deadline_and_a_ping(monkeypatch):
    monkeypatch.setattr(client, "PING_GRACE_S", 1.0)
    with make_env(exec_timeout_s=1.0) as env:
        env.reset(seed=0)
        proc = server_process(env)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            *_, truncated, info = env.step(tool_call("get_current_time", timezone="UTC"))
            took = time.monotonic() - t0
        finally:
            with contextlib.suppress(ProcessLookupError):  # the episode's end killed it already
                os.kill(proc.pid, signal.SIGCONT)
        assert truncated and info["finish_reason"] == "env_error"
        assert "stopped answering" in info["error"] and "1s deadline" in info["error"], info["error"]
        assert 1.0 <= took < 10.0


def test_a_server_that_will_not_start_fails_the_reset_with_its_words():
    bad = MCPServer(command=[*TIME[:3], "--local-timezone", "Not/AZone"], where="host", name="time")
    with make_env(mcp_servers=[bad]) as env, pytest.raises(EnvError) as err:
        env.reset(seed=0)
    assert "MCP server 'time' did not start" in str(err.value)
    assert "invalid --local-timezone 'Not/AZone'" in str(err.value)


@pytest.mark.slow  # four server starts
def test_tool_names_clash_is_an_error_naming_the_fix_and_prefix_resolves_it():
    twice = [MCPServer(command=TIME, where="host"), MCPServer(command=TIME, where="host")]
    with make_env(mcp_servers=twice) as env, pytest.raises(EnvError, match="prefix"):
        env.reset(seed=0)
    twice[1] = MCPServer(command=TIME, where="host", prefix="b_", tools=["convert_time"])
    with make_env(mcp_servers=twice) as env:
        _, info = env.reset(seed=0)
        assert [s["function"]["name"] for s in info["tools"]][-1] == "b_convert_time"
        obs, *_ = env.step(
            tool_call("b_convert_time", source_timezone="UTC", time="12:00", target_timezone="Asia/Tokyo")
        )
        assert "21:00" in obs[0]["content"]


def test_server_settings_are_validated_in_one_line():
    with pytest.raises(EnvSettingsError, match="one of command= .* and url="):
        make_env(mcp_servers=[{"command": ["x"], "url": "http://127.0.0.1:1/mcp"}])
    only = [MCPServer(command=TIME, where="host", tools=["nope"])]
    with make_env(mcp_servers=only) as env, pytest.raises(EnvError, match="lists no tool"):
        env.reset(seed=0)
    env = make_env(mcp_servers=["http://127.0.0.1:9/mcp"])
    assert env.settings.mcp_servers[0].url == "http://127.0.0.1:9/mcp" and not env.needs_sandbox
    assert agentrl.MCPServer is MCPServer


def test_a_harness_agent_gets_the_servers_tools_through_the_gateway(tiny_model_dir):
    """An OpenAI-API agent (the gateway's tool-loop agent) sees the server's tools in `tools=` and calls
    them like any other; the environment runs the calls against the server."""
    from transformers import AutoTokenizer

    from agentrl.gateway.harness import HarnessEnv, tool_loop_agent
    from agentrl.rollout.config import RolloutConfig
    from agentrl.rollout.loop import collect_sync
    from tests.gateway.scripted import ToolCallPolicy

    seen: list[list[str]] = []

    async def agent(client, task):
        seen.append([t["function"]["name"] for t in task.tools])
        await tool_loop_agent(client, task)

    def write(prompt: str, n: int) -> str:
        if n % 2 == 0:
            return tool_call("get_current_time", timezone="Asia/Tokyo")
        return tool_call("submit", answer="+09:00" if "+09:00" in prompt else "none")

    policy = ToolCallPolicy(AutoTokenizer.from_pretrained(tiny_model_dir), write)
    env = lambda: HarnessEnv(make_env(verifier=("regex", {"pattern": r"\+09:00"})), agent)  # noqa: E731
    (traj,) = collect_sync(env, [0], policy, RolloutConfig(group_size=1, max_tokens_per_turn=64), seed=0)
    assert seen == [["submit", "get_current_time", "convert_time"]]
    assert traj.finish_reason == "submitted" and traj.reward == 1.0 and traj.tool_calls == 2


def test_a_url_server_over_streamable_http():
    """The URL path (the SDK's Streamable HTTP client). The reference servers speak stdio only, so the
    server here is the SDK's own `MCPServer` with one tool, served by uvicorn on the loopback."""
    import socket
    import threading

    import uvicorn
    from mcp.server.mcpserver import MCPServer as SDKServer

    sdk = SDKServer("adder")

    @sdk.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(sdk.streamable_http_app(), host="127.0.0.1", port=port, log_level="error")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        with make_env(mcp_servers=[f"http://127.0.0.1:{port}/mcp"]) as env:
            _, info = env.reset(seed=0)
            assert [s["function"]["name"] for s in info["tools"]] == ["submit", "add"]
            obs, *_ = env.step(tool_call("add", a=2, b=3))
            assert obs[0]["content"].strip() == "5"
    finally:
        server.should_exit = True
        thread.join(10)
