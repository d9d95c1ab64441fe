"""agentrl: agentic multi-turn RL environments, verifiers, rollouts, GRPO training and pass@k evaluation.

`import agentrl` stays cheap (no torch, no docker SDK); the public names below are loaded on
first use. It does register the built-in environment ids, with agentrl and with Gymnasium, so
`gymnasium.make("agentrl/calc-v0")` works after it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY: dict[str, str] = {
    "register": "agentrl.registry",
    "load_plugins": "agentrl.registry",
    "make": "agentrl.registry",
    "task_source": "agentrl.registry",
    "get_task": "agentrl.registry",
    "spec": "agentrl.registry",
    "EnvSpec": "agentrl.registry",
    "registry": "agentrl.registry",
    "ToolEnv": "agentrl.env",
    "EnvError": "agentrl.env",
    "Task": "agentrl.task",
    "load_tasks": "agentrl.task",
    "TaskPool": "agentrl.tasksource",
    "TaskSource": "agentrl.tasksource",
    "UserError": "agentrl.errors",
    "save_tasks": "agentrl.task",
    "tool": "agentrl.tools",
    "Tool": "agentrl.tools",
    "ToolContext": "agentrl.tools",
    "ToolError": "agentrl.tools",
    "MCPServer": "agentrl.mcp",
    "check_env": "agentrl.checks.env_check",
    "check_verifier": "agentrl.checks.verifier_check",
    "filter_tasks": "agentrl.checks.verifier_check",
    "VerifierCheck": "agentrl.checks.verifier_check",
    "Episode": "agentrl.episode",
    "run_episode": "agentrl.agents",
    "tool_call": "agentrl.agents",
    "last_tool_output": "agentrl.agents",
    "Agent": "agentrl.protocols",
    "AgentEnv": "agentrl.protocols",
    "OracleEnv": "agentrl.protocols",
    "Message": "agentrl.types",
    "StepInfo": "agentrl.types",
    "AnswerOracle": "agentrl.agents",
    "open_sandbox": "agentrl.sandbox",
    "Limits": "agentrl.sandbox",
}


# The same names for type checkers; at run time `__getattr__` below loads each on first use.
if TYPE_CHECKING:
    from agentrl.agents import AnswerOracle, last_tool_output, run_episode, tool_call
    from agentrl.checks.env_check import check_env
    from agentrl.checks.verifier_check import VerifierCheck, check_verifier, filter_tasks
    from agentrl.env import EnvError, ToolEnv
    from agentrl.episode import Episode
    from agentrl.errors import UserError
    from agentrl.mcp import MCPServer
    from agentrl.protocols import Agent, AgentEnv, OracleEnv
    from agentrl.registry import EnvSpec, get_task, load_plugins, make, register, registry, spec, task_source
    from agentrl.sandbox import Limits, open_sandbox
    from agentrl.task import Task, load_tasks, save_tasks
    from agentrl.tasksource import TaskPool, TaskSource
    from agentrl.tools import Tool, ToolContext, ToolError, tool
    from agentrl.types import Message, StepInfo

__all__ = [
    "Agent",
    "AgentEnv",
    "AnswerOracle",
    "EnvError",
    "EnvSpec",
    "Episode",
    "Limits",
    "MCPServer",
    "Message",
    "OracleEnv",
    "StepInfo",
    "Task",
    "TaskPool",
    "TaskSource",
    "Tool",
    "ToolContext",
    "ToolEnv",
    "ToolError",
    "UserError",
    "VerifierCheck",
    "check_env",
    "check_verifier",
    "filter_tasks",
    "get_task",
    "last_tool_output",
    "load_plugins",
    "load_tasks",
    "make",
    "open_sandbox",
    "register",
    "registry",
    "run_episode",
    "save_tasks",
    "spec",
    "task_source",
    "tool",
    "tool_call",
]

# Built-in ids into agentrl's registry and Gymnasium's (the registry module is light: no torch).
importlib.import_module("agentrl.registry")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'agentrl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
