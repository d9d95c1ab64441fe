"""Task samplers behind one protocol, and the registry `curriculum.sampler` names them in.

Built in (`curriculum.sampler`):

- `band`: the learnability band (`Curriculum`, the default);
- `uniform`: every draw a task of the pool uniformly at random, every group trained on;
- `dapo`: uniform draws with DAPO's dynamic sampling (zero-variance groups dropped, the batch refilled);
- `pools`: prime-rl's difficulty pools: a task whose last group all passed is *easy*, all failed
  *hard*, else *normal*; a draw comes from the easy or hard pool with a fixed share each
  (`easy_fraction`, `hard_fraction`), else uniformly from the rest;
- `mgpo`: uniform draws, each group's advantages weighted by exp(-strength · KL(p ‖ 1/2)), p the
  group's own pass rate (VibeThinker's MaxEnt-guided policy optimization: a group solved about half
  the time weighs 1, an almost-solved or almost-failed one less);
- `leveled`: the band, probing a leveled generator at a difficulty level that rises with the policy
  (also `curriculum.difficulty.adaptive`).

A plugin is a class (or any callable) a package registers in the entry-point group
`agentrl.samplers`, or a `module:attribute` path:

    [project.entry-points."agentrl.samplers"]
    recent = "mylab.samplers:RecentFailures"

Subclassing `Curriculum` is the short way: it keeps the per-task estimates, the metrics and the
checkpointed state, and the subclass overrides `sample` (and `group_weight` to weight a group's
loss, `dynamic_sampling` for its default). Anything else implements `Sampler`. A class is built with
`from_source(source, config, split, **curriculum.sampler_options)` when it has it (`Curriculum`
does), else called with the same arguments.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

from agentrl.core.errors import UserError
from agentrl.core.types import Split
from agentrl.env.tasksource import as_task_source
from agentrl.rollout.trajectory import Trajectory
from agentrl.train.curriculum import names
from agentrl.train.curriculum.band import Curriculum, CurriculumMetrics, TaskDraw, TaskStats, group_by_id
from agentrl.train.curriculum.config import CurriculumConfig
from agentrl.train.curriculum.names import ENTRY_POINT_GROUP, available_samplers

__all__ = [
    "ENTRY_POINT_GROUP",
    "DapoSampler",
    "DifficultyPools",
    "MgpoSampler",
    "PoolsMetrics",
    "Sampler",
    "UniformSampler",
    "available_samplers",
    "build_sampler",
    "load_sampler",
]


@runtime_checkable
class Sampler(Protocol):
    """What the trainer asks of a sampler. `config` is the run's `curriculum` section; `metrics()`
    returns an object with `as_dict()` or a mapping of numbers (logged under `curriculum/`);
    `state_dict()` is plain JSON, restored by `load_state_dict` on resume. Optional: a
    `dynamic_sampling` attribute (the default of `config.dynamic_sampling`) and
    `group_weight(group) -> float` (a factor on a trained group's advantages)."""

    config: CurriculumConfig

    def sample(self, n: int, exclude: Iterable[str] = ()) -> list[TaskDraw]: ...

    def update(self, trajectories: Iterable[Trajectory]) -> None: ...

    def metrics(self) -> Any: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _success_rate(group: Sequence[Trajectory], threshold: float) -> float | None:
    """The share of the group's episodes (a harness episode's branch 0) that passed; None if none counts."""
    rewards = [t.reward for t in group if t.trainable and t.branch == 0]
    return sum(r >= threshold for r in rewards) / len(rewards) if rewards else None


class UniformSampler(Curriculum):
    """Every draw a task of the pool uniformly at random (a generator: the next new task), whatever is
    known about it; every group trained on unless `dynamic_sampling` says otherwise."""

    dynamic_sampling = False

    def sample(self, n: int, exclude: Iterable[str] = ()) -> list[TaskDraw]:
        if self.pool_size is None:  # an unbounded generator: a new task is a uniform draw
            return [draw for draw in (self._probe() for _ in range(n)) if draw is not None]
        excluded = set(exclude)
        by_index = {s.index: s for s in self.tasks.values()}
        free = [i for i in range(self.pool_size) if not (i in by_index and by_index[i].task_id in excluded)]
        return self._draw_from(free, n, excluded, by_index)

    def _draw_from(
        self, indices: list[int], n: int, excluded: set[str], by_index: dict[int, TaskStats]
    ) -> list[TaskDraw]:
        """Up to `n` distinct tasks of `indices`, uniformly: untracked ones become probes."""
        draws: list[TaskDraw] = []
        for j in self.rng.permutation(len(indices)):
            if len(draws) == n:
                break
            draw = self._draw_index(int(indices[int(j)]), excluded, by_index)
            if draw is not None:
                draws.append(draw)
        return draws

    def _draw_index(self, index: int, excluded: set[str], by_index: dict[int, TaskStats]) -> TaskDraw | None:
        stats = by_index.get(index)
        if stats is not None:
            if stats.task_id in excluded:
                return None
            excluded.add(stats.task_id)
            return TaskDraw(self.task_factory(index), index, "revisit", self.p_hat(stats.task_id))
        task = self.task_factory(index)
        if task.id in excluded or task.id in self.tasks:  # a pool with a repeated id: drawn once
            return None
        excluded.add(task.id)
        self.tasks[task.id] = stats = TaskStats(task.id, index, prior_value=self._prior_value(task))
        by_index[index] = stats
        return TaskDraw(task, index, "probe", None, group_size=self.config.probe_group_size)


class DapoSampler(UniformSampler):
    """Uniform draws with DAPO's dynamic sampling: zero-variance groups dropped, the batch refilled."""

    dynamic_sampling = True


@dataclass
class PoolsMetrics(CurriculumMetrics):
    easy_tasks: int
    normal_tasks: int
    hard_tasks: int


class DifficultyPools(UniformSampler):
    """prime-rl's difficulty pools (see the module docstring). A task's pool is decided by its last
    group: pass rate >= easy_threshold is easy, <= hard_threshold hard; untried tasks are normal."""

    dynamic_sampling = True

    def __init__(
        self,
        task_factory: Any,
        config: CurriculumConfig | None = None,
        pool_size: int | None = None,
        *,
        easy_threshold: float = 1.0,
        hard_threshold: float = 0.0,
        easy_fraction: float = 0.1,
        hard_fraction: float = 0.1,
    ) -> None:
        if not 0.0 <= hard_threshold < easy_threshold <= 1.0:
            raise UserError(
                f"curriculum.sampler_options: need 0 <= hard_threshold < easy_threshold <= 1, "
                f"got {hard_threshold} and {easy_threshold}"
            )
        if min(easy_fraction, hard_fraction) < 0.0 or easy_fraction + hard_fraction > 1.0:
            raise UserError(
                f"curriculum.sampler_options: easy_fraction and hard_fraction are shares of the draws "
                f"(>= 0, sum <= 1), got {easy_fraction} and {hard_fraction}"
            )
        super().__init__(task_factory, config, pool_size)
        self.easy_threshold, self.hard_threshold = easy_threshold, hard_threshold
        self.easy_fraction, self.hard_fraction = easy_fraction, hard_fraction
        self.last_rate: dict[str, float] = {}

    def update(self, trajectories: Iterable[Trajectory]) -> None:
        trajectories = list(trajectories)
        super().update(trajectories)
        for group in group_by_id(trajectories):
            if (rate := _success_rate(group, self.config.success_threshold)) is not None:
                self.last_rate[group[0].task_id] = rate

    def pool_of(self, task_id: str) -> str:
        rate = self.last_rate.get(task_id)
        if rate is not None and rate >= self.easy_threshold:
            return "easy"
        if rate is not None and rate <= self.hard_threshold:
            return "hard"
        return "normal"

    def sample(self, n: int, exclude: Iterable[str] = ()) -> list[TaskDraw]:
        excluded = set(exclude)
        by_index = {s.index: s for s in self.tasks.values()}
        pools: dict[str, list[int]] = {"easy": [], "hard": [], "normal": []}
        for stats in self.tasks.values():
            if stats.task_id not in excluded:
                pools[self.pool_of(stats.task_id)].append(stats.index)
        draws: list[TaskDraw] = []
        for _ in range(n):
            u = self.rng.random()
            name = (
                "easy"
                if u < self.easy_fraction
                else "hard"
                if u < self.easy_fraction + self.hard_fraction
                else ""
            )
            if name and pools[name]:
                index = pools[name].pop(int(self.rng.integers(len(pools[name]))))
                draw = self._draw_index(index, excluded, by_index)
            else:
                draw = self._normal(pools["normal"], excluded, by_index)
            if draw is None:
                break  # nothing left that is not in this batch
            draws.append(draw)
        return draws

    def _normal(
        self, tracked: list[int], excluded: set[str], by_index: dict[int, TaskStats]
    ) -> TaskDraw | None:
        """A normal task uniformly: of a finite pool, any task not easy or hard; of a generator, a new
        task with probability probe_prob (always while no tracked task is normal), else a tracked one."""
        if self.pool_size is None:
            if not tracked or self.rng.random() < self.config.probe_prob:
                return self._probe()
            return self._draw_index(tracked.pop(int(self.rng.integers(len(tracked)))), excluded, by_index)
        blocked = {s.index for s in self.tasks.values() if self.pool_of(s.task_id) != "normal"}
        free = [i for i in range(self.pool_size) if i not in blocked]
        drawn = self._draw_from(free, 1, excluded, by_index)
        if drawn and drawn[0].index in tracked:
            tracked.remove(drawn[0].index)
        return drawn[0] if drawn else None

    def metrics(self) -> PoolsMetrics:
        sizes = {"easy": 0, "normal": 0, "hard": 0}
        for task_id in self.tasks:
            sizes[self.pool_of(task_id)] += 1
        if self.pool_size is not None:  # untried tasks of a finite pool are normal too
            sizes["normal"] += self.pool_size - len(self.tasks)
        return PoolsMetrics(
            **asdict(super().metrics()),
            easy_tasks=sizes["easy"],
            normal_tasks=sizes["normal"],
            hard_tasks=sizes["hard"],
        )

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "last_rate": dict(self.last_rate)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.last_rate = {k: float(v) for k, v in state.get("last_rate", {}).items()}


class MgpoSampler(DapoSampler):
    """Uniform draws (zero-variance groups dropped, as they carry no gradient), each trained group's
    advantages times exp(-strength · KL(p ‖ 1/2)), p its pass rate: 1 at p = 1/2, 2^-strength at 0 or 1."""

    def __init__(
        self,
        task_factory: Any,
        config: CurriculumConfig | None = None,
        pool_size: int | None = None,
        *,
        strength: float = 2.0,
    ) -> None:
        if strength < 0.0:
            raise UserError(f"curriculum.sampler_options.strength must be >= 0, got {strength}")
        super().__init__(task_factory, config, pool_size)
        self.strength = strength

    def group_weight(self, group: Sequence[Trajectory]) -> float:
        p = _success_rate(group, self.config.success_threshold)
        if p is None:
            return 1.0
        # KL(Bernoulli(p) ‖ Bernoulli(1/2)) = p ln 2p + (1 - p) ln 2(1 - p), with 0 ln 0 = 0.
        kl = sum(q * math.log(2.0 * q) for q in (p, 1.0 - p) if q > 0.0)
        return math.exp(-self.strength * kl)


def load_sampler(name: str) -> Any:
    """The class (or factory) `curriculum.sampler: name` refers to; a one-line UserError if none."""
    plugins = names.SAMPLERS
    if name in plugins:
        return plugins.get(name)  # a plugin that does not import: a one-line PluginError (a UserError)
    if ":" not in name:
        raise UserError(
            f"curriculum.sampler {name!r} is not a sampler; available: {', '.join(plugins.names())} "
            f"(a package adds one in the entry-point group {plugins.group!r}), or give module:attribute"
        )
    module, _, attribute = name.partition(":")
    try:
        from agentrl.env.registry import import_user_module

        obj: Any = import_user_module(module)
        for part in attribute.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"curriculum.sampler {name!r}: cannot load {name!r}: {exc}") from exc
    return obj


def build_sampler(source: Any, config: CurriculumConfig | None = None, split: Split = "train") -> Any:
    """The sampler `config` asks for over the tasks of `split` of anything `ToolEnv(tasks=...)` accepts."""
    config = config if config is not None else CurriculumConfig()
    name = "leveled" if config.difficulty.adaptive else config.sampler
    factory = load_sampler(name)
    make = getattr(factory, "from_source", factory)
    try:
        sampler = make(as_task_source(source), config, split, **config.sampler_options)
    except TypeError as exc:
        raise UserError(
            f"curriculum.sampler {name!r} does not take curriculum.sampler_options "
            f"{sorted(config.sampler_options)}: {exc}"
        ) from exc
    if not isinstance(sampler, Sampler):
        missing = [
            m
            for m in ("sample", "update", "metrics", "state_dict", "load_state_dict", "config")
            if not hasattr(sampler, m)
        ]
        raise UserError(
            f"curriculum.sampler {name!r} made a {type(sampler).__name__} without {', '.join(missing)}"
        )
    return sampler


def metrics_of(sampler: Any) -> dict[str, Any]:
    """A sampler's metrics as `curriculum/<name>` entries (an object with `as_dict()`, or a mapping)."""
    metrics = sampler.metrics()
    if hasattr(metrics, "as_dict"):
        return dict(metrics.as_dict())
    if isinstance(metrics, Mapping):
        return {k if k.startswith("curriculum/") else f"curriculum/{k}": v for k, v in metrics.items()}
    raise UserError(
        f"{type(sampler).__name__}.metrics() returned {type(metrics).__name__}; return a mapping of numbers"
    )
