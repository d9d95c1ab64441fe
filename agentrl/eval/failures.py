"""Episodes that ended outside the policy's control, named where they happen.

An evaluation or a training step whose episodes mostly ended `agent_error` (the user's agent raised),
`timeout`, `env_error` or `engine_error` measured nothing about the policy: its pass@1 of 0.000 is the
agent's crash, not the model. `failures(trajectories)` counts them (an episode once, by its branch 0)
and keeps the first error's text, so that the console can say so in one line, with what to do.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from agentrl.core.errors import one_line
from agentrl.rollout.trajectory import Trajectory

OUTSIDE_THE_POLICY = ("agent_error", "timeout", "env_error", "engine_error")
"""Finish reasons that say nothing about the policy (`Trajectory.trainable` is False for each)."""

WHAT_TO_DO = {
    "agent_error": "your agent raised it, not the environment (`agentrl env check` plays the environment "
    "without your agent): fix the agent, e.g. by running one episode (`agentrl rollout --env ENV --model "
    "CHECKPOINT --tasks 1 --group-size 1 --out one.jsonl`) and reading the trajectory's `error`",
    "timeout": "the episodes ran past rollout.episode_timeout_s: raise it, or look for an agent that waits "
    "forever (a blocking call, a request the gateway never answers)",
    "env_error": "the environment failed: run `agentrl env check ENV` and read the trajectories' `error`",
    "engine_error": "the rollout engine died: its log (engine.log) says why",
}

# The longest error text quoted on the console (an exception's message can be a page long).
_QUOTE_CHARS = 400


@dataclass(frozen=True)
class Failures:
    """How many of `episodes` ended outside the policy's control, by reason, and the first one's error."""

    episodes: int
    counts: dict[str, int]
    """Finish reason -> episodes, for the reasons of `OUTSIDE_THE_POLICY` that occurred, most first."""
    first_reason: str
    """The most common of them."""
    first_error: str
    """The error of the first episode that ended with `first_reason` (one line, bounded)."""

    @property
    def failed(self) -> int:
        return sum(self.counts.values())

    @property
    def most(self) -> bool:
        """More than half of the episodes."""
        return 2 * self.failed > self.episodes

    @property
    def every(self) -> bool:
        return self.failed == self.episodes

    def line(self, env: str = "ENV") -> str:
        """One line: how many, why, the first error, what to do."""
        reasons = ", ".join(f"{r} {n}" for r, n in self.counts.items())
        error = f": {self.first_error}" if self.first_error else ""
        advice = WHAT_TO_DO[self.first_reason].replace("ENV", env)
        return (
            f"{self.failed} of {self.episodes} episodes ended outside the policy's control ({reasons}); the "
            f"first {self.first_reason}{error}. Their rewards say nothing about the model: {advice}"
        )


def failures(trajectories: Sequence[Trajectory]) -> Failures | None:
    """The failures among `trajectories` (a harness episode's extra branches are not counted again); None
    when no episode ended outside the policy's control."""
    episodes = [t for t in trajectories if t.branch == 0]
    failed = [t for t in episodes if t.finish_reason in OUTSIDE_THE_POLICY]
    if not failed:
        return None
    counts = Counter(t.finish_reason for t in failed)
    reason = counts.most_common(1)[0][0]
    first = next(t for t in failed if t.finish_reason == reason)
    error = one_line(first.error or "")
    if len(error) > _QUOTE_CHARS:
        error = f"{error[: _QUOTE_CHARS - 100]} ... {error[-90:]}"
    return Failures(len(episodes), dict(counts.most_common()), reason, error)
