"""`agentrl/sqlite-mcp-v0`: sqlite-v0's shop database, its tools from the reference MCP server `mcp-server-sqlite`.

The environment has no tool of its own but `submit`: `read_query`, `write_query`, `list_tables` and
`describe_table` are what the server lists, with its schemas and its answers, the server started inside
each episode's sandbox on the episode's database (`/workspace/shop.db`) and stopped with it. Tasks,
verifier and database are sqlite-v0's; the sandbox image is the one with the MCP servers installed
(`agentrl.env.mcp.images`, built by `agentrl sandbox build`).
"""

from __future__ import annotations

import ast
import functools
from typing import Any

from pydantic import Field

from agentrl.core.task import Task
from agentrl.core.types import Message
from agentrl.env.agents import ScriptedOracle, last_tool_output
from agentrl.env.mcp.server import MCPServer
from agentrl.env.settings import ToolEnvSettings
from agentrl.env.tool_env import ToolEnv
from agentrl.envs.sqlite import DB, SqliteTaskGenerator
from agentrl.sandbox.base import DEFAULT_WORKDIR

SERVER = MCPServer(
    command=["mcp-server-sqlite", "--db-path", f"{DEFAULT_WORKDIR}/{DB}"],
    name="sqlite",
    # append_insight and create_table serve a chat client's memo and schema work, nothing a task asks for.
    tools=["read_query", "write_query", "list_tables", "describe_table"],
)


def first_value(output: str) -> str:
    """The first value of the first row of a `read_query` answer (the server prints a list of row dicts)."""
    try:
        rows = ast.literal_eval(output.strip())
        return str(next(iter(rows[0].values())))
    except (ValueError, SyntaxError, IndexError, StopIteration, AttributeError, TypeError):
        return output.strip()


class SqliteMCPOracle(ScriptedOracle):
    """Runs the task's reference SQL through the server's `read_query` (`write_query` for a change), then submits."""

    def act(self, observation: list[Message]) -> str:
        meta = self.task.metadata
        if observation[-1]["role"] != "tool":
            return self.call("write_query" if meta["mutates"] else "read_query", query=meta["solution_sql"])
        return self.call(
            "submit", answer="done" if meta["mutates"] else first_value(last_tool_output(observation))
        )


class SqliteMCPSettings(ToolEnvSettings):
    """sqlite-mcp-v0's settings: ToolEnv's, with its own tools, server, verifier and turn limit."""

    tools: list[Any] | None = Field(
        default_factory=lambda: ["submit"],
        description="The env's own tools beside the MCP server's (built-in names or @agentrl.tool functions).",
    )
    mcp_servers: list[Any] = Field(
        default_factory=lambda: [SERVER],
        description="The MCP servers whose tools the agent gets: mcp-server-sqlite on the episode's database.",
    )
    verifier: Any = Field(
        "auto",
        description="How an episode is scored: auto checks a query task's answer and a change task's database "
        "state; or a verifier's name, (name, kwargs), or a Verifier.",
    )
    max_turns: int = Field(8, ge=1, description="Most assistant messages per episode.")


@functools.cache
def _mcp_image(_task_image: str) -> str:
    """The MCP servers image, built once when this Docker engine lacks it (bwrap exports it from there too;
    without Docker the tag is handed on as it is, for a root file system given by AGENTRL_BWRAP_ROOTFS)."""
    from agentrl.env.mcp.images import IMAGE, ensure_image

    try:
        import docker

        client = docker.from_env()
        client.ping()
    except Exception:
        return IMAGE
    return ensure_image(client)


class SqliteMCPEnv(ToolEnv):
    settings_model = SqliteMCPSettings
    task_generator = SqliteTaskGenerator
    sandbox_image = staticmethod(_mcp_image)
    instructions = (
        "You are a database assistant. Inspect and query the SQLite database with the database tools, "
        "then call submit."
    )

    def oracle(self, task: Task) -> SqliteMCPOracle:
        return SqliteMCPOracle(task, self.parser)
