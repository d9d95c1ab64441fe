"""Harbor task directories read as `Task`s, as Harbor lays them out.

    task-name/
      task.toml          [verifier] timeout_sec, env; [agent] timeout_sec; [environment]
                         build_timeout_sec, docker_image, cpus, memory_mb; [metadata] (free)
      instruction.md     the prompt
      environment/       the image's build context (Dockerfile), or none with docker_image set
      tests/test.sh      the verifier: judges the container, writes /logs/verifier/reward.txt
      solution/solve.sh  the reference solution (the oracle), optional

`find_task_dirs(path)`: `path` itself when it holds a task.toml, else every subdirectory that does
(sorted by name). `load_task(dir)` reads one; nothing is built here (the environment builds each
image the first time an episode needs it).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agentrl.core.errors import UserError
from agentrl.core.task import Task
from agentrl.core.types import SPLITS

EXAMPLES_DIR = Path(__file__).with_name("examples")
"""Three hand-made tasks (a file edit, a shell job, a repair whose test.sh fails on a wrong fix):
the default task set of `agentrl/harbor-v0`."""


class HarborTaskError(UserError):
    """A directory that is not a Harbor task (or a task set), said in one line with the fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="allow")


class VerifierSection(_Section):
    timeout_sec: float = Field(600.0, gt=0)
    env: dict[str, str] = Field(default_factory=dict)


class AgentSection(_Section):
    timeout_sec: float | None = Field(None, gt=0)


class EnvironmentSection(_Section):
    build_timeout_sec: float = Field(600.0, gt=0)
    docker_image: str | None = None
    cpus: float | None = Field(None, gt=0)
    memory_mb: int | None = Field(None, gt=0)


class TaskToml(_Section):
    """task.toml, read leniently: the sections agentrl acts on are typed, the rest kept as given."""

    metadata: dict[str, Any] = Field(default_factory=dict)
    verifier: VerifierSection = Field(default_factory=VerifierSection)
    agent: AgentSection = Field(default_factory=AgentSection)
    environment: EnvironmentSection = Field(default_factory=EnvironmentSection)


def find_task_dirs(path: str | Path) -> list[Path]:
    """The task directories at `path`: itself when it is one, else its subdirectories that are."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise HarborTaskError(f"Harbor task path {root}: no such directory")
    if (root / "task.toml").is_file():
        return [root.resolve()]
    dirs = sorted(p.resolve() for p in root.iterdir() if (p / "task.toml").is_file())
    if not dirs:
        raise HarborTaskError(
            f"{root} is neither a Harbor task (no task.toml) nor a folder of tasks (no subfolder has one)"
        )
    return dirs


def read_toml(task_dir: Path) -> TaskToml:
    try:
        data = tomllib.loads((task_dir / "task.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise HarborTaskError(f"{task_dir}/task.toml cannot be read: {exc}") from None
    try:
        return TaskToml.model_validate(data)
    except Exception as exc:
        raise HarborTaskError(f"{task_dir}/task.toml: {' '.join(str(exc).split())[:300]}") from None


def task_name(task_dir: Path, toml: TaskToml) -> str:
    named = getattr(toml, "task", None)
    if isinstance(named, dict) and isinstance(named.get("name"), str):
        return named["name"]
    return task_dir.name


def load_task(task_dir: str | Path, *, default_split: str = "test") -> Task:
    """One Harbor task directory as a `Task` (its image is built later, by the environment)."""
    d = Path(task_dir).resolve()
    toml = read_toml(d)
    if not (d / "instruction.md").is_file():
        raise HarborTaskError(f"{d}: no instruction.md (the prompt)")
    if not (d / "tests" / "test.sh").is_file():
        raise HarborTaskError(f"{d}: no tests/test.sh (the verifier)")
    env = toml.environment
    if not (d / "environment" / "Dockerfile").is_file() and not env.docker_image:
        raise HarborTaskError(f"{d}: no environment/Dockerfile and no [environment].docker_image to run in")
    extra = toml.model_extra or {}
    split = extra.get("split") or toml.metadata.get("split") or default_split
    if split not in SPLITS:
        raise HarborTaskError(f"{d}/task.toml: split {split!r} is not one of {', '.join(SPLITS)}")
    solve = d / "solution" / "solve.sh"
    name = task_name(d, toml)
    return Task(
        id=f"harbor/{name}",
        prompt=(d / "instruction.md").read_text(),
        image=f"harbor-task:{name}",  # a placeholder: the environment builds the image and runs that
        hidden_tests=str(d / "tests"),
        split=split,
        metadata={
            "harbor_dir": str(d),
            "verifier_timeout_s": toml.verifier.timeout_sec,
            "verifier_env": dict(toml.verifier.env),
            "agent_timeout_s": toml.agent.timeout_sec,
            "build_timeout_s": env.build_timeout_sec,
            "docker_image": env.docker_image,
            "cpus": env.cpus,
            "memory_mb": env.memory_mb,
            "solution_dir": str(solve.parent) if solve.is_file() else None,
            "harbor_metadata": toml.metadata,
        },
    )


def load_tasks(paths: str | Path | list[str | Path], *, default_split: str = "test") -> list[Task]:
    """Every task under `paths` (one path or several), ids checked to be distinct."""
    tasks: list[Task] = []
    for p in [paths] if isinstance(paths, str | Path) else list(paths):
        tasks.extend(load_task(d, default_split=default_split) for d in find_task_dirs(p))
    seen: dict[str, str] = {}
    for t in tasks:
        if t.id in seen:
            raise HarborTaskError(
                f"two tasks are named {t.id!r} ({seen[t.id]} and {t.metadata['harbor_dir']}); rename one"
            )
        seen[t.id] = t.metadata["harbor_dir"]
    return tasks
