"""Environments whose task supply is broken, the way a new user's first attempt often is.

Imported by id from the command line (`tests.garbage_envs:test/NoneTasks-v0`): the module
registers on import.
"""

from __future__ import annotations

import agentrl
from agentrl.env.tool_env import ToolEnv


class NoneTasks:
    """A generator whose `generate` forgot its `return`."""

    def generate(self, index: int, split: str = "train"):
        task = {"id": f"n/{index}", "prompt": "Say hi."}  # built, never returned
        del task


class DictTasks:
    """A generator that returns the task's fields instead of a Task."""

    def generate(self, index: int, split: str = "train"):
        return {"id": f"d/{index}", "prompt": "Say hi."}


class NoneEnv(ToolEnv):
    def __init__(self, **kw):
        super().__init__(tasks=NoneTasks(), tools=["submit"], **kw)


class DictEnv(ToolEnv):
    def __init__(self, **kw):
        super().__init__(tasks=DictTasks(), tools=["submit"], **kw)


agentrl.register("test/NoneTasks-v0", "tests.garbage_envs:NoneEnv", max_turns=1)
agentrl.register("test/DictTasks-v0", "tests.garbage_envs:DictEnv", max_turns=1)
# A fixed dataset with no rows: `register(tasks=...)` with ToolEnv itself, no subclass.
agentrl.register("test/Empty-v0", "agentrl:ToolEnv", tasks=[], tools=["submit"], max_turns=1)
