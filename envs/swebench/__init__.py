"""SWE-bench-style instances (JSONL rows or a datasets split) as an environment on the hidden-test verifier."""

from agentrl.envs.swebench.env import GitApplyOracle, SweBenchEnv, make_hidden_tests, register_instances
from agentrl.envs.swebench.instances import instance_task, read_rows

__all__ = [
    "GitApplyOracle",
    "SweBenchEnv",
    "instance_task",
    "make_hidden_tests",
    "read_rows",
    "register_instances",
]
