"""`MCPServer`: how an environment names an MCP server whose tools its agent gets.

    MCPServer(command=["mcp-server-sqlite", "--db-path", "/workspace/shop.db"])   # in the episode's sandbox
    MCPServer(command="uvx mcp-server-fetch", where="host")                       # on the host: explicit
    MCPServer(url="http://127.0.0.1:8765/mcp")                                    # a running server (HTTP)

A stdio server (`command`) starts inside each episode's sandbox by default, as the agent's user in the
workspace: its tools act there (a git server on the workspace, a sqlite server on the episode's
database), and it dies with the episode. `where="host"` runs it on the host instead, once per episode,
with the host's files and network: a choice to make knowingly. A `url` server is reached from the host
(the sandbox has no network) and is shared by every episode: it holds no per-episode state of ours.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# An OpenAI/Hermes tool name: what chat templates and the parsers accept.
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class MCPServer(BaseModel):
    """One MCP server an environment takes tools from (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    command: list[str] | None = Field(
        None,
        description="A stdio server: its argv (a string is split on whitespace). Exclusive with url.",
    )
    url: str | None = Field(None, description="A Streamable HTTP server's endpoint. Exclusive with command.")
    where: Literal["sandbox", "host"] = Field(
        "sandbox",
        description="Where a command runs: inside the episode's sandbox (its tools act there), or on the host.",
    )
    name: str | None = Field(
        None,
        description="The server's name in errors and reports. None: the command's program or the URL's host.",
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Environment variables the command starts with."
    )
    cwd: str | None = Field(None, description="The command's directory. None: the sandbox's workspace.")
    tools: list[str] | None = Field(
        None, description="Only these of the server's tools reach the agent (None: all it lists)."
    )
    prefix: str = Field(
        "", description="Put before each tool's name (two servers with a tool of the same name)."
    )
    headers: dict[str, str] = Field(default_factory=dict, description="HTTP headers sent to a url server.")
    startup_timeout_s: float = Field(
        120.0,
        gt=0,
        description="Start, handshake and tool listing, in seconds; past it the episode cannot start.",
    )
    max_message_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description="Longest message read from a stdio server; a longer one ends the episode (the server broke).",
    )

    @field_validator("command", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        return value.split() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_kind(self) -> MCPServer:
        if (self.command is None) == (self.url is None):
            raise ValueError("an MCP server takes one of command= (stdio) and url= (Streamable HTTP)")
        if self.command is not None and not self.command:
            raise ValueError("command= must name a program")
        if self.url is not None and self.where != "sandbox":
            raise ValueError("where= is for a command; a url server is reached from the host already")
        if self.prefix and not _TOOL_NAME.match(self.prefix + "x"):
            raise ValueError(f"prefix {self.prefix!r} must be letters, digits, '_', '.' or '-'")
        return self

    @property
    def label(self) -> str:
        """The server's name as errors say it."""
        if self.name:
            return self.name
        if self.command:
            return self.command[0].rsplit("/", 1)[-1]
        from urllib.parse import urlsplit

        return urlsplit(self.url or "").netloc or str(self.url)

    @property
    def in_sandbox(self) -> bool:
        return self.command is not None and self.where == "sandbox"


def as_servers(value: object) -> list[MCPServer]:
    """The `mcp_servers` setting as a list of `MCPServer`: each one an `MCPServer`, a mapping of its fields,
    a command string or argv list, or a URL string."""
    if value is None:
        return []
    if isinstance(value, MCPServer | dict | str):
        value = [value]
    out = []
    for item in value:  # type: ignore[union-attr]
        if isinstance(item, MCPServer):
            out.append(item)
        elif isinstance(item, dict):
            out.append(MCPServer.model_validate(item))
        elif isinstance(item, str) and re.match(r"^https?://", item):
            out.append(MCPServer(url=item))
        elif isinstance(item, str | list | tuple):
            out.append(MCPServer(command=list(item) if not isinstance(item, str) else item))
        else:
            raise ValueError(f"an MCP server is an MCPServer, a mapping, a command or a URL; got {item!r}")
    return out
