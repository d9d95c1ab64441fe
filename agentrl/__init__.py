"""agentrl: agentic multi-turn RL environments, verifiers, rollouts, GRPO training and pass@k evaluation.

`import agentrl` stays cheap (no torch, no docker SDK); the public names below are loaded on
first use. It does register the built-in environment ids, with agentrl and with Gymnasium, so
`gymnasium.make("agentrl/calc-v0")` works after it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY: dict[str, str] = {
    "register": "agentrl.env.registry",
    "load_plugins": "agentrl.env.registry",
    "make": "agentrl.env.registry",
    "task_source": "agentrl.env.registry",
    "get_task": "agentrl.env.registry",
    "spec": "agentrl.env.registry",
    "EnvSpec": "agentrl.env.registry",
    "registry": "agentrl.env.registry",
    "ToolEnv": "agentrl.env.tool_env",
    "EnvError": "agentrl.env.tool_env",
    "Task": "agentrl.core.task",
    "load_tasks": "agentrl.core.task",
    "TaskPool": "agentrl.env.tasksource",
    "TaskSource": "agentrl.env.tasksource",
    "UserError": "agentrl.core.errors",
    "save_tasks": "agentrl.core.task",
    "tool": "agentrl.env.tools",
    "Tool": "agentrl.env.tools",
    "ToolContext": "agentrl.env.tools",
    "ToolError": "agentrl.env.tools",
    "MCPServer": "agentrl.env.mcp",
    "check_env": "agentrl.checks.env_check",
    "check_verifier": "agentrl.checks.verifier_check",
    "filter_tasks": "agentrl.checks.verifier_check",
    "VerifierCheck": "agentrl.checks.verifier_check",
    "Episode": "agentrl.core.episode",
    "run_episode": "agentrl.env.agents",
    "tool_call": "agentrl.env.agents",
    "last_tool_output": "agentrl.env.agents",
    "Agent": "agentrl.env.protocols",
    "AgentEnv": "agentrl.env.protocols",
    "OracleEnv": "agentrl.env.protocols",
    "Message": "agentrl.core.types",
    "StepInfo": "agentrl.core.types",
    "AnswerOracle": "agentrl.env.agents",
    "open_sandbox": "agentrl.sandbox",
    "Limits": "agentrl.sandbox",
}


# The same names for type checkers; at run time `__getattr__` below loads each on first use.
if TYPE_CHECKING:
    from agentrl.checks.env_check import check_env
    from agentrl.checks.verifier_check import VerifierCheck, check_verifier, filter_tasks
    from agentrl.core.episode import Episode
    from agentrl.core.errors import UserError
    from agentrl.core.task import Task, load_tasks, save_tasks
    from agentrl.core.types import Message, StepInfo
    from agentrl.env.agents import AnswerOracle, last_tool_output, run_episode, tool_call
    from agentrl.env.mcp import MCPServer
    from agentrl.env.protocols import Agent, AgentEnv, OracleEnv
    from agentrl.env.registry import (
        EnvSpec,
        get_task,
        load_plugins,
        make,
        register,
        registry,
        spec,
        task_source,
    )
    from agentrl.env.tasksource import TaskPool, TaskSource
    from agentrl.env.tool_env import EnvError, ToolEnv
    from agentrl.env.tools import Tool, ToolContext, ToolError, tool
    from agentrl.sandbox import Limits, open_sandbox

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

# Module paths that moved (CHANGELOG.md, "Moved"): importing one fails with the path it has now, in one
# line, instead of a bare "No module named". Only the new paths import: there is one way to each module.
MOVED_MODULES: dict[str, str] = {
    "agentrl.env_settings": "agentrl.env.settings",
    **{
        f"agentrl.{m}": f"agentrl.env.{m}"
        for m in ("step_limits", "protocols", "registry", "agents", "tools")
    },
    **{f"agentrl.{m}": f"agentrl.env.{m}" for m in ("parsers", "tasksource", "spaces", "mcp")},
    **{
        f"agentrl.{m}": f"agentrl.core.{m}"
        for m in ("types", "errors", "task", "episode", "runlog", "deadline")
    },
    "agentrl.plugins": "agentrl.core.plugins",
    "agentrl.cluster": "agentrl.rollout.cluster",
    # moved before
    **{
        f"agentrl.{m}": f"agentrl.rollout.{m}"
        for m in ("policy", "masker", "trajectory", "placement", "weight_sync")
    },
    **{
        f"agentrl.{m}": f"agentrl.train.{m}"
        for m in ("grpo", "batch", "packing", "varlen", "logprobs", "curriculum")
    },
    **{
        f"agentrl.{m}": f"agentrl.train.{m}"
        for m in ("distributed", "checkpoint", "tracking", "peak_memory", "sft")
    },
    "agentrl.train_config": "agentrl.train.config",
    **{f"agentrl.{m}": f"agentrl.eval.{m}" for m in ("evaluate", "passk", "report")},
    "agentrl.model_kit": "agentrl.kit.tiny_model",
    "agentrl.tokenizer_kit": "agentrl.kit.tokenizer",
    "agentrl.demos": "agentrl.kit.demonstrations",
    "agentrl.demo": "agentrl.kit.demo",
    "agentrl.warm_start": "agentrl.kit.warm_start",
    "agentrl.checker": "agentrl.checks.env_check",
    **{f"agentrl.{m}": f"agentrl.checks.{m}" for m in ("env_check", "verifier_check", "audit", "attacks")},
    "agentrl.attacks_harness": "agentrl.checks.attacks_harness",
    "agentrl.cli_options": "agentrl.cli.options",
}


class _MovedModules(importlib.abc.MetaPathFinder):
    """Says where a moved module is now when its old path is imported."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        # (a module under a moved package comes here as its package: Python imports the parent first)
        if fullname in MOVED_MODULES:
            raise ModuleNotFoundError(
                f"No module named '{fullname}': it moved to {MOVED_MODULES[fullname]}; import it from there",
                name=fullname,
            )
        return None


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())  # before the path finder, which would find nothing

# Built-in ids into agentrl's registry and Gymnasium's (the registry module is light: no torch).
importlib.import_module("agentrl.env.registry")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'agentrl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
