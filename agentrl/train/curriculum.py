"""Learnability curriculum: keep training on tasks the policy solves about half the time.

With a binary verifiable reward a task's reward variance is p(1 - p), p the policy's pass rate
on it, and the GRPO gradient it produces scales with it: tasks at p = 0 or p = 1 give
all-equal rewards, zero advantages and no gradient. So the curriculum

1. tracks a pass-rate estimate p̂ per task: a Beta(prior_alpha, prior_beta) prior updated with
   the successes and failures of every group of that task (reward >= success_threshold is a
   success), optionally forgetting old evidence (counts times `decay` before each update) so
   p̂ follows the current policy rather than the policy's history;
2. samples tasks in the learnability band band_low <= p̂ <= band_high with weight p̂(1 - p̂);
3. spends a fraction of draws on *probes*, never-seen tasks from the generator, to discover
   where the band is, and a fraction on *re-probes* of tracked tasks outside the band, because
   p moves as the policy learns (too hard today is in band next week; in band today is solved
   tomorrow). A generator's supply is unbounded; a fixed dataset is a finite pool
   (`pool_size`), probed in a seeded random order until every task is tracked, after which a
   draw meant as a probe goes to the band, else to a re-probe;
4. (`DynamicBatch`, DAPO dynamic sampling, Yu et al. 2025 §3.2) drops groups whose rewards
   are all equal and keeps asking for groups until the batch has `batch_groups` informative
   ones or `max_gen_factor × batch_groups` groups were requested (`dynamic_sampling=False`
   keeps every group instead);
5. optionally (`difficulty.adaptive`, `agentrl.train.difficulty`) draws its probes from a leveled task
   generator at a level it raises when probed tasks come out too easy and lowers when too hard,
   so the band keeps filling as the policy improves.

p̂ is the posterior mean (α / (α + β)) by default. `sampling="thompson"` draws p̃ ~ Beta(α, β)
per task at each `sample` call instead; it is not the default because exploration already
has explicit, budgeted knobs here (probe_prob, reprobe_prob), Thompson draws make band
membership and the logged occupancy jump from call to call, and after a group of 8-16
rollouts the posterior is narrow enough that the mean and a draw rarely disagree about the band.

Everything is deterministic given `config.seed` (one numpy Generator), and `state_dict()` is
plain JSON, so a resumed run draws exactly what the uninterrupted run would have drawn.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentrl.rollout.trajectory import Trajectory
from agentrl.task import Task, TaskGenerator
from agentrl.types import Split

DrawKind = Literal["probe", "reprobe", "band"]
Group = Sequence[Trajectory]

_STATE_VERSION = 1


class DifficultySettings(BaseModel):
    """Probes at a difficulty level that rises with the policy (`agentrl.train.difficulty`)."""

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
    """Learnability-band curriculum and DAPO dynamic sampling."""

    model_config = ConfigDict(extra="forbid")

    prior_alpha: float = Field(
        1.0, gt=0, description="Beta prior α (pseudo-successes) of every task's pass rate; 1, 1 is uniform."
    )
    prior_beta: float = Field(
        1.0, gt=0, description="Beta prior β (pseudo-failures) of every task's pass rate."
    )
    success_threshold: float = Field(
        1.0, description="A trajectory whose reward is >= this counts as a success (a pass) for p̂."
    )
    band_low: float = Field(
        0.2, ge=0.0, le=1.0, description="Lower edge of the learnability band (inclusive)."
    )
    band_high: float = Field(
        0.8, ge=0.0, le=1.0, description="Upper edge of the learnability band (inclusive)."
    )
    probe_prob: float = Field(
        0.2,
        ge=0.0,
        le=1.0,
        description="Probability that a draw is a never-seen task from the generator (discovers the band).",
    )
    reprobe_prob: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="Probability that a draw re-probes a tracked task outside the band (p moves as the policy learns).",
    )
    min_band_tasks: int = Field(
        4,
        ge=0,
        description="While fewer tracked tasks than this are in the band, draws meant for the band go to probes.",
    )
    decay: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Old evidence of a task is multiplied by this before each new group is added (1 = never forget).",
    )
    sampling: Literal["mean", "thompson"] = Field(
        "mean",
        description="p̂ used for band membership and weights: the posterior mean, or a Beta draw per sample() call.",
    )
    batch_groups: int = Field(
        8, ge=1, description="Informative (non-zero reward variance) groups per training batch."
    )
    dynamic_sampling: bool = Field(
        True,
        description="Drop zero-variance groups and refill the batch (DAPO); off: a batch is the first "
        "batch_groups groups generated, zero-variance ones included (they add no gradient).",
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
        if self.probe_prob + self.reprobe_prob > 1.0:
            raise ValueError(
                f"probe_prob + reprobe_prob = {self.probe_prob + self.reprobe_prob} > 1; they are shares of the draws"
            )
        return self


@dataclass
class TaskStats:
    """Evidence about one task. `successes`/`failures` are (possibly decayed) counts, not the prior."""

    task_id: str
    index: int  # generator index: the task is regenerated from it, never stored
    successes: float = 0.0
    failures: float = 0.0
    groups: int = 0  # groups observed (not decayed)
    samples: int = 0  # trajectories observed (not decayed)

    @property
    def observed(self) -> bool:
        return self.groups > 0


@dataclass
class TaskDraw:
    """One task the curriculum asks the rollout to run a group on."""

    task: Task
    index: int
    kind: DrawKind
    p_hat: float | None  # the estimate it was drawn with; None for a probe

    @property
    def task_id(self) -> str:
        return self.task.id


@dataclass
class CurriculumMetrics:
    """What the curriculum logs each step (`as_dict()` namespaces them under `curriculum/`)."""

    num_tracked: int  # tasks with at least one observed group
    num_in_band: int
    band_occupancy: float  # num_in_band / num_tracked (0 when nothing is tracked yet)
    p_hat_mean: float  # over tracked tasks (posterior means)
    p_hat_histogram: list[int]  # counts of tracked tasks' p̂ in equal bins over [0, 1]
    # The last DynamicBatch (zeros when none is given):
    generated_groups: int = 0
    kept_groups: int = 0
    dropped_groups: int = 0
    all_pass_fraction: float = 0.0  # of the generated groups, every reward >= success_threshold
    all_fail_fraction: float = 0.0  # of the generated groups, every reward < success_threshold
    refill_cost: float = 0.0  # generated / kept groups (generated when nothing was kept)
    probe_draws: int = 0
    reprobe_draws: int = 0
    band_draws: int = 0

    def as_dict(self, prefix: str = "curriculum/") -> dict[str, Any]:
        return {prefix + k: v for k, v in asdict(self).items()}


def group_by_id(trajectories: Iterable[Trajectory]) -> list[list[Trajectory]]:
    """Split trajectories into groups (same `group_id`), in order of first appearance."""
    groups: dict[str, list[Trajectory]] = {}
    for traj in trajectories:
        groups.setdefault(traj.group_id, []).append(traj)
    return list(groups.values())


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


class Curriculum:
    """Per-task pass-rate posteriors and the band sampler (see the module docstring)."""

    def __init__(
        self,
        task_factory: Callable[[int], Task],
        config: CurriculumConfig | None = None,
        pool_size: int | None = None,
    ) -> None:
        """`task_factory(index)` makes task `index`; `pool_size` is the number of tasks of a fixed
        dataset (indices 0..pool_size-1), None for an unbounded generator."""
        self.config = config if config is not None else CurriculumConfig()
        self.task_factory = task_factory
        self.rng = np.random.default_rng(self.config.seed)
        self.tasks: dict[str, TaskStats] = {}
        self.next_index = self.config.first_index
        if pool_size is not None and pool_size < 1:
            raise ValueError("a curriculum over a fixed dataset needs at least one task (pool_size >= 1)")
        self.pool_size = pool_size
        # A dataset may be sorted (by difficulty, by source): probe it in a seeded random order.
        # Its own Generator, so the draws of `rng` stay those of an unbounded supply.
        self._probe_order = (
            np.random.default_rng([self.config.seed, pool_size]).permutation(pool_size)
            if pool_size is not None
            else None
        )

    @classmethod
    def from_source(
        cls, source: Any, config: CurriculumConfig | None = None, split: Split = "train"
    ) -> Curriculum:
        """A curriculum over the tasks of `split` of anything `ToolEnv(tasks=...)` accepts: a generator
        (unbounded), or a list, JSONL file or `datasets.Dataset` (a finite pool)."""
        from agentrl.tasksource import as_task_source

        if cls is Curriculum and config is not None and config.difficulty.adaptive:
            from agentrl.train.difficulty import LeveledCurriculum

            return LeveledCurriculum.from_source(source, config, split)
        src = as_task_source(source)
        return cls(lambda index: src.get(index, split), config, pool_size=src.size(split))

    @classmethod
    def from_generator(
        cls, generator: TaskGenerator, config: CurriculumConfig | None = None, split: Split = "train"
    ) -> Curriculum:
        """A curriculum over `generator`'s tasks of `split` (task i = generator.generate(i, split))."""
        return cls.from_source(generator, config, split)

    @property
    def exhausted(self) -> bool:
        """Whether every task of a finite pool has been probed (always False for a generator)."""
        return self.pool_size is not None and self.next_index - self.config.first_index >= self.pool_size

    # -- estimates --------------------------------------------------------------------------

    def posterior(self, task_id: str) -> tuple[float, float]:
        """(α, β) of the task's Beta posterior."""
        stats = self._stats(task_id)
        return self.config.prior_alpha + stats.successes, self.config.prior_beta + stats.failures

    def p_hat(self, task_id: str) -> float:
        """Posterior mean pass rate α / (α + β)."""
        alpha, beta = self.posterior(task_id)
        return alpha / (alpha + beta)

    def in_band(self, p: float) -> bool:
        return self.config.band_low <= p <= self.config.band_high

    # -- evidence ---------------------------------------------------------------------------

    def observe(self, task_id: str, rewards: Sequence[float]) -> None:
        """Add one group's rewards to the task's posterior (after decaying the old evidence)."""
        if not rewards:
            return
        stats = self._stats(task_id)
        successes = sum(1 for r in rewards if r >= self.config.success_threshold)
        gamma = self.config.decay
        stats.successes = gamma * stats.successes + successes
        stats.failures = gamma * stats.failures + (len(rewards) - successes)
        stats.groups += 1
        stats.samples += len(rewards)

    def update(self, trajectories: Iterable[Trajectory]) -> None:
        """Observe every group in `trajectories`, zero-variance ones included (they carry the most
        information about p: all-pass and all-fail are how a task leaves the band).

        Untrainable trajectories (env errors, timeouts) are not evidence about the policy and are skipped.
        """
        for group in group_by_id(trajectories):
            task_ids = {t.task_id for t in group}
            if len(task_ids) != 1:
                raise ValueError(
                    f"group {group[0].group_id!r} mixes tasks {sorted(task_ids)}; a group is one task's rollouts"
                )
            rewards = [t.reward for t in group if t.trainable]
            self.observe(group[0].task_id, rewards)

    # -- sampling ---------------------------------------------------------------------------

    def sample(self, n: int, exclude: Iterable[str] = ()) -> list[TaskDraw]:
        """Draw `n` tasks: each slot is a probe with probability probe_prob, a re-probe of an
        out-of-band task with probability reprobe_prob, else a band task drawn ∝ p̂(1 - p̂).

        Tracked tasks are drawn without replacement within one call and never from `exclude`
        (e.g. the tasks already in this batch); re-probes pick uniformly among the out-of-band
        tasks. An empty category falls back to the band, then to a probe, so a call returns `n`
        draws, unless a finite pool runs out: every one of its tasks drawn or excluded. While fewer
        than `min_band_tasks` tasks are in the band, band draws become probes (bootstrapping: at
        the start nothing is known).
        """
        cfg = self.config
        excluded = set(exclude)
        observed = [s for s in self.tasks.values() if s.observed and s.task_id not in excluded]
        if cfg.sampling == "thompson" and observed:
            alphas = np.array([cfg.prior_alpha + s.successes for s in observed])
            betas = np.array([cfg.prior_beta + s.failures for s in observed])
            estimates = self.rng.beta(alphas, betas)
        else:
            estimates = np.array([self.p_hat(s.task_id) for s in observed])
        band = [i for i, p in enumerate(estimates) if self.in_band(float(p))]
        outside = [i for i, p in enumerate(estimates) if not self.in_band(float(p))]
        band_big_enough = len(band) >= cfg.min_band_tasks

        # Tracked tasks without a usable group yet (every episode of theirs failed in the environment):
        # a finite pool has nothing else once it is exhausted, so they are drawn again then.
        unseen = [s for s in self.tasks.values() if not s.observed and s.task_id not in excluded]
        draws: list[TaskDraw] = []
        for _ in range(n):
            u = self.rng.random()
            if u < cfg.probe_prob:
                kind: DrawKind = "probe"
            elif u < cfg.probe_prob + cfg.reprobe_prob:
                kind = "reprobe" if outside else "band"
            else:
                kind = "band"
            if kind == "band" and not (band_big_enough and band):
                kind = "probe"
            if kind == "probe":
                draw = self._probe()
                if draw is not None:
                    draws.append(draw)
                    continue
                # A finite pool with every task tracked: draw among the tracked ones instead.
                if band:
                    kind = "band"
                elif outside:
                    kind = "reprobe"
                elif unseen:
                    stats = unseen.pop(int(self.rng.integers(len(unseen))))
                    draws.append(TaskDraw(self.task_factory(stats.index), stats.index, "reprobe", None))
                    continue
                else:
                    break  # every task of the pool is already in this batch: fewer than n draws
            pool = band if kind == "band" else outside
            if kind == "band":
                weights = np.array([estimates[i] * (1.0 - estimates[i]) for i in pool])
                # A band edge at 0 or 1 gives weight 0 to every member; fall back to uniform then.
                weights = (
                    weights / weights.sum() if weights.sum() > 0 else np.full(len(pool), 1.0 / len(pool))
                )
                pick = int(self.rng.choice(len(pool), p=weights))
            else:
                pick = int(self.rng.integers(len(pool)))
            i = pool.pop(pick)
            stats = observed[i]
            draws.append(TaskDraw(self.task_factory(stats.index), stats.index, kind, float(estimates[i])))
        return draws

    def _probe(self) -> TaskDraw | None:
        """A never-seen task; None when a finite pool has no untracked task left."""
        # Generators are deterministic in the index; an id we already track (a generator with
        # duplicates) is skipped so a probe is always a task the curriculum has not seen.
        for _ in range(10_000):
            if self.exhausted:
                return None
            position = self.next_index
            self.next_index += 1
            index = position
            if self._probe_order is not None:
                index = int(self._probe_order[(position - self.config.first_index) % len(self._probe_order)])
            task = self.task_factory(index)
            if task.id not in self.tasks:
                self.tasks[task.id] = TaskStats(task_id=task.id, index=index)
                return TaskDraw(task, index, "probe", None)
        raise RuntimeError(
            f"the task factory returned 10000 already-tracked ids in a row (up to index {self.next_index - 1}); "
            "it must give distinct task ids for distinct indices"
        )

    def _stats(self, task_id: str) -> TaskStats:
        try:
            return self.tasks[task_id]
        except KeyError:
            raise KeyError(
                f"task {task_id!r} is not tracked by this curriculum; only tasks it handed out with sample() "
                "can be observed"
            ) from None

    # -- metrics and state --------------------------------------------------------------------

    def metrics(self, batch: DynamicBatchResult | None = None) -> CurriculumMetrics:
        observed = [s for s in self.tasks.values() if s.observed]
        p_hats = np.array([self.p_hat(s.task_id) for s in observed], dtype=float)
        in_band = int(sum(self.in_band(float(p)) for p in p_hats))
        histogram, _ = np.histogram(p_hats, bins=self.config.histogram_bins, range=(0.0, 1.0))
        metrics = CurriculumMetrics(
            num_tracked=len(observed),
            num_in_band=in_band,
            band_occupancy=in_band / len(observed) if observed else 0.0,
            p_hat_mean=float(p_hats.mean()) if observed else 0.0,
            p_hat_histogram=[int(c) for c in histogram],
        )
        if batch is not None:
            metrics.generated_groups = batch.generated_groups
            metrics.kept_groups = len(batch.groups)
            metrics.dropped_groups = len(batch.dropped)
            metrics.all_pass_fraction = batch.all_pass_groups / max(batch.generated_groups, 1)
            metrics.all_fail_fraction = batch.all_fail_groups / max(batch.generated_groups, 1)
            metrics.refill_cost = batch.refill_cost
            metrics.probe_draws = batch.draw_counts.get("probe", 0)
            metrics.reprobe_draws = batch.draw_counts.get("reprobe", 0)
            metrics.band_draws = batch.draw_counts.get("band", 0)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """Plain-JSON state: task evidence, the next probe index and the generator's state."""
        return {
            "version": _STATE_VERSION,
            "next_index": self.next_index,
            "rng": self.rng.bit_generator.state,
            "tasks": [asdict(s) for s in self.tasks.values()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output; the config stays the one this curriculum was built with."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"curriculum state version {state.get('version')!r}, expected {_STATE_VERSION}")
        rng = np.random.default_rng()
        rng.bit_generator.state = state["rng"]
        tasks = {t["task_id"]: TaskStats(**t) for t in state["tasks"]}
        self.rng, self.tasks, self.next_index = rng, tasks, int(state["next_index"])


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


class DynamicBatch:
    """DAPO dynamic sampling as a small state machine the trainer drives:

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
        self, curriculum: Curriculum, batch_groups: int | None = None, max_gen_factor: float | None = None
    ):
        self.curriculum = curriculum
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
        self.untrainable = 0
        self.draw_counts: dict[str, int] = {"probe": 0, "reprobe": 0, "band": 0}
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
            self.draw_counts[draw.kind] += 1
        return draws

    def add(self, groups: Iterable[Group]) -> None:
        """Hand back the groups generated for the last request (any order, any subset)."""
        threshold = self.curriculum.config.success_threshold
        for group in groups:
            self.generated += 1
            self.curriculum.update(group)
            trainable = [t for t in group if t.trainable]
            self.untrainable += len(group) - len(trainable)
            if trainable and all(t.reward >= threshold for t in trainable):
                self.all_pass += 1
            elif trainable and all(t.reward < threshold for t in trainable):
                self.all_fail += 1
            if self.curriculum.config.dynamic_sampling:
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
            untrainable_trajectories=self.untrainable,
            batch_groups=self.batch_groups,
            draw_counts=dict(self.draw_counts),
        )


def build_batch(
    curriculum: Curriculum,
    generate: Callable[[list[TaskDraw]], Iterable[Group]],
    batch_groups: int | None = None,
    max_gen_factor: float | None = None,
) -> DynamicBatchResult:
    """Run `DynamicBatch` to completion with a synchronous `generate(draws) -> groups`."""
    builder = DynamicBatch(curriculum, batch_groups, max_gen_factor)
    while not builder.done:
        builder.add(generate(builder.request()))
    return builder.result()
