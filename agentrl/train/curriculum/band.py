"""The learnability-band sampler: keep training on tasks the policy solves about half the time.

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
   draw meant as a probe goes to the band, else to a re-probe.

p̂ is the posterior mean (α / (α + β)) by default. `sampling="thompson"` draws p̃ ~ Beta(α, β)
per task at each `sample` call instead; it is not the default because exploration already
has explicit, budgeted knobs here (probe_prob, reprobe_prob), Thompson draws make band
membership and the logged occupancy jump from call to call, and after a group of 8-16
rollouts the posterior is narrow enough that the mean and a draw rarely disagree about the band.

Probes can cost less than a full group (`probe_group_size`: a task never or always solved shows it
in a few episodes; one that splits them trains like any other group), and need not be uniform draws:
with `prior_key` (a metadata field such as a level), a new task's prior pass rate is that of the
tracked tasks sharing its value, and a probe takes, of the next `probe_candidates` new tasks, the one
whose prior is nearest 1/2.

`Curriculum` is also the base class of the other samplers (`agentrl.train.curriculum.samplers`):
they keep its estimates, metrics and state and override `sample` (and, to weight a group's loss,
`group_weight`). The sampler only picks tasks (`sample`) and records what their groups scored
(`update`); who plays the episodes is the caller's business. Everything is deterministic given `config.seed` (one
numpy Generator), and `state_dict()` is plain JSON, so a resumed run draws exactly what the
uninterrupted run would have drawn.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from agentrl.core.task import Task
from agentrl.core.types import Split
from agentrl.env.tasksource import TaskSource
from agentrl.rollout.trajectory import Trajectory
from agentrl.train.curriculum.config import CurriculumConfig

DrawKind = Literal["probe", "reprobe", "band", "revisit"]
"""probe: a task not seen before; reprobe: a tracked task outside the band; band: a tracked task in
the band; revisit: a tracked task drawn whatever its estimate (uniform and the other samplers)."""

_STATE_VERSION = 1


@dataclass
class TaskStats:
    """Evidence about one task. `successes`/`failures` are (possibly decayed) counts, not the prior."""

    task_id: str
    index: int  # generator index: the task is regenerated from it, never stored
    successes: float = 0.0
    failures: float = 0.0
    groups: int = 0  # groups observed (not decayed)
    samples: int = 0  # trajectories observed (not decayed)
    prior_value: str | None = None  # the task's `prior_key` metadata value, as text

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
    group_size: int | None = None  # episodes to run on it; None: the rollout's group_size

    @property
    def task_id(self) -> str:
        return self.task.id


@dataclass
class CurriculumMetrics:
    """What the curriculum's estimates look like (`as_dict()` namespaces them under `curriculum/`)."""

    num_tracked: int  # tasks with at least one observed group
    num_in_band: int
    band_occupancy: float  # num_in_band / num_tracked (0 when nothing is tracked yet)
    p_hat_mean: float  # over tracked tasks (posterior means)
    p_hat_histogram: list[int]  # counts of tracked tasks' p̂ in equal bins over [0, 1]

    def as_dict(self, prefix: str = "curriculum/") -> dict[str, Any]:
        return {prefix + k: v for k, v in asdict(self).items()}


def group_by_id(trajectories: Iterable[Trajectory]) -> list[list[Trajectory]]:
    """Split trajectories into groups (same `group_id`), in order of first appearance."""
    groups: dict[str, list[Trajectory]] = {}
    for traj in trajectories:
        groups.setdefault(traj.group_id, []).append(traj)
    return list(groups.values())


class Curriculum:
    """Per-task pass-rate posteriors and the band sampler (see the module docstring)."""

    dynamic_sampling: bool = True
    """Whether the batch drops zero-variance groups and refills (DAPO) when `config.dynamic_sampling`
    is unset: this sampler's own choice."""

    @classmethod
    def from_source(
        cls, source: TaskSource, config: CurriculumConfig, split: Split = "train", **options: Any
    ):
        """The sampler over the tasks of `split` of `source`; `options` are `config.sampler_options`."""
        return cls(lambda index: source.get(index, split), config, pool_size=source.size(split), **options)

    def __init__(
        self,
        task_factory: Callable[[int], Task],
        config: CurriculumConfig | None = None,
        pool_size: int | None = None,
    ) -> None:
        """`task_factory(index)` makes task `index`; `pool_size` is the number of tasks of a fixed
        dataset (indices 0..pool_size-1), None for an unbounded generator. `build_curriculum` makes
        one from an environment's task source."""
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
        # New tasks a probe looked at but did not take (`prior_key`), for later probes: (index, id, prior value).
        self._pending: list[tuple[int, str, str | None]] = []

    @property
    def exhausted(self) -> bool:
        """Whether every task of a finite pool has been probed (always False for a generator)."""
        return self._probe_order_done and not self._pending

    @property
    def _probe_order_done(self) -> bool:
        """Whether a finite pool's probe order has been walked to its end (pending tasks aside)."""
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

    def prior(self, task: Task) -> float:
        """A new task's prior pass rate: with `prior_key`, the pooled pass rate of the tracked tasks whose
        metadata has the same value (counts added to the Beta prior), else the prior's mean."""
        return self.prior_of(self._prior_value(task))

    def prior_of(self, value: str | None) -> float:
        """The prior pass rate of a new task whose `prior_key` value is `value` (see `prior`)."""
        cfg = self.config
        alpha, beta = cfg.prior_alpha, cfg.prior_beta
        if value is not None:
            for stats in self.tasks.values():
                if stats.prior_value == value:
                    alpha, beta = alpha + stats.successes, beta + stats.failures
        return alpha / (alpha + beta)

    def _prior_value(self, task: Task) -> str | None:
        key = self.config.prior_key
        if key is None or key not in task.metadata:
            return None
        return str(task.metadata[key])

    def group_weight(self, group: Sequence[Trajectory]) -> float:
        """The factor on the advantages of a group this sampler's batch trains on (1: GRPO's own)."""
        return 1.0

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
        An episode counts once, whatever the number of its trajectories (branches).
        """
        for group in group_by_id(trajectories):
            task_ids = {t.task_id for t in group}
            if len(task_ids) != 1:
                raise ValueError(
                    f"group {group[0].group_id!r} mixes tasks {sorted(task_ids)}; a group is one task's rollouts"
                )
            # One reward per episode: a harness episode's other branches repeat its reward.
            rewards = [t.reward for t in group if t.trainable and t.branch == 0]
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

    def probe(self) -> TaskDraw | None:
        """A task not drawn before (a probe), the one the configured probing picks; None when a finite pool
        has none left. For samplers built on this class."""
        return self._probe()

    def _probe(self) -> TaskDraw | None:
        """A never-seen task; None when a finite pool has no untracked task left.

        With `prior_key`, each probe looks at the next `probe_candidates` new tasks and takes, of those and
        the ones earlier probes left, the first whose prior is nearest 1/2; the others wait for later probes
        (a generator's oldest are forgotten past 64 x probe_candidates: its supply has no end)."""
        want = self.config.probe_candidates if self.config.prior_key is not None else 1
        made: dict[int, Task] = {}
        while len(made) < want and (new := self._next_new()) is not None:
            task, index = new
            made[index] = task
            self._pending.append((index, task.id, self._prior_value(task)))
        if self.pool_size is None and len(self._pending) > 64 * want:
            del self._pending[: len(self._pending) - 64 * want]
        if not self._pending:
            return None
        priors = {value: self.prior_of(value) for value in {value for _, _, value in self._pending}}
        spread = [priors[value] * (1.0 - priors[value]) for _, _, value in self._pending]
        index, task_id, value = self._pending.pop(spread.index(max(spread)))
        task = made[index] if index in made else self.task_factory(index)
        self.tasks[task_id] = TaskStats(task_id=task_id, index=index, prior_value=value)
        return TaskDraw(task, index, "probe", None, group_size=self.config.probe_group_size)

    def _next_new(self) -> tuple[Task, int] | None:
        """The next task of the probe order that is neither tracked nor pending; None when a finite pool
        has none left."""
        pending = {task_id for _, task_id, _ in self._pending}
        # Generators are deterministic in the index; an id we already track (a generator with
        # duplicates) is skipped so a probe is always a task the curriculum has not seen.
        for _ in range(10_000):
            if self._probe_order_done:
                return None
            position = self.next_index
            self.next_index += 1
            index = position
            if self._probe_order is not None:
                index = int(self._probe_order[(position - self.config.first_index) % len(self._probe_order)])
            task = self.task_factory(index)
            if task.id not in self.tasks and task.id not in pending:
                return task, index
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

    def metrics(self) -> CurriculumMetrics:
        observed = [s for s in self.tasks.values() if s.observed]
        p_hats = np.array([self.p_hat(s.task_id) for s in observed], dtype=float)
        in_band = int(sum(self.in_band(float(p)) for p in p_hats))
        histogram, _ = np.histogram(p_hats, bins=self.config.histogram_bins, range=(0.0, 1.0))
        return CurriculumMetrics(
            num_tracked=len(observed),
            num_in_band=in_band,
            band_occupancy=in_band / len(observed) if observed else 0.0,
            p_hat_mean=float(p_hats.mean()) if observed else 0.0,
            p_hat_histogram=[int(c) for c in histogram],
        )

    def pool_state(self) -> dict[str, float]:
        """Whether a finite pool has nothing left to learn from: every task tried (`exhausted`), and how many
        of the tracked ones sit above the band (solved always) and below it (never), as metrics."""
        above = below = 0
        for s in self.tasks.values():
            if s.observed:
                p = self.p_hat(s.task_id)
                above += p > self.config.band_high
                below += p < self.config.band_low
        return {
            "curriculum/pool_exhausted": float(self.exhausted),
            "curriculum/tasks_above_band": float(above),
            "curriculum/tasks_below_band": float(below),
        }

    def state_dict(self) -> dict[str, Any]:
        """Plain-JSON state: task evidence, the next probe index and the generator's state."""
        return {
            "version": _STATE_VERSION,
            "sampler": type(self).__name__,
            "next_index": self.next_index,
            "rng": self.rng.bit_generator.state,
            "tasks": [asdict(s) for s in self.tasks.values()],
            "pending": [list(entry) for entry in self._pending],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output; the config stays the one this curriculum was built with."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"curriculum state version {state.get('version')!r}, expected {_STATE_VERSION}")
        saved = state.get("sampler", type(self).__name__)
        if saved != type(self).__name__:
            raise ValueError(
                f"the saved curriculum state is of the sampler {saved}, this run's is {type(self).__name__}: "
                "resume with the curriculum.sampler the run started with"
            )
        rng = np.random.default_rng()
        rng.bit_generator.state = state["rng"]
        tasks = {t["task_id"]: TaskStats(**t) for t in state["tasks"]}
        self.rng, self.tasks, self.next_index = rng, tasks, int(state["next_index"])
        self._pending = [(int(i), str(task_id), value) for i, task_id, value in state.get("pending", [])]
