"""The reference `mcp-server-sqlite` (from PyPI, installed in the image at build time) inside the episode's
sandbox, on docker and on bubblewrap: its tools act on the sandbox's files, the oracle of
`agentrl/sqlite-mcp-v0` scores 1 through it, and a server that hangs, dies or will not start ends its
episode (or its reset) with the reason. The sandbox has no network: nothing is fetched here."""

from __future__ import annotations

import pytest

import agentrl
from agentrl.env.agents import run_episode, tool_call
from agentrl.env.mcp import MCPServer
from agentrl.env.mcp.images import IMAGE
from agentrl.env.tool_env import EnvError, ToolEnv

BACKENDS = [
    pytest.param("docker", marks=pytest.mark.docker, id="docker"),
    pytest.param("bwrap", marks=pytest.mark.docker, id="bwrap"),  # its rootfs is exported from the image
]
SERVER = MCPServer(command=["mcp-server-sqlite", "--db-path", "/workspace/notes.db"], name="sqlite")
TASK = {"id": "notes/0", "prompt": "Keep notes.", "answer": "x", "image": IMAGE}


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "bwrap":
        request.getfixturevalue("bwrap_path")
    from agentrl.envs.sqlite_mcp import _mcp_image

    _mcp_image("")  # built by `make setup`; here only checked (a build, if ever, happens before the timing)
    return request.param


def test_the_oracle_scores_1_through_the_server_in_the_sandbox(backend):
    env = agentrl.make("agentrl/sqlite-mcp-v0", backend=backend, use_pool=False)
    try:
        for i in (0, 2):  # a question (read_query) and a change (write_query), scored by answer and by state
            task = env.tasks.get(i, "test")
            result = run_episode(env, env.oracle(task), options={"task": task})
            assert result.reward == 1.0, (task.metadata, result.episode.verdict)
            assert {c.name for c in result.episode.calls} <= {"read_query", "write_query", "submit"}
            assert result.episode.calls[0].name in ("read_query", "write_query")
        assert {env.tasks.get(i, "test").metadata["mutates"] for i in (0, 2)} == {False, True}
    finally:
        env.close()


def test_its_tools_act_in_the_sandbox_and_a_hang_ends_the_episode(backend):
    with ToolEnv(
        tasks=[TASK],
        tools=["bash", "submit"],
        mcp_servers=[SERVER],
        backend=backend,
        use_pool=False,
        exec_timeout_s=3,
    ) as env:
        env.reset(seed=0)
        obs, *_ = env.step(tool_call("create_table", query="CREATE TABLE notes (body TEXT)"))
        obs, *_ = env.step(tool_call("write_query", query="INSERT INTO notes VALUES ('from the server')"))
        assert "1" in obs[0]["content"], obs
        obs, *_ = env.step(
            tool_call("bash", command="sqlite3 notes.db 'select body from notes'; stat -c %U notes.db")
        )
        assert obs[0]["content"].split() == [
            "from",
            "the",
            "server",
            "agent",
        ]  # the agent's file, in the workspace
        # A query that never ends blocks the server's event loop: no answer, no ping: the episode ends.
        forever = (
            "SELECT (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c)"
        )
        obs, reward, terminated, truncated, info = env.step(tool_call("read_query", query=forever))
        assert truncated and info["finish_reason"] == "env_error" and reward == 0.0
        assert info["error"].startswith("MCP server 'sqlite' stopped answering: tools/call read_query"), info[
            "error"
        ]


@pytest.mark.docker
def test_a_server_killed_from_inside_ends_the_episode_and_one_that_cannot_start_fails_the_reset():
    with ToolEnv(
        tasks=[TASK], tools=["bash", "submit"], mcp_servers=[SERVER], backend="docker", use_pool=False
    ) as env:
        env.reset(seed=0)
        obs, *_ = env.step(
            tool_call("bash", command="pkill -KILL -f '^/usr/bin/python3 /opt/agentrl-mcp/sqlite'")
        )
        *_, truncated, info = env.step(tool_call("list_tables"))
        assert truncated and info["finish_reason"] == "env_error"
        assert info["error"].startswith("MCP server 'sqlite' exited"), info["error"]
    broken = MCPServer(command=["mcp-server-sqlite", "--db-path", "/nonexistent/dir/x.db"], name="sqlite")
    with ToolEnv(
        tasks=[TASK], tools=["submit"], mcp_servers=[broken], backend="docker", use_pool=False
    ) as env:
        with pytest.raises(EnvError, match="MCP server 'sqlite' did not start") as err:
            env.reset(seed=0)
        assert "did not start: exited; its stderr ends:" in str(err.value)
        assert "Read-only file system: '/nonexistent'" in str(err.value), err.value  # its own words
