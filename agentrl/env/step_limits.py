"""The limits of a `ToolEnv` step as small pieces, composed in a list (Gymnasium's wrappers are the model).

A step reads: parse the message, run its tool calls, apply the limits, return the observation.
Each limit is one `StepLimit` answering at one or more points of that step:

- `check_action(action)`: before parsing, refuse the whole message (`MessageLengthLimit`: the
  model's output is bounded);
- `admit_call(index, step)`: before each tool call, refuse it and every later one
  (`ToolCallLimit`: calls per message; `StepTimeLimit`: the message's time budget);
- `cap_exec_timeout(timeout_s, step)`: shorten the call's command timeout (`StepTimeLimit`);
- `ends_episode(episode)`: after the calls, end the episode (`TurnLimit`).

Unlike a Gymnasium wrapper, a limit runs inside `step`: the episode must end (and its verifier run)
in the step that crosses the limit, since the reward comes back from that step. `ToolEnv.step_limits()`
builds the four from the env's settings at each step; a subclass adds its own there:

    @dataclass(frozen=True)
    class EpisodeCallLimit(StepLimit):            # at most `most` tool calls in a whole episode
        most: int
        episode: Episode

        def admit_call(self, index, step):
            if self.episode.tool_calls >= self.most:
                return Refusal(f"this episode's {self.most} tool calls are used up")

    class FrugalEnv(ToolEnv):
        def step_limits(self):
            return [*super().step_limits(), EpisodeCallLimit(50, self.episode)]

The first refusal wins, in list order; a refusal's reason is what the model reads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from agentrl.core.episode import Episode
from agentrl.core.types import FinishReason

# Shortest command timeout a limit hands a call: a budget crossed between the check and the call
# gives a command that times out at once, never a timeout the sandbox rejects (<= 0).
_MIN_EXEC_TIMEOUT_S = 0.001


@dataclass
class StepState:
    """One step as its limits see it: when its tool calls started, and how many have run."""

    started_s: float = field(default_factory=time.monotonic)
    """`time.monotonic()` when the first tool call of the message was about to run."""
    calls_run: int = 0
    """Tool calls of this message run so far."""


@dataclass(frozen=True)
class Refusal:
    """A limit's no: the reason the model reads, and whether it counts as the model's format error."""

    reason: str
    format_error: bool = False


class StepLimit:
    """One limit on a step; every hook lets everything through unless the limit overrides it."""

    def check_action(self, action: str) -> Refusal | None:
        """Refuse the whole message before it is parsed: nothing of it runs."""
        return None

    def admit_call(self, index: int, step: StepState) -> Refusal | None:
        """Refuse call `index` of the message (0-based), and with it every later call."""
        return None

    def cap_exec_timeout(self, timeout_s: float, step: StepState) -> float:
        """The command timeout the next call's commands get (at most `timeout_s`)."""
        return timeout_s

    def ends_episode(self, episode: Episode) -> FinishReason | None:
        """After the message's calls: the reason the episode ends here, or None to go on."""
        return None


@dataclass(frozen=True)
class MessageLengthLimit(StepLimit):
    """The model's output: a message longer than `max_chars` is not read at all."""

    max_chars: int

    def check_action(self, action: str) -> Refusal | None:
        if len(action) <= self.max_chars:
            return None
        return Refusal(
            f"your message is {len(action)} characters long; the limit is {self.max_chars}. Nothing was run. "
            "Send a shorter message with one tool call",
            format_error=True,
        )


@dataclass(frozen=True)
class ToolCallLimit(StepLimit):
    """At most `max_calls` tool calls run per message; the rest are refused, a format error."""

    max_calls: int

    def admit_call(self, index: int, step: StepState) -> Refusal | None:
        if index < self.max_calls:
            return None
        return Refusal(
            f"at most {self.max_calls} tool call(s) run per message in this environment; call the others in "
            "your next message",
            format_error=True,
        )


@dataclass(frozen=True)
class StepTimeLimit(StepLimit):
    """The tool calls of one message share `budget_s` of wall-clock time: each call's commands get
    what is left of it, and a call that finds it spent is refused (not the model's error)."""

    budget_s: float

    def left_s(self, step: StepState) -> float:
        return step.started_s + self.budget_s - time.monotonic()

    def admit_call(self, index: int, step: StepState) -> Refusal | None:
        if self.left_s(step) > 0:
            return None
        return Refusal(f"this message's tool calls used up its time budget of {self.budget_s:g}s")

    def cap_exec_timeout(self, timeout_s: float, step: StepState) -> float:
        return min(timeout_s, max(self.left_s(step), _MIN_EXEC_TIMEOUT_S))


@dataclass(frozen=True)
class TurnLimit(StepLimit):
    """The episode ends `max_turns` (truncated) after its `max_turns`-th assistant message."""

    max_turns: int

    def ends_episode(self, episode: Episode) -> FinishReason | None:
        return "max_turns" if episode.turns >= self.max_turns else None


@dataclass(frozen=True)
class StepLimits(StepLimit):
    """Several limits as one: the first refusal (or ending) in list order wins, timeouts are capped by all."""

    limits: tuple[StepLimit, ...]

    def check_action(self, action: str) -> Refusal | None:
        return next((r for limit in self.limits if (r := limit.check_action(action)) is not None), None)

    def admit_call(self, index: int, step: StepState) -> Refusal | None:
        return next((r for limit in self.limits if (r := limit.admit_call(index, step)) is not None), None)

    def cap_exec_timeout(self, timeout_s: float, step: StepState) -> float:
        for limit in self.limits:
            timeout_s = limit.cap_exec_timeout(timeout_s, step)
        return timeout_s

    def ends_episode(self, episode: Episode) -> FinishReason | None:
        return next((r for limit in self.limits if (r := limit.ends_episode(episode)) is not None), None)
