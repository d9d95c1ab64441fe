"""Environments whose tool or verifier hangs: host-side Python no command timeout covers.

Imported by id from the command line (`tests.hanging_envs:test/HangingTool-v0`): the module
registers on import. Their deadlines are short so that the checks that meet them end quickly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import agentrl
from agentrl.core.task import Task
from agentrl.env.tools import ToolContext, tool
from agentrl.verifiers import Verdict

TOOL_DEADLINE_S = 1.0
VERIFIER_DEADLINE_S = 1.0


@tool
def hang(ctx: ToolContext, seconds: float = 3600.0) -> str:
    """Sleep on the host, an hour by default.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "awake"


@dataclass
class HangingVerifier:
    """Sleeps an hour in `verify`."""

    name: str = "hanging"

    def verify(self, sandbox, task, episode) -> Verdict:
        time.sleep(3600)
        return Verdict(1.0, True)


# The oracle calls the hanging tool before it submits (AnswerOracle's `oracle_calls`).
TASKS = [
    Task(
        id=f"hang/{i}",
        prompt="Call hang, then submit 1.",
        answer="1",
        metadata={"oracle_calls": [{"name": "hang", "arguments": {}}]},
    )
    for i in range(3)
]

agentrl.register(
    "test/HangingTool-v0",
    "agentrl:ToolEnv",
    tasks=TASKS,
    tools=[hang, "submit"],
    oracle=agentrl.AnswerOracle,
    max_turns=3,
    tool_timeout_s=TOOL_DEADLINE_S,
)
agentrl.register(
    "test/HangingVerifier-v0",
    "agentrl:ToolEnv",
    tasks=[Task(id="v/0", prompt="Submit 1.", answer="1")],
    tools=["submit"],
    verifier=HangingVerifier(),
    oracle=agentrl.AnswerOracle,
    max_turns=2,
    verifier_timeout_s=VERIFIER_DEADLINE_S,
)
