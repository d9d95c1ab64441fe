"""`agentrl/python-repair-v0`: fix a bug planted in a real PyPI package, scored by the package's own tests.

Each episode starts a sandbox of the package's image, copies the package (without its tests)
into /workspace with one module replaced by its mutant, and shows the bug report built from
the failing tests. The agent reads, runs and edits code with `bash`, `python`, `read_file`,
`write_file` and `str_replace`, then calls `submit`. The `hidden-tests` verifier then copies
the package's test suite in and requires every FAIL_TO_PASS and PASS_TO_PASS test to pass
(reward 1, else 0).

Tasks come from the synthesizer's cache (`agentrl tasks synth python-repair`); an empty cache
is filled on first use with a small set (`first_use_n`), which takes a minute or two.

The pristine source in the image (/opt/src/<package>) is root-only: the agent and the
verifier's test run cannot read it (docker: permissions; bwrap: masked), so neither `diff`
nor a workspace symlink into it gets anywhere. Every staged file has the same mtime and the
files are created in path order, so neither timestamps nor inode numbers point at the
mutated module.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from pydantic import Field, field_validator

from agentrl.core.task import Task
from agentrl.core.types import Message, Split
from agentrl.env.agents import ScriptedOracle
from agentrl.env.parsers import HERMES, ToolCallParser
from agentrl.env.settings import ToolEnvSettings
from agentrl.env.tasksource import TaskSource, as_task_source
from agentrl.env.tool_env import ToolEnv
from agentrl.envs.python_repair.images import stage_source
from agentrl.envs.python_repair.packages import DEFAULT_PACKAGES
from agentrl.envs.python_repair.synth import SynthConfig, cached_tasks, synthesize
from agentrl.sandbox.base import Sandbox

log = logging.getLogger(__name__)

TOOLS = ["bash", "python", "read_file", "write_file", "str_replace", "submit"]
# No bytecode caches in the workspace: a .pyc written when the agent ran the buggy module is trusted
# by mtime (1 s resolution) and size, so a same-size fix within that second would run as the old
# code in the agent's own runs. (The verifier never loads workspace bytecode at all.)
_SANDBOX_ENV = {"PYTHONDONTWRITEBYTECODE": "1"}


def load_tasks(
    packages: Sequence[str] = DEFAULT_PACKAGES,
    *,
    split: Split = "train",
    seed: int = 0,
    first_use_n: int = 4,
) -> list[Task]:
    """The cached tasks of `split`; synthesizes `first_use_n` tasks (doubling up to 8x) when there are none."""
    tasks = [t for t in cached_tasks(tuple(packages), seed) if t.split == split]
    n = first_use_n
    while not tasks and n <= 8 * first_use_n:
        print(
            f"[python-repair] no cached {split} tasks for {', '.join(packages)} (seed {seed}): synthesizing "
            f"{n} now (each mutant runs the package's test suite in a sandbox: about 2-5 s each, a few "
            "minutes in all). `agentrl tasks synth python-repair --n 300` makes a full set ahead of time.",
            file=sys.stderr,
            flush=True,
        )
        t0 = time.time()
        synthesize(list(packages), n, SynthConfig(seed=seed))
        print(f"[python-repair] synthesized in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
        tasks = [t for t in cached_tasks(tuple(packages), seed) if t.split == split]
        n *= 2
    if not tasks:
        raise RuntimeError(
            f"no python-repair tasks in split {split!r} for packages {list(packages)} (seed {seed}); "
            "synthesize more with `agentrl tasks synth python-repair --n 300`"
        )
    return tasks


class PythonRepairOracle(ScriptedOracle):
    """Applies the reverse mutation: swaps the mutated function back for the original, then submits."""

    def __init__(self, task: Task, parser: ToolCallParser = HERMES):
        super().__init__(task, parser)
        self.turn = 0

    def act(self, observation: list[Message]) -> str:
        meta = self.task.metadata
        self.turn += 1
        if self.turn == 1:
            return self.call(
                "str_replace",
                path=meta["module"],
                old=meta["mutated_function"],
                new=meta["original_function"],
            )
        last = next((m["content"] for m in reversed(observation) if m["role"] == "tool"), "")
        if self.turn == 2 and not last.startswith("Replaced"):
            # The function text was not unique (or the file changed): write the whole module back.
            module = self.task.files[meta["module"]]
            original = module.replace(meta["mutated_function"], meta["original_function"], 1)
            return self.call("write_file", path=meta["module"], content=original)
        return self.call("submit", answer=f"restored {meta['function']} in {meta['module']}")


class PythonRepairSettings(ToolEnvSettings):
    """python-repair-v0's settings: ToolEnv's with its own defaults, and which packages and tasks."""

    packages: list[str] = Field(
        default_factory=lambda: list(DEFAULT_PACKAGES),
        description="Packages whose planted bugs are the tasks (a list, or 'toolz,parse').",
    )
    first_use_n: int = Field(
        4,
        ge=1,
        description="Tasks synthesized on first use when the cache has none for the split (doubled up to 8x "
        "until some land there); `agentrl tasks synth python-repair --n 300` makes a full set ahead of time.",
    )
    seed: int = Field(0, description="Seed of the task synthesis: which functions are mutated, and how.")
    tools: list[Any] | None = Field(
        default_factory=lambda: list(TOOLS),
        description="The tools the agent calls (@agentrl.tool functions or built-in names).",
    )
    verifier: Any = Field(
        ("hidden-tests", {"mode": "all", "timeout_s": 120.0}),
        description="How an episode is scored: the package's hidden tests, every FAIL_TO_PASS and PASS_TO_PASS "
        "one must pass; or a verifier's name, (name, kwargs), or a Verifier.",
    )
    max_turns: int = Field(30, ge=1, description="Most assistant messages per episode.")
    exec_timeout_s: float = Field(
        60.0, gt=0, description="Timeout of one command a tool runs in the sandbox (a test run), in seconds."
    )
    sandbox_env: dict[str, str] = Field(
        default_factory=lambda: dict(_SANDBOX_ENV),
        description="Environment variables every sandbox starts with; PYTHONDONTWRITEBYTECODE=1 always.",
    )

    @field_validator("packages", mode="before")
    @classmethod
    def _split_packages(cls, value: Any) -> Any:
        return _package_list(value) if isinstance(value, str) else value

    @field_validator("sandbox_env")
    @classmethod
    def _no_bytecode(cls, value: dict[str, str]) -> dict[str, str]:
        return {**_SANDBOX_ENV, **value}


class PythonRepairEnv(ToolEnv):
    settings_model = PythonRepairSettings
    instructions = (
        "You are a software engineer. A Python package in /workspace has a bug that makes some of its "
        "tests fail. Investigate with the tools, fix the package's source, then call `submit`."
    )

    @property
    def packages(self) -> list[str]:
        return self.settings.packages

    @classmethod
    def make_tasks(
        cls,
        *,
        packages: Sequence[str] | str = DEFAULT_PACKAGES,
        seed: int = 0,
        split: Split = "train",
        tasks: Sequence[Task] | None = None,
        first_use_n: int = 4,
        env_id: str | None = None,
        **_: Any,
    ) -> TaskSource:
        """The cached tasks of `split` (synthesized on first use), or the `tasks` given."""
        if tasks is None:
            tasks = load_tasks(_package_list(packages), split=split, seed=seed, first_use_n=first_use_n)
        return as_task_source(list(tasks), name=env_id or cls.__name__)

    def _prepare_sandbox(self, task: Task) -> Sandbox:
        # The package comes from the image (root-only copy) with the task's mutant module in
        # place, staged so that no file's metadata says which one was mutated.
        sb = self._acquire_sandbox(task)
        try:
            stage_source(sb, task.metadata["source_dir"], task.files)
            for cmd in task.setup:
                res = sb.exec(["/bin/sh", "-c", cmd], timeout=max(self.exec_timeout_s, 60.0))
                if not res.ok:
                    raise RuntimeError(f"task {task.id}: set-up command {cmd!r} failed: {res.stderr[-500:]}")
        except BaseException:
            self._drop_unprepared(sb)
            raise
        return sb

    def oracle(self, task: Task) -> PythonRepairOracle:
        return PythonRepairOracle(task, self.parser)

    def statistics(self) -> dict[str, Any]:
        sizes = self.tasks.split_sizes() or {}
        return task_statistics([self.tasks.get(i, split) for split, n in sizes.items() for i in range(n)])


def _package_list(packages: Sequence[str] | str) -> list[str]:
    """`"toolz,parse"` or a list: the package names."""
    if isinstance(packages, str):
        return [p.strip() for p in packages.split(",") if p.strip()]
    return list(packages)


def task_statistics(tasks: Sequence[Task]) -> dict[str, Any]:
    """Tasks per package, per mutation kind and per split, and seconds per verification (suite run on the mutant)."""
    seconds = sorted(float(t.metadata.get("test_seconds", 0.0)) for t in tasks)
    n = len(seconds)
    return {
        "tasks": n,
        "per_package": dict(sorted(Counter(t.metadata["package"] for t in tasks).items())),
        "per_kind": dict(sorted(Counter(t.metadata["kind"] for t in tasks).items())),
        "per_split": dict(sorted(Counter(t.split for t in tasks).items())),
        "functions": len(
            {(t.metadata["package"], t.metadata["module"], t.metadata["function"]) for t in tasks}
        ),
        "fail_to_pass_per_task": {
            "mean": round(sum(len(t.metadata["FAIL_TO_PASS"]) for t in tasks) / n, 2) if n else None,
        },
        "seconds_per_verification": {
            "mean": round(sum(seconds) / n, 3) if n else None,
            "p50": seconds[n // 2] if n else None,
            "p99": seconds[min(n - 1, int(0.99 * n))] if n else None,
        },
    }
