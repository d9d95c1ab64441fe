"""`agentrl/harbor-v0`: Harbor task directories as an environment.

    env = agentrl.make("agentrl/harbor-v0", path="terminal-bench/tasks")      # a folder of tasks, or one
    env_id = agentrl.envs.harbor.register_task_set("tasks/", id="mylab/tb-v0")  # an id of their own

Each task's instruction is the prompt; its `environment/Dockerfile` (or `docker_image`) is the
sandbox, built offline through the `FROM` mapping (`agentrl.sandbox.images.build_task_image`) and
cached per recipe; the agent's workspace is the image's WORKDIR, starting as the image has it;
`tests/test.sh` is the verifier (`test-script`: copied in after the episode, run as the verifier
identity, the reward read from /logs/verifier, which the agent could never write);
`solution/solve.sh` is the oracle. The task's timeouts hold: `[agent].timeout_sec` bounds the
episode (each command gets what is left; past it the episode ends `timeout` and is scored),
`[verifier].timeout_sec` the script, `[environment].build_timeout_sec` the image build.

Not covered: tasks whose agent or solution must be root or write outside the workspace and /tmp (the
sandbox's root file system is read-only and the agent is uid 1000), tasks that need the network
during the episode or the verification (there is none), docker-compose tasks.
"""

from __future__ import annotations

import base64
import io
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from agentrl.core.episode import Episode
from agentrl.core.task import Task
from agentrl.core.types import FinishReason, Message
from agentrl.env.agents import ScriptedOracle
from agentrl.env.parsers import HERMES, ToolCallParser
from agentrl.env.registry import register
from agentrl.env.settings import ToolEnvSettings
from agentrl.env.step_limits import Refusal, StepLimit, StepState
from agentrl.env.tasksource import TaskSource, as_task_source
from agentrl.env.tool_env import ToolEnv
from agentrl.envs.harbor.tasks import EXAMPLES_DIR, load_tasks
from agentrl.sandbox.base import DEFAULT_WORKDIR, Sandbox
from agentrl.sandbox.spec import RESERVED_DIRS
from agentrl.verifiers.base import VERIFIER_DEADLINE_MARGIN_S

TOOLS = ["bash", "python", "read_file", "write_file", "str_replace", "submit"]
SEED_DIR = "/opt/agentrl/seed"
SOLUTION_DIR = "/tmp/.agentrl-solution"  # what the image's /solution links to


class HarborSettings(ToolEnvSettings):
    """agentrl/harbor-v0's settings: which task directories, how their images are built."""

    path: str | list[str] = Field(
        str(EXAMPLES_DIR),
        description="A Harbor task directory, a folder of them, or a list of either (default: the three "
        "examples shipped with agentrl).",
    )
    from_map: dict[str, str] = Field(
        default_factory=dict,
        description="FROM names (fnmatch patterns) -> images built here, tried before the defaults "
        "(agentrl.sandbox.images.DEFAULT_FROM_MAP), for images neither on this engine nor pullable.",
    )
    registry: Literal["auto", "off"] = Field(
        "auto",
        description="'auto': pull a FROM image that is not here when a registry answers; 'off': never.",
    )
    keep_git_history: bool = Field(
        False,
        description="Keep the image's git repositories as they are; off (the default) prunes each to HEAD and "
        "its ancestors, so no later commit, branch, tag, reflog or packed ref holds the answer.",
    )
    tools: list[Any] | None = Field(
        default_factory=lambda: list(TOOLS),
        description="The tools the agent calls (built-in names or @tools).",
    )
    verifier: Any = Field(
        ("test-script", {}),
        description="How an episode is scored: the task's tests/test.sh (the `test-script` verifier), or another.",
    )
    max_turns: int = Field(30, ge=1, description="Most assistant messages per episode.")
    exec_timeout_s: float = Field(
        120.0,
        gt=0,
        description="Longest one command runs, in seconds (the task's agent timeout caps it too).",
    )
    split: str = Field("test", description="The split episodes draw from (a task's own `split`, else test).")


@dataclass(frozen=True)
class EpisodeTimeLimit(StepLimit):
    """The task's agent timeout: the episode's wall clock since reset. Commands get what is left;
    a call that finds it spent is not run, and the episode ends `timeout` (then scored)."""

    timeout_s: float
    started_s: float

    def left_s(self) -> float:
        return self.started_s + self.timeout_s - time.monotonic()

    def admit_call(self, index: int, step: StepState) -> Refusal | None:
        if self.left_s() > 0:
            return None
        return Refusal(f"the task's time limit of {self.timeout_s:g}s is spent")

    def cap_exec_timeout(self, timeout_s: float, step: StepState) -> float:
        return min(timeout_s, max(self.left_s(), 0.001))

    def ends_episode(self, episode: Episode) -> FinishReason | None:
        return "timeout" if self.left_s() <= 0 else None


class SolveScriptOracle(ScriptedOracle):
    """Harbor's oracle: unpacks the task's solution/ at /solution and runs solve.sh there, in the
    workspace, as the agent; then submits."""

    def __init__(self, task: Task, parser: ToolCallParser = HERMES):
        super().__init__(task, parser)
        solution = task.metadata.get("solution_dir")
        if not solution:
            raise ValueError(f"task {task.id} has no solution/solve.sh for the oracle to run")
        self.solution = Path(solution)
        self.turn = 0

    def command(self) -> str:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            tar.add(self.solution, arcname=".")
        payload = base64.b64encode(buf.getvalue()).decode()
        return (
            f"rm -rf {SOLUTION_DIR} && mkdir -p {SOLUTION_DIR} && printf %s '{payload}' | base64 -d | "
            f"tar -xzf - -C {SOLUTION_DIR} --no-same-owner && bash /solution/solve.sh"
        )

    def act(self, observation: list[Message]) -> str:
        self.turn += 1
        if self.turn == 1:
            return self.call("bash", command=self.command())
        return self.call("submit", answer="ran solution/solve.sh")


class HarborEnv(ToolEnv):
    settings_model = HarborSettings
    instructions = (
        "You are an agent working in a Linux container. Do the task with the tools (commands run in the "
        "task's working directory), then call `submit`."
    )

    # Built images, per task directory: (tag, workdir). Class-level defaults, made per instance on first use.
    _images: dict[str, tuple[str, str]] | None = None
    _images_lock = threading.Lock()
    _started_s = 0.0

    @classmethod
    def make_tasks(
        cls, *, path: Any = str(EXAMPLES_DIR), tasks: Any = None, env_id: str | None = None, **_: Any
    ) -> TaskSource:
        return as_task_source(tasks if tasks is not None else load_tasks(path), name=env_id or cls.__name__)

    # --- the image ---------------------------------------------------------------------------
    def image_for(self, task: Task) -> tuple[str, str]:
        """The task's image (built, or reused while its recipe holds) and the workspace's path in it."""
        from agentrl.sandbox.images import build_task_image, image_workdir

        key = task.metadata["harbor_dir"]
        with self._images_lock:
            if self._images is None:
                self._images = {}
            if key not in self._images:
                d = Path(key)
                context = d / "environment"
                dockerfile = (
                    None if (context / "Dockerfile").is_file() else f"FROM {task.metadata['docker_image']}\n"
                )
                tag = build_task_image(
                    context,
                    repo=f"agentrl/harbor-{_slug(d.name)}",
                    dockerfile=dockerfile,
                    from_map=self.settings.from_map,
                    registry=self.settings.registry,
                    timeout_s=float(task.metadata.get("build_timeout_s") or 600.0),
                    keep_git_history=self.settings.keep_git_history,
                    what=f"task {task.id} ({context}/Dockerfile)",
                )
                workdir = image_workdir(tag)
                if (
                    not workdir
                    or workdir == "/"
                    or any(workdir == r or workdir.startswith(r + "/") for r in RESERVED_DIRS)
                ):
                    workdir = DEFAULT_WORKDIR
                self._images[key] = (tag, workdir)
            return self._images[key]

    def sandbox_workdir(self, task: Task) -> str:
        if "harbor_dir" not in task.metadata:
            return DEFAULT_WORKDIR
        return self.image_for(task)[1]

    def _prepare_sandbox(self, task: Task) -> Sandbox:
        tag, workdir = self.image_for(task)
        limits = self.limits
        update = {k: task.metadata[k] for k in ("cpus", "memory_mb") if task.metadata.get(k)}
        if update:
            self.set_setting("limits", limits.model_copy(update=update))
        try:
            sb = self._acquire_sandbox(task.model_copy(update={"image": tag}))
        finally:
            if update:
                self.set_setting("limits", limits)
        try:
            # The workspace (a fresh tmpfs over the WORKDIR) starts as the image's WORKDIR was.
            seed = f"if [ -d {SEED_DIR} ]; then cp -R --preserve=mode,timestamps,links {SEED_DIR}/. {workdir}/; fi"
            res = sb.exec(["/bin/sh", "-c", seed], timeout=max(self.exec_timeout_s, 120.0))
            if not res.ok:
                raise RuntimeError(
                    f"task {task.id}: seeding the workspace {workdir} failed: {res.stderr[-500:]}"
                )
        except BaseException:
            self._drop_unprepared(sb)
            raise
        return sb

    # --- the task's timeouts -----------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[list[Message], dict]:
        obs, info = super().reset(seed=seed, options=options)
        self._started_s = time.monotonic()  # the agent's clock starts once its sandbox is ready
        return obs, info

    def step_limits(self) -> list[StepLimit]:
        limits = super().step_limits()
        timeout = self.task.metadata.get("agent_timeout_s") if self.task is not None else None
        if timeout:
            limits.append(EpisodeTimeLimit(float(timeout), self._started_s))
        return limits

    @property
    def verifier_deadline_s(self) -> float:
        own = self.task.metadata.get("verifier_timeout_s") if self.task is not None else None
        if own and self.verifier_timeout_s is None:
            return float(own) + VERIFIER_DEADLINE_MARGIN_S
        return super().verifier_deadline_s

    def oracle(self, task: Task) -> SolveScriptOracle:
        return SolveScriptOracle(task, self.parser)


def _slug(name: str) -> str:
    import re

    return re.sub(r"[^a-z0-9_.-]+", "-", name.lower()).strip("-.")[:60] or "task"


def register_task_set(path: str | Path | list[str | Path], *, id: str | None = None, **defaults: Any) -> str:
    """Register Harbor task directories under an id of their own; returns it.

        env_id = register_task_set("terminal-bench/tasks", id="mylab/tb-v0")
        agentrl.make(env_id)          # and env show, train, eval, the audit: any command taking an id

    `id` defaults to `harbor/<folder name>-v0`; `defaults` are further settings (`from_map=...`).
    """
    first = Path(path if isinstance(path, str | Path) else path[0]).resolve()
    env_id = id or f"harbor/{_slug(first.name)}-v0"
    paths = (
        str(Path(path).resolve()) if isinstance(path, str | Path) else [str(Path(p).resolve()) for p in path]
    )
    load_tasks(paths)  # a bad folder is an error now, not at the first episode
    register(
        env_id,
        "agentrl.envs.harbor.env:HarborEnv",
        max_turns=defaults.pop("max_turns", 30),
        description=f"Harbor tasks from {first}",
        path=paths,
        **defaults,
    )
    return env_id
