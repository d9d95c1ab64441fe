"""`agentrl/calc-levels-v0`: calc-v0's arithmetic in difficulty levels, for curricula that need a range.

The same environment as `agentrl/calc-v0` (instructions, tools, verifier, oracle), so a calc-v0
warm start plays it as it is; only the tasks differ: "What is <expression>?", the expression
longer at each level (`LADDER`):

    level 0: 47 + 12                                1 operation, 2-digit operands
    level 1: 347 - 912                              1 operation, calc-v0's operands (2..999)
    level 2: (507 + 771) * 40                       2 operations
    level 3: (327) * 29 - 901 - 301                 3 operations (calc-v0's longest)
    level 4: 152 + 513 - 235 + 599 + 327            4 operations
    level 5: (144 + 217) * 74 + 822 - 391 - 18      5 operations

A tiny model's failures on calc are copying slips (a digit of the expression into the python call,
a digit of the printed number into `submit`), so its pass rate falls with the length it must copy;
beyond the lengths it was trained on it falls off a cliff. For the calc-v0 warm start, levels 0-1
are mostly solved, 2-3 are in the learnability band and 4-5 are not solved at all (measured in
benchmarks/RESULTS.md).

`LeveledCalcTasks.generate_at(index, split, level)` is task `index` at `level`: a pure function of
(seed, split, index, level). `generate(index, split)` is the *mixed pool*: task `index` picks its own
level, uniformly and as a pure function of (seed, split, index), so every consumer of the generator
(every arm of a benchmark) sees the same tasks; with `level=` set, every task has that level. Ids
name the level: `calc-levels/train/L3/17`. `mix` weights the levels of the mixed pool instead:
`mix="swe-like"` (`SWE_LIKE_MIX`) makes the calc-v0 warm start's pool look like a small model's on
SWE-style tasks (most never solved, a few always, a quarter in between; measured in
benchmarks/RESULTS.md).

A generator with `levels` and `generate_at` is a *leveled generator*
(`agentrl.train.curriculum.leveled`): the curriculum can steer its level with its probes
(`curriculum.difficulty.adaptive`).
"""

from __future__ import annotations

import random
from typing import Any

from pydantic import Field, model_validator

from agentrl.core.task import Split, Task, split_rng_seed
from agentrl.env.tasksource import TaskSource
from agentrl.envs.calc import CalcEnv, CalcSettings

# level -> (operations, range of the first number and of the + and - operands). Multiplication's
# operand is 2..99 and products inside longer expressions are parenthesised, as calc-v0 writes them.
LADDER: tuple[tuple[int, tuple[int, int]], ...] = (
    (1, (10, 99)),
    (1, (2, 999)),
    (2, (2, 999)),
    (3, (2, 999)),
    (4, (2, 999)),
    (5, (2, 999)),
)


SWE_LIKE_MIX: tuple[float, ...] = (0.10, 0.15, 0.15, 0.10, 0.20, 0.30)
"""Level weights of the mixed pool (`mix="swe-like"`): for the calc-v0 warm start, whose pass rate
by level falls from always (level 1) through the band (0, 2, 3) to never (4, 5), a pool where
most tasks are never solved, a few always and about a quarter sometimes."""


def level_mix(mix: Any, levels: int) -> tuple[float, ...] | None:
    """`mix` as one weight per level: None (uniform), "swe-like", or a sequence of `levels` weights."""
    if mix is None:
        return None
    if mix == "swe-like":
        mix = SWE_LIKE_MIX[:levels]
    if isinstance(mix, str):
        raise ValueError(f"mix must be 'swe-like' or a weight per level, got {mix!r}")
    weights = tuple(float(w) for w in mix)
    if len(weights) != levels or min(weights) < 0 or sum(weights) <= 0:
        raise ValueError(
            f"mix needs {levels} non-negative weights (one per level) with a positive sum, got {mix!r}"
        )
    return weights


class LeveledCalcTasks:
    """Arithmetic tasks by difficulty level (see the module docstring); `levels` takes the ladder's first N."""

    def __init__(self, seed: int = 0, levels: int = len(LADDER), level: int | None = None, mix: Any = None):
        if not 1 <= levels <= len(LADDER):
            raise ValueError(f"levels must be in 1..{len(LADDER)}, got {levels}")
        if level is not None and not 0 <= level < levels:
            raise ValueError(f"level must be in 0..{levels - 1} (levels={levels}), got {level}")
        self.seed = seed
        self.levels = levels
        self.level = level
        self.mix = level_mix(mix, levels)

    def level_of(self, index: int, split: Split = "train") -> int:
        """The level of task `index` of the mixed pool (the fixed `level` when one is set)."""
        if self.level is not None:
            return self.level
        rng = random.Random(split_rng_seed(self.seed, split, index) ^ 0x5EED)
        if self.mix is None:
            return rng.randrange(self.levels)
        return rng.choices(range(self.levels), weights=self.mix)[0]

    def generate(self, index: int, split: Split = "train") -> Task:
        return self.generate_at(index, split, self.level_of(index, split))

    def generate_at(self, index: int, split: Split, level: int) -> Task:
        if not 0 <= level < self.levels:
            raise ValueError(f"level must be in 0..{self.levels - 1}, got {level}")
        rng = random.Random(split_rng_seed(self.seed, split, index) * 64 + level)
        ops, (low, high) = LADDER[level]
        expression = str(rng.randint(low, high))
        for _ in range(ops):
            op = rng.choice(["+", "-", "*"])
            operand = rng.randint(2, 99) if op == "*" else rng.randint(low, high)
            expression = (
                f"({expression}) {op} {operand}" if op == "*" and ops > 1 else f"{expression} {op} {operand}"
            )
        answer = eval(expression, {"__builtins__": {}})  # our own generated arithmetic, never model text
        return Task(
            id=f"calc-levels/{split}/L{level}/{index}",
            prompt=f"What is {expression}?\nUse the python tool to compute the answer, then submit just the number.",
            answer=str(answer),
            split=split,
            metadata={"kind": "arithmetic", "level": level, "expression": expression},
        )


class CalcLevelsSettings(CalcSettings):
    """calc-levels-v0's settings: calc-v0's, and which levels its tasks come from."""

    levels: int = Field(
        len(LADDER),
        ge=1,
        le=len(LADDER),
        description=f"How many levels of the ladder the pool has (the first N of {len(LADDER)}).",
    )
    level: int | None = Field(
        None,
        ge=0,
        description="Every task at this level (0 .. levels-1); None: the mixed pool, each task its own level.",
    )
    mix: str | list[float] | None = Field(
        None,
        description="Level weights of the mixed pool: one per level, or 'swe-like' (most tasks never solved "
        "by the calc-v0 warm start, a few always, a quarter sometimes); None: every level equally likely.",
    )

    @model_validator(mode="after")
    def _level_in_range(self) -> CalcLevelsSettings:
        if self.level is not None and self.level >= self.levels:
            raise ValueError(
                f"level must be in 0..{self.levels - 1} (levels={self.levels}), got {self.level}"
            )
        level_mix(self.mix, self.levels)
        return self


class CalcLevelsEnv(CalcEnv):
    """calc-v0 with `LeveledCalcTasks`: `level=None` (default) is the mixed pool, an int fixes the level."""

    settings_model = CalcLevelsSettings

    @classmethod
    def make_tasks(
        cls,
        *,
        tasks: Any = None,
        seed: int = 0,
        levels: int = len(LADDER),
        level: int | None = None,
        mix: Any = None,
        env_id: str | None = None,
        **kwargs: Any,
    ) -> TaskSource | None:
        """The leveled pool (not calc-v0's generator), for the constructor and `agentrl.task_source`."""
        return super().make_tasks(
            tasks=tasks if tasks is not None else LeveledCalcTasks(seed, levels, level, mix),
            seed=seed,
            env_id=env_id,
        )
