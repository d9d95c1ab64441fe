"""`RolloutConfig`: how episodes are rolled out, defined once.

It is the `rollout:` section of `agentrl train`, the rollout part of every `agentrl eval` budget,
the options of `agentrl rollout`, and the `config` of `agentrl.rollout.loop.collect`: the same
fields with the same defaults wherever they appear.

The seed is not part of it: it is the random stream of one `collect` call (`collect(..., seed=)`),
which each caller derives (the trainer from its run seed and the call count, the evaluation from
each episode's key).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field


class RolloutConfig(BaseModel):
    """Sampling, limits and parallelism of rollouts."""

    # A field documents itself with `description=` or with the docstring under it.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    group_size: int = Field(
        8, ge=1, description="Episodes per task (same task, different samples): one GRPO group."
    )
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_tokens_per_turn: int = Field(256, ge=1, description="Most tokens the policy may sample in one turn.")
    max_total_tokens: int = Field(
        2048,
        ge=2,
        description="Context budget of a whole trajectory (prompt included); beyond it the episode ends `max_tokens`.",
    )
    episode_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Wall-clock limit of one episode (reset to verdict); beyond it the episode ends `timeout`.",
    )
    concurrency: int = Field(32, ge=1, description="Episodes in flight at once (each holds one environment).")
    end_timeout_s: float = Field(60.0, gt=0)
    """How long ending a timed-out episode (its verifier, its sandbox release) may take."""
    on_push: Literal["continue", "restart"] = "continue"
    """What an episode in flight does when new weights reach the engine (asynchronous training):
    `continue` under them, each sampled token keeping the version it came from
    (`Trajectory.token_versions`); or `restart`: it is abandoned and played again from reset, so that
    all of its tokens come from one version, at the price of the work thrown away (`Trajectory.restarts`,
    `rollout/restarts`). After `max_restarts` restarts an episode continues."""
    max_restarts: int = Field(2, ge=0, description="Restarts of one episode at most (`on_push: restart`).")
    drift_check: bool = Field(
        True, description="Re-render every finished conversation and report token drift (`Trajectory.drift`)."
    )
    warn_on_drift: bool = Field(
        False,
        description="Also `warnings.warn` for each drifted trajectory (its `drift` and the step metric say it regardless).",
    )

    BUDGET_FIELDS: ClassVar[tuple[str, ...]] = (
        "temperature",
        "top_p",
        "max_tokens_per_turn",
        "max_total_tokens",
        "episode_timeout_s",
    )
    """What an episode may do: an evaluation holds these identical for every model it compares.
    The others decide how fast episodes run or what is reported, not what they can achieve."""

    def budget(self) -> dict[str, float | int]:
        """The `BUDGET_FIELDS` and their values."""
        return {name: getattr(self, name) for name in self.BUDGET_FIELDS}


def turn_seed(seed: int, episode: int, turn: int) -> int:
    """The sampling seed of turn `turn` of episode `episode` in a rollout whose random stream is `seed`:
    the native loop's and the gateway's (a harness episode samples what the native loop would)."""
    return (seed * 1_000_003 + episode) * 1_009 + turn
