"""The env stage: what an episode is made of.

Modules: `tool_env` (`ToolEnv`, the Gymnasium environment of tool calls in a sandbox), `settings` (its
typed settings), `step_limits` (the limits of one step, composed), `protocols` (the env contract:
`AgentEnv`, `OracleEnv`, `Agent`), `registry` (env ids, `make`, plugins), `agents` (scripted agents and
oracles), `tools` (`@tool`, `Tool`), `parsers` (tool-call formats), `tasksource` (task supplies),
`spaces` (Gymnasium spaces), `mcp` (tools from MCP servers). Built-in environments are `agentrl.envs`.

`from agentrl.env import ToolEnv` works as before (loaded on first use, so importing one module of this
stage does not import them all).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_FROM_TOOL_ENV = ("ToolEnv", "EnvError", "TOOL_DEADLINE_MARGIN_S")

__all__ = list(_FROM_TOOL_ENV)


def __getattr__(name: str) -> Any:
    if name in _FROM_TOOL_ENV:
        return getattr(importlib.import_module("agentrl.env.tool_env"), name)
    raise AttributeError(f"module 'agentrl.env' has no attribute {name!r}")


if TYPE_CHECKING:
    from agentrl.env.tool_env import TOOL_DEADLINE_MARGIN_S, EnvError, ToolEnv  # noqa: F401
