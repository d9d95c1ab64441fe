"""Difficulty that rises with the policy: the curriculum's probes steer a generator's difficulty level.

The learnability band keeps training on tasks solved about half the time, but it can only choose
among the tasks its probes found. As the policy improves, tasks drift out of the band on the easy
side; with a fixed task distribution fewer and fewer probes land in the band, and at some point
there is nothing left to learn from. "Difficulty must rise with capability" (seed 002, §14): with
a *leveled* generator (one that can make task i at any of its `levels`), `LeveledCurriculum` draws
its probes at a current level and steers that level so that its probes pass about half the time
(`difficulty.target`, 0.5: where p(1 - p), the reward variance, is largest):

- each probe's first group gives its pass rate (successes / episodes);
- once the last `min_probes` probes at the current level are in, a mean pass rate above
  target + tolerance moves the level up one, below target - tolerance down one; the window then
  starts over at the new level (a probe drawn before a move says nothing about the new level).

The mean of the probes' pass rates, not the share of probes outside the band, because a group of 8
rarely shows a task above a 0.8 band edge (a task passed 90% of the time is all-pass in only 43% of
its groups), so a level whose tasks all pass ~85% of the time would look "in band" for ever: the
first version of this rule kept the benchmark's adaptive arm on its easiest level for a whole run.

Band draws and re-probes are those of `Curriculum` (tracked tasks of every level, weighted
p̂(1 - p̂)); only where new tasks come from changes. Switch it on with
`curriculum.difficulty.adaptive: true`; `build_curriculum` then builds a `LeveledCurriculum`.

A task is tracked by one integer index, so that `TaskStats` and the checkpointed state stay those of
`Curriculum`: `n * levels + level` for the generator's task n at `level`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

from agentrl.core.errors import UserError
from agentrl.core.task import Split, Task
from agentrl.rollout.trajectory import Trajectory
from agentrl.train.curriculum.band import Curriculum, CurriculumMetrics, TaskDraw, TaskStats, group_by_id
from agentrl.train.curriculum.config import CurriculumConfig


@runtime_checkable
class LeveledTaskGenerator(Protocol):
    """A task generator with a difficulty knob: task `index` at `level` (0 = easiest), a pure function
    of (its seed, split, index, level). `agentrl.envs.calc_levels.LeveledCalcTasks` is one."""

    levels: int

    def generate(self, index: int, split: Split = "train") -> Task: ...

    def generate_at(self, index: int, split: Split, level: int) -> Task: ...


def leveled_generator(source: Any) -> LeveledTaskGenerator:
    """The leveled generator behind a task source (`agentrl.env.tasksource.as_task_source`'s view of one);
    a source without difficulty levels is a `UserError` that says which environments have them."""
    generator = getattr(source, "source", source)  # a lazily loaded source: what it loaded
    generator = getattr(generator, "generator", generator)
    if not isinstance(generator, LeveledTaskGenerator):
        raise UserError(
            f"curriculum.difficulty.adaptive needs a task generator with difficulty levels (a `levels` "
            f"count and generate_at(index, split, level)); {getattr(source, 'name', 'this environment')} "
            "has none. Use e.g. agentrl/calc-levels-v0, or set curriculum.difficulty.adaptive=false"
        )
    return generator


@dataclass
class LeveledMetrics(CurriculumMetrics):
    level: int = 0  # the level new probes are drawn at
    level_moves: int = 0  # moves so far (up or down)


class LeveledCurriculum(Curriculum):
    """`Curriculum` whose probes come from a leveled generator at a level steered by their outcomes."""

    @classmethod
    def from_source(cls, source: Any, config: CurriculumConfig, split: Split = "train", **options: Any):
        return cls(leveled_generator(source), config, split, **options)

    def __init__(
        self, generator: LeveledTaskGenerator, config: CurriculumConfig | None = None, split: Split = "train"
    ):
        config = config if config is not None else CurriculumConfig()
        self.num_levels = int(generator.levels)
        settings = config.difficulty
        if not 0 <= settings.start_level < self.num_levels:
            raise UserError(
                f"curriculum.difficulty.start_level is {settings.start_level}, but the task generator has "
                f"{self.num_levels} levels (0..{self.num_levels - 1})"
            )
        levels = self.num_levels

        def make(index: int) -> Task:
            task = generator.generate_at(index // levels, split, index % levels)
            if not isinstance(task, Task):
                raise UserError(
                    f"{type(generator).__name__}.generate_at({index // levels}, {split!r}, {index % levels}) "
                    f"returned {type(task).__name__}, not an agentrl.Task"
                )
            return task

        super().__init__(make, config, pool_size=None)
        self.level = settings.start_level
        self.window: deque[float] = deque(maxlen=settings.min_probes)  # pass rates of probes at this level
        self.pending: dict[str, int] = {}  # probed task id -> its level, until its first group is in
        self.moves: list[dict[str, int]] = []  # {"probes": judged so far, "level": the new level}
        self.judged = 0

    # -- probes at the current level --------------------------------------------------------------

    def _probe(self) -> TaskDraw | None:
        for _ in range(10_000):
            index = self.next_index * self.num_levels + self.level
            self.next_index += 1
            task = self.task_factory(index)
            if task.id not in self.tasks:
                self.tasks[task.id] = TaskStats(task_id=task.id, index=index)
                self.pending[task.id] = self.level
                return TaskDraw(task, index, "probe", None, group_size=self.config.probe_group_size)
        raise RuntimeError(
            f"the leveled generator returned 10000 already-tracked ids in a row at level {self.level}; "
            "it must give distinct task ids for distinct (index, level)"
        )

    def update(self, trajectories: Iterable[Trajectory]) -> None:
        trajectories = list(trajectories)
        super().update(trajectories)
        threshold = self.config.success_threshold
        for group in group_by_id(trajectories):
            level = self.pending.pop(group[0].task_id, None)
            rewards = [t.reward for t in group if t.trainable]
            if level is not None and rewards:
                self.judge(level, sum(r >= threshold for r in rewards) / len(rewards))

    def judge(self, level: int, pass_rate: float) -> None:
        """Count one probe's pass rate at `level`, and move the level when the window says so."""
        self.judged += 1
        if level != self.level:
            return
        self.window.append(pass_rate)
        settings = self.config.difficulty
        if len(self.window) < settings.min_probes:
            return
        mean = sum(self.window) / len(self.window)
        if mean > settings.target + settings.tolerance and self.level < self.num_levels - 1:
            self._move(+1)
        elif mean < settings.target - settings.tolerance and self.level > 0:
            self._move(-1)

    def _move(self, step: int) -> None:
        self.level += step
        self.window.clear()
        self.moves.append({"probes": self.judged, "level": self.level})

    # -- metrics and state --------------------------------------------------------------------------

    def metrics(self) -> LeveledMetrics:
        base = super().metrics()
        return LeveledMetrics(**asdict(base), level=self.level, level_moves=len(self.moves))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["leveled"] = {
            "level": self.level,
            "window": list(self.window),
            "pending": dict(self.pending),
            "moves": list(self.moves),
            "judged": self.judged,
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        leveled = state.get("leveled")
        if leveled is None:
            raise ValueError(
                "this curriculum state has no difficulty level: it was saved with curriculum.difficulty.adaptive "
                "off; resume with the same setting, or start a new run"
            )
        self.level = int(leveled["level"])
        self.window = deque(leveled["window"], maxlen=self.config.difficulty.min_probes)
        self.pending = {k: int(v) for k, v in leveled["pending"].items()}
        self.moves = list(leveled["moves"])
        self.judged = int(leveled["judged"])
