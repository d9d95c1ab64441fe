"""Harbor task directories (Terminal-Bench's format) as an environment, and our tasks written as them.

- `agentrl/harbor-v0` (`HarborEnv`): `agentrl.make("agentrl/harbor-v0", path=DIR)`, or
  `register_task_set(DIR, id=...)` for an id of their own;
- `agentrl.envs.harbor.tasks`: reading task.toml, instruction.md, environment/, tests/, solution/;
- `agentrl.envs.harbor.export`: `agentrl tasks export`, python-repair (and any env with hidden
  tests) as Harbor directories and SWE-bench-style JSONL.
"""

from agentrl.envs.harbor.env import HarborEnv, SolveScriptOracle, register_task_set
from agentrl.envs.harbor.tasks import EXAMPLES_DIR, find_task_dirs, load_task, load_tasks

__all__ = [
    "EXAMPLES_DIR",
    "HarborEnv",
    "SolveScriptOracle",
    "find_task_dirs",
    "load_task",
    "load_tasks",
    "register_task_set",
]
