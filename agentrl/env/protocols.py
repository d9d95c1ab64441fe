"""The environment contract the stages rely on: `AgentEnv` (what `agentrl.make` returns; `ToolEnv`
keeps it), the optional `OracleEnv`, and `Agent` (what plays an episode). They name the
environment stage's own parts (its tools, tool-call format and task supply), so they live here,
in that stage, and not beside the shared types of `agentrl.core.types`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from agentrl.core.types import FinishReason, Message, Verdict

if TYPE_CHECKING:
    from agentrl.core.episode import Episode
    from agentrl.core.task import Task
    from agentrl.env.parsers import ToolCallParser
    from agentrl.env.tasksource import TaskSource
    from agentrl.env.tools import ToolBox


class Agent(Protocol):
    """Maps the newest observation (the messages since its last turn) to its next message."""

    def act(self, observation: list[Message]) -> str: ...


@runtime_checkable
class AgentEnv(Protocol):
    """The environment contract the stages rely on (`agentrl.make` returns one; `ToolEnv` keeps it).

    Gymnasium's `reset`/`step`/`close`, plus what rollout, evaluation and the checks read:
    the episode's typed record (`episode`), its task (`task`), ending an episode from outside with a
    verdict (`end_episode`: the rollout's token and wall-clock limits), the task supply (`tasks`),
    the tools and the tool-call format. `options={"task": Task}` or `{"index": i}` picks the task.
    """

    env_id: str
    max_turns: int
    tasks: TaskSource
    task: Task | None
    """The current episode's task (None before the first reset)."""
    episode: Episode | None
    """The current episode's typed record (None before the first reset)."""
    toolbox: ToolBox
    parser: ToolCallParser
    """The tool-call format: the system block that advertises the tools, rendering and parsing calls."""

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]: ...

    def step(self, action: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]: ...

    def end_episode(self, reason: FinishReason, error: str | None = None) -> Verdict: ...

    def close(self) -> None: ...


@runtime_checkable
class OracleEnv(AgentEnv, Protocol):
    """An environment that can solve its own tasks (optional part of the contract).

    `oracle(task)` returns a fresh agent that solves `task` when played through
    `reset(options={"task": task})` and `step`, its calls written in the env's format
    (`env.parser.render_call`). `agentrl env check` (it must score 1), `check_verifier` (the
    verifier must accept its solution) and demonstrations need it; `has_oracle(env)` says whether an
    environment has one.
    """

    def oracle(self, task: Task) -> Agent: ...


def has_oracle(env: Any) -> bool:
    """Whether `env` offers the optional `oracle(task)` of the contract."""
    return callable(getattr(env, "oracle", None))
