"""DAPO dynamic sampling (Yu et al. 2025 §3.2): a batch of informative groups, refilled from the curriculum.

A group whose rewards are all equal gives zero advantages and no gradient. `DynamicBatch` drops such
groups and keeps asking the curriculum for tasks until the batch has `batch_groups` informative
ones or `max_gen_factor × batch_groups` groups were requested (`dynamic_sampling=False` keeps every
group instead). It asks and records; it never plays an episode: whoever drives it (the rollout
producer, a test) turns each request into groups and hands them back.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from agentrl.rollout.trajectory import Trajectory
from agentrl.train.curriculum.band import Curriculum, TaskDraw

Group = Sequence[Trajectory]


def filter_groups(groups: Iterable[Group]) -> tuple[list[Group], list[Group]]:
    """DAPO dynamic sampling: (kept, dropped), dropping groups with zero reward variance.

    A group whose rewards are all equal (max == min; a one-trajectory group included) has
    every advantage exactly 0 and contributes no gradient, only noise in the loss denominator.
    """
    kept: list[Group] = []
    dropped: list[Group] = []
    for group in groups:
        rewards = [t.reward for t in group]
        (kept if rewards and max(rewards) > min(rewards) else dropped).append(group)
    return kept, dropped


@dataclass
class BatchMetrics:
    """What one dynamic-sampling batch cost (`as_dict()` namespaces them under `curriculum/`)."""

    generated_groups: int
    kept_groups: int
    dropped_groups: int
    all_pass_fraction: float  # of the generated groups, every reward >= success_threshold
    all_fail_fraction: float  # of the generated groups, every reward < success_threshold
    refill_cost: float  # generated / kept groups (generated when nothing was kept)
    probe_draws: int
    reprobe_draws: int
    band_draws: int
    revisit_draws: int  # tracked tasks drawn whatever their estimate (uniform and the other samplers)

    def as_dict(self, prefix: str = "curriculum/") -> dict[str, Any]:
        return {prefix + k: v for k, v in asdict(self).items()}


@dataclass
class DynamicBatchResult:
    """A finished dynamic-sampling batch."""

    groups: list[Group]  # at most batch_groups informative groups, in arrival order
    dropped: list[Group]  # zero-variance groups
    surplus: list[Group]  # informative groups beyond batch_groups (generated, not trained on)
    requested_groups: int
    generated_groups: int  # groups that came back (a failed rollout may return fewer)
    rounds: int
    all_pass_groups: int
    all_fail_groups: int
    untrainable_trajectories: int  # removed before filtering (env errors, timeouts)
    batch_groups: int  # the target
    draw_counts: dict[str, int] = field(default_factory=dict)
    mixed_groups: int = 0  # generated groups with both passes and failures
    empty_groups: int = 0  # generated groups none of whose episodes is trainable (all broke)
    untrainable: list[Trajectory] = field(default_factory=list)
    """The episodes removed before filtering, with their finish reasons and errors (what the run keeps and
    says about episodes that ended outside the policy's control)."""

    @property
    def full(self) -> bool:
        """Whether the batch reached batch_groups informative groups within the generation bound."""
        return len(self.groups) == self.batch_groups

    @property
    def refill_cost(self) -> float:
        """Groups generated per group trained on (1.0 = no waste); generated when none was kept."""
        return self.generated_groups / max(len(self.groups), 1)

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g]

    def metrics(self) -> BatchMetrics:
        generated = max(self.generated_groups, 1)
        return BatchMetrics(
            generated_groups=self.generated_groups,
            kept_groups=len(self.groups),
            dropped_groups=len(self.dropped),
            all_pass_fraction=self.all_pass_groups / generated,
            all_fail_fraction=self.all_fail_groups / generated,
            refill_cost=self.refill_cost,
            probe_draws=self.draw_counts.get("probe", 0),
            reprobe_draws=self.draw_counts.get("reprobe", 0),
            band_draws=self.draw_counts.get("band", 0),
            revisit_draws=self.draw_counts.get("revisit", 0),
        )


class DynamicBatch:
    """DAPO dynamic sampling as a small state machine its caller drives:

        builder = DynamicBatch(curriculum)
        while not builder.done:
            builder.add(rollout(builder.request()))   # rollout: draws -> list of groups
        result = builder.result()

    Every returned group updates the curriculum (zero-variance ones too). Untrainable
    trajectories are removed first; groups with zero reward variance are dropped. Requests
    stop once `batch_groups` informative groups are in, or `max_gen_factor × batch_groups`
    groups were requested (so extra generation is bounded), or a finite pool has no task left
    that is not already in the batch; the batch may then be short, even empty (`result().full`
    says which). After the first round, a request is sized by
    the keep rate seen so far, so a batch that loses half its groups asks for twice the
    shortfall in one round instead of many small ones.
    """

    def __init__(
        self,
        curriculum: Curriculum,
        batch_groups: int | None = None,
        max_gen_factor: float | None = None,
        *,
        learn: bool = True,
    ):
        self.curriculum = curriculum
        # False: the groups only fill the batch, and whoever hands the batch on calls
        # `curriculum.update` on `arrived` (batches built at the same time teach the curriculum in order).
        self.learn = learn
        self.arrived: list[Group] = []  # every group handed back, in arrival order
        self.batch_groups = batch_groups if batch_groups is not None else curriculum.config.batch_groups
        factor = max_gen_factor if max_gen_factor is not None else curriculum.config.max_gen_factor
        if self.batch_groups < 1 or factor < 1.0:
            raise ValueError(
                f"need batch_groups >= 1 and max_gen_factor >= 1, got {self.batch_groups}, {factor}"
            )
        self.max_groups = max(self.batch_groups, math.floor(factor * self.batch_groups))
        self.kept: list[Group] = []
        self.dropped: list[Group] = []
        self.requested = 0
        self.generated = 0
        self.rounds = 0
        self.all_pass = 0
        self.all_fail = 0
        self.mixed = 0
        self.empty = 0
        self.untrainable = 0
        self.broken: list[Trajectory] = []
        self.draw_counts: dict[str, int] = {"probe": 0, "reprobe": 0, "band": 0, "revisit": 0}
        # DAPO's zero-variance dropping: the config's choice, else the sampler's own.
        chosen = curriculum.config.dynamic_sampling
        self.dynamic_sampling = (
            chosen if chosen is not None else getattr(curriculum, "dynamic_sampling", True)
        )
        self._drawn: set[str] = set()
        self.pool_exhausted = False  # a finite pool gave fewer tasks than asked: nothing left to draw

    @property
    def done(self) -> bool:
        return len(self.kept) >= self.batch_groups or self.requested >= self.max_groups or self.pool_exhausted

    def request(self) -> list[TaskDraw]:
        """The next tasks to run one group each on; [] once `done`."""
        if self.done:
            return []
        need = self.batch_groups - len(self.kept)
        budget = self.max_groups - self.requested
        keep_rate = len(self.kept) / self.generated if self.generated else 1.0
        n = budget if keep_rate == 0.0 else min(budget, max(need, math.ceil(need / keep_rate)))
        draws = self.curriculum.sample(n, exclude=self._drawn)
        self.pool_exhausted = len(draws) < n
        self.requested += len(draws)
        self.rounds += 1
        for draw in draws:
            self._drawn.add(draw.task_id)
            self.draw_counts[draw.kind] = self.draw_counts.get(draw.kind, 0) + 1
        return draws

    def add(self, groups: Iterable[Group]) -> None:
        """Hand back the groups generated for the last request (any order, any subset)."""
        threshold = self.curriculum.config.success_threshold
        for group in groups:
            self.generated += 1
            self.arrived.append(group)
            if self.learn:
                self.curriculum.update(group)
            trainable = [t for t in group if t.trainable]
            self.untrainable += len(group) - len(trainable)
            self.broken.extend(t for t in group if not t.trainable)
            if trainable and all(t.reward >= threshold for t in trainable):
                self.all_pass += 1
            elif trainable and all(t.reward < threshold for t in trainable):
                self.all_fail += 1
            elif trainable:
                self.mixed += 1
            else:
                self.empty += 1
            if self.dynamic_sampling:
                kept, dropped = filter_groups([trainable])
            else:  # keep what was generated; a group whose every episode broke has nothing to train on
                kept, dropped = ([trainable], []) if trainable else ([], [trainable])
            self.kept.extend(kept)
            self.dropped.extend(dropped)

    def result(self) -> DynamicBatchResult:
        return DynamicBatchResult(
            groups=self.kept[: self.batch_groups],
            dropped=self.dropped,
            surplus=self.kept[self.batch_groups :],
            requested_groups=self.requested,
            generated_groups=self.generated,
            rounds=self.rounds,
            all_pass_groups=self.all_pass,
            all_fail_groups=self.all_fail,
            mixed_groups=self.mixed,
            empty_groups=self.empty,
            untrainable_trajectories=self.untrainable,
            untrainable=list(self.broken),
            batch_groups=self.batch_groups,
            draw_counts=dict(self.draw_counts),
        )
