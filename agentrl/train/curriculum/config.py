"""The curriculum's settings: the `curriculum` section of `agentrl train`'s config."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentrl.train.curriculum.names import available_samplers

Share = Annotated[float, Field(ge=0.0, le=1.0)]
"""A pass rate or a share of the draws: a number in [0, 1]."""


class DifficultySettings(BaseModel):
    """Probes at a difficulty level that rises with the policy (`agentrl.train.curriculum.leveled`)."""

    model_config = ConfigDict(extra="forbid")

    adaptive: bool = Field(
        False,
        description="Probe new tasks at a difficulty level the curriculum moves up when its probes pass too "
        "often and down when too rarely; needs a leveled task generator (levels, generate_at).",
    )
    start_level: int = Field(0, ge=0, description="The level of the first probes.")
    min_probes: int = Field(
        6, ge=1, description="Probes judged at the current level before the level may move again."
    )
    target: float = Field(
        0.5,
        gt=0.0,
        lt=1.0,
        description="Pass rate the level is steered to: p(1-p), the reward variance, is largest at 0.5.",
    )
    tolerance: float = Field(
        0.15,
        ge=0.0,
        lt=0.5,
        description="Move up when the last min_probes probes at the level passed more than target + this "
        "on average, down when less than target - this.",
    )


class CurriculumConfig(BaseModel):
    """Which tasks each batch trains on: a sampler (the learnability band by default) and DAPO dynamic sampling."""

    model_config = ConfigDict(extra="forbid")

    sampler: str = Field(
        "band",
        description="The task sampler: band (learnability band), uniform, dapo (uniform with dynamic "
        "sampling), pools (easy/normal/hard difficulty pools), mgpo (uniform draws, each group's loss "
        "weighted by how close its pass rate is to 1/2), leveled (the band probing at a rising difficulty "
        "level); or a sampler a package registers in the entry-point group `agentrl.samplers`; or "
        "`module:attribute`.",
    )
    sampler_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword options of the sampler (pools: easy_threshold, hard_threshold, easy_fraction, "
        "hard_fraction; mgpo: strength; a plugin's own).",
    )

    prior_alpha: float = Field(
        1.0, gt=0, description="Beta prior α (pseudo-successes) of every task's pass rate; 1, 1 is uniform."
    )
    prior_beta: float = Field(
        1.0, gt=0, description="Beta prior β (pseudo-failures) of every task's pass rate."
    )
    success_threshold: float = Field(
        1.0, description="A trajectory whose reward is >= this counts as a success (a pass) for p̂."
    )
    band_low: Share = Field(0.2, description="Lower edge of the learnability band (inclusive).")
    band_high: Share = Field(0.8, description="Upper edge of the learnability band (inclusive).")
    probe_prob: Share = Field(
        0.2,
        description="Probability that a draw is a never-seen task from the generator (discovers the band).",
    )
    reprobe_prob: Share = Field(
        0.1,
        description="Probability that a draw re-probes a tracked task outside the band (p moves as the policy learns).",
    )
    min_band_tasks: int = Field(
        4, ge=0, description="While fewer tracked tasks than this are in the band, band draws go to probes."
    )
    decay: Share = Field(
        1.0,
        gt=0.0,
        description="Old evidence of a task is multiplied by this before each new group is added (1 = never forget).",
    )
    sampling: Literal["mean", "thompson"] = Field(
        "mean",
        description="p̂ used for band membership and weights: the posterior mean, or a Beta draw per sample() call.",
    )
    batch_groups: int = Field(
        8, ge=1, description="Informative (non-zero reward variance) groups per training batch."
    )
    dynamic_sampling: bool | None = Field(
        None,
        description="Drop zero-variance groups and refill the batch (DAPO); off: a batch is the first "
        "batch_groups groups generated, zero-variance ones included (they add no gradient). Unset: the "
        "sampler's own choice (off for uniform, on for every other built-in sampler).",
    )
    probe_group_size: int | None = Field(
        None,
        ge=2,
        description="Episodes in the group of a probe (a task not seen before), fewer than rollout.group_size "
        "to spend less on tasks that turn out never or always solved; a probe group with both passes and "
        "failures trains like any other. Unset: rollout.group_size.",
    )
    prior_key: str | None = Field(
        None,
        description="A task metadata field (e.g. `level`) whose value says how hard a task is: a new task's "
        "prior pass rate is that of the tracked tasks with the same value, and a probe takes, of the next "
        "probe_candidates new tasks, the one whose prior is nearest 1/2.",
    )
    probe_candidates: int = Field(
        8, ge=1, description="New tasks a probe chooses among when prior_key is set (1: the next one)."
    )
    max_gen_factor: float = Field(
        3.0,
        ge=1.0,
        description="At most this × batch_groups groups are requested for one batch (bounds dynamic-sampling refill).",
    )
    seed: int = Field(
        0, description="Seed of the curriculum's numpy Generator (all draws are deterministic)."
    )
    first_index: int = Field(0, ge=0, description="Generator index of the first probe task.")
    histogram_bins: int = Field(
        10, ge=1, description="Number of equal-width bins of the logged p̂ histogram over [0, 1]."
    )
    difficulty: DifficultySettings = Field(
        default_factory=DifficultySettings,
        description="Difficulty that rises with the policy: probes at a level steered by their outcomes.",
    )

    @model_validator(mode="after")
    def _check(self) -> CurriculumConfig:
        if self.band_low > self.band_high:
            raise ValueError(f"band_low ({self.band_low}) must be <= band_high ({self.band_high})")
        # A name (no module:attribute) is a built-in sampler's or an installed plugin's.
        if ":" not in self.sampler and self.sampler not in (names := available_samplers()):
            raise ValueError(
                f"sampler {self.sampler!r} is not a sampler; available: {', '.join(names)} (a package adds "
                "one in the entry-point group 'agentrl.samplers'), or give module:attribute"
            )
        if self.difficulty.adaptive and self.sampler not in ("band", "leveled"):
            raise ValueError(
                f"difficulty.adaptive is the `leveled` sampler; it cannot be combined with sampler {self.sampler!r}"
            )
        if self.probe_prob + self.reprobe_prob > 1.0:
            raise ValueError(
                f"probe_prob + reprobe_prob = {self.probe_prob + self.reprobe_prob} > 1; they are shares of the draws"
            )
        return self
