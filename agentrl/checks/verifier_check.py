"""`check_verifier`: trust a task's verifier only after it accepts the reference solution and rejects the untouched start.

A verifier that passes everything, or nothing, makes a task worthless for RL: the reward no
longer says whether the agent solved it. So, per task, before it is used:

- the environment's oracle (`env.oracle(task)`, the reference solution) plays an episode
  and must be scored as passed;
- a null agent plays an episode and must be scored as not passed. It leaves the starting
  state untouched: it submits an empty answer when the environment has a `submit` tool, and
  otherwise says nothing until the turn limit.

    kept, dropped = agentrl.checks.verifier_check.filter_tasks(env, tasks)
    for task, reason in dropped: ...

`filter_tasks` logs how many tasks it dropped and why; `agentrl verifier check ENV_ID --tasks N`
runs it from the command line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from agentrl.core.task import Task
from agentrl.core.types import Message
from agentrl.env.agents import run_episode
from agentrl.env.parsers import HERMES, ToolCallParser
from agentrl.env.protocols import has_oracle
from agentrl.verifiers import Verdict

log = logging.getLogger(__name__)


class NullAgent:
    """Changes nothing: submits an empty answer (in the env's format) if it can, else stays silent."""

    def __init__(self, can_submit: bool, parser: ToolCallParser = HERMES):
        self.can_submit = can_submit
        self.parser = parser

    def act(self, observation: list[Message]) -> str:
        return self.parser.render_call("submit", answer="") if self.can_submit else ""


@dataclass(frozen=True)
class VerifierCheck:
    """The outcome of `check_verifier` for one task. `ok` means the verifier can be trusted on it."""

    task_id: str
    ok: bool
    reason: str
    reference: Verdict | None = None
    untouched: Verdict | None = None


class DroppedTask(NamedTuple):
    task: Task
    reason: str


class FilteredTasks(NamedTuple):
    """`kept, dropped = filter_tasks(...)`; `dropped` pairs each task with why it failed the check."""

    kept: list[Task]
    dropped: list[DroppedTask]


def _verdict(env: Any, agent: Any, task: Task) -> Verdict:
    result = run_episode(env, agent, options={"task": task})
    verdict = result.verdict
    if not isinstance(verdict, Verdict):
        raise RuntimeError(f"the episode ended ({result.episode.finish_reason}) without a verdict in info")
    return verdict


def check_verifier(env: Any, task: Task) -> VerifierCheck:
    """Run the reference solution and the untouched state on `task`; see the module docstring."""
    if not has_oracle(env):
        return VerifierCheck(
            task.id,
            False,
            f"{type(env).__name__} has no oracle(task) method, so no reference solution to validate the "
            "verifier with; add one that returns an agent solving the task",
        )
    try:
        reference = _verdict(env, env.oracle(task), task)
    except Exception as exc:  # a task whose set-up breaks is as unusable as a wrong verifier
        return VerifierCheck(task.id, False, f"the reference episode failed: {type(exc).__name__}: {exc}")
    if not reference.passed:
        return VerifierCheck(
            task.id,
            False,
            f"the reference solution is not accepted (reward {reference.reward:g}): {reference.details}",
            reference,
        )
    try:
        untouched = _verdict(env, NullAgent("submit" in env.toolbox.tools, env.parser), task)
    except Exception as exc:
        return VerifierCheck(
            task.id, False, f"the untouched-state episode failed: {type(exc).__name__}: {exc}", reference
        )
    if untouched.passed:
        return VerifierCheck(
            task.id,
            False,
            f"the untouched starting state already passes (reward {untouched.reward:g}): {untouched.details}",
            reference,
            untouched,
        )
    return VerifierCheck(
        task.id,
        True,
        f"reference passes (reward {reference.reward:g}), untouched state fails (reward {untouched.reward:g})",
        reference,
        untouched,
    )


def filter_tasks(env: Any, tasks: Iterable[Task]) -> FilteredTasks:
    """Keep the tasks whose verifier passes `check_verifier`; say how many were dropped and why."""
    kept: list[Task] = []
    dropped: list[DroppedTask] = []
    for task in tasks:
        check = check_verifier(env, task)
        if check.ok:
            kept.append(task)
        else:
            dropped.append(DroppedTask(task, check.reason))
            log.warning("dropping task %s: %s", task.id, check.reason)
    total = len(kept) + len(dropped)
    if dropped:
        log.warning(
            "filter_tasks: dropped %d of %d tasks whose verifier could not be trusted", len(dropped), total
        )
    else:
        log.info("filter_tasks: all %d tasks passed the verifier check", total)
    return FilteredTasks(kept, dropped)
