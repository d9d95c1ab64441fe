"""Scripted agents and the plain episode loop: oracles, empty and random agents for tests and demonstrations.

An agent maps the newest observation (a list of messages) to the next assistant message
(`agentrl.env.protocols.Agent`):

    class Agent(Protocol):
        def act(self, observation: list[dict]) -> str: ...

**The oracle protocol.** An environment's oracle is `env.oracle(task) -> Agent`: a fresh agent
per task that solves it, played through `env.reset(options={"task": task})` / `env.step(...)`
like any policy, its messages tool calls in the env's format (`env.parser.render_call(name, **args)`;
an oracle class or factory that takes `parser` is handed the env's).
`agentrl env check` (the oracle must score 1 on N tasks), `agentrl verifier check` /
`check_verifier` (the verifier must accept the oracle's solution and reject an untouched start)
and `agentrl demos` (SFT demonstrations, through the rollout engine and its masker) all use it.
Give one as a method (`def oracle(self, task)`) or as `ToolEnv(oracle=...)`; `AnswerOracle`
is the oracle of tasks whose reference answer is submitted as is.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentrl.core.episode import Episode
from agentrl.core.types import Message
from agentrl.env.parsers import HERMES, ToolCallParser
from agentrl.env.protocols import Agent, AgentEnv

if TYPE_CHECKING:
    from agentrl.core.task import Task
    from agentrl.verifiers import Verdict


def tool_call(name: str, /, **arguments: Any) -> str:
    """One call in the default (Hermes) format. An agent playing an environment writes its calls in
    that environment's format instead: `env.parser.render_call(name, **arguments)`."""
    return HERMES.render_call(name, **arguments)


def last_tool_output(observation: list[Message]) -> str:
    for m in reversed(observation):
        if m["role"] == "tool":
            return m["content"]
    return ""


@dataclass
class EpisodeResult:
    """How `run_episode` ended: the last step's outcome and the episode's typed record."""

    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]
    """The last step's Gymnasium `info` (`agentrl.core.types.StepInfo` keys)."""
    episode: Episode

    @property
    def verdict(self) -> Verdict | None:
        return self.episode.verdict


def run_episode(
    env: AgentEnv, agent: Agent, *, seed: int | None = None, options: dict | None = None
) -> EpisodeResult:
    """Reset, then let `agent` act until the episode ends (the env's turn limit bounds it)."""
    obs, info = env.reset(seed=seed, options=options)
    while True:
        obs, reward, terminated, truncated, info = env.step(agent.act(obs))
        if terminated or truncated:
            assert env.episode is not None
            return EpisodeResult(reward, terminated, truncated, info, env.episode)


class ScriptedOracle:
    """Base of a scripted oracle: the task it solves and the format it writes its calls in (the
    environment's: `env.oracle(task)` passes `env.parser`). Subclasses define `act`."""

    def __init__(self, task: Task, parser: ToolCallParser = HERMES):
        self.task = task
        self.parser = parser

    def call(self, tool: str, /, **arguments: Any) -> str:
        """One call of `tool` in the environment's format."""
        return self.parser.render_call(tool, **arguments)

    def act(self, observation: list[Message]) -> str:
        raise NotImplementedError


class AnswerOracle(ScriptedOracle):
    """Submits the task's reference answer (`task.answer`), optionally after the tool calls in
    `task.metadata["oracle_calls"]` (a list of {"name": ..., "arguments": {...}}), one per turn.

    The oracle of a dataset of answer-checked tasks: `ToolEnv(tasks="tasks.jsonl", ...,
    oracle=AnswerOracle)`.
    """

    def __init__(self, task: Task, parser: ToolCallParser = HERMES):
        if getattr(task, "answer", None) is None:
            raise ValueError(f"task {task.id!r} has no answer for AnswerOracle to submit")
        super().__init__(task, parser)
        self.calls = list(task.metadata.get("oracle_calls", []))

    def act(self, observation: list[Message]) -> str:
        if self.calls:
            call = self.calls.pop(0)
            return self.call(call["name"], **call.get("arguments", {}))
        return self.call("submit", answer=self.task.answer)


class EmptyAgent:
    """Says nothing, every turn."""

    def act(self, observation: list[Message]) -> str:
        return ""


class RandomAgent:
    """Random text and random tool calls with random arguments: a floor every environment must score 0."""

    def __init__(self, tool_names: list[str], seed: int = 0, parser: ToolCallParser = HERMES):
        self.tool_names = tool_names
        self.rng = random.Random(seed)
        self.parser = parser

    def _value(self) -> Any:
        r = self.rng.random()
        if r < 0.4:
            return "".join(self.rng.choice("abcxyz019 ;|&$(){}'\"") for _ in range(self.rng.randint(0, 20)))
        if r < 0.7:
            return self.rng.randint(-(10**6), 10**6)
        return self.rng.choice([None, [], {}, 3.5, True])

    def act(self, observation: list[Message]) -> str:
        r = self.rng.random()
        if r < 0.3:
            return "".join(chr(self.rng.randint(32, 0x24F)) for _ in range(self.rng.randint(0, 80)))
        name = self.rng.choice([*self.tool_names, "nonexistent"])
        args = {
            self.rng.choice(["answer", "code", "command", "path", "x"]): self._value()
            for _ in range(self.rng.randint(0, 2))
        }
        text = self.parser.render_calls([(name, args)])
        return text if r < 0.8 else text[: self.rng.randint(0, len(text))]


def first_number(text: str) -> str:
    m = re.search(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?", text)
    return m.group(0) if m else text.strip()
