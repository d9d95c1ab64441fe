"""The curriculum: which tasks the next batch trains on.

- `config`: `CurriculumConfig`, the `curriculum` section of `agentrl train`'s config;
- `band`: `Curriculum`, a pass-rate estimate per task and the learnability-band sampler (tasks the
  policy solves about half the time, where GRPO's gradient is largest);
- `dynamic`: `DynamicBatch`, DAPO's dynamic sampling: zero-variance groups dropped and the batch
  refilled from the sampler;
- `leveled`: `LeveledCurriculum`, the band sampler whose probes come from a leveled task generator at
  a difficulty level that rises with the policy (`curriculum.difficulty.adaptive`).

`build_curriculum(source, config)` is the one way from a config to a curriculum. The curriculum only
picks tasks and records what their groups scored; the rollout producer (`agentrl.train.producer`)
plays the episodes and drives `DynamicBatch`.
"""

from __future__ import annotations

from typing import Any

from agentrl.tasksource import as_task_source
from agentrl.train.curriculum.band import Curriculum, CurriculumMetrics, TaskDraw, TaskStats, group_by_id
from agentrl.train.curriculum.config import CurriculumConfig, DifficultySettings
from agentrl.train.curriculum.dynamic import (
    BatchMetrics,
    DynamicBatch,
    DynamicBatchResult,
    Group,
    filter_groups,
)
from agentrl.train.curriculum.leveled import (
    LeveledCurriculum,
    LeveledMetrics,
    LeveledTaskGenerator,
    leveled_generator,
)
from agentrl.types import Split

__all__ = [
    "BatchMetrics",
    "Curriculum",
    "CurriculumConfig",
    "CurriculumMetrics",
    "DifficultySettings",
    "DynamicBatch",
    "DynamicBatchResult",
    "Group",
    "LeveledCurriculum",
    "LeveledMetrics",
    "LeveledTaskGenerator",
    "TaskDraw",
    "TaskStats",
    "build_curriculum",
    "filter_groups",
    "group_by_id",
]


def build_curriculum(
    source: Any, config: CurriculumConfig | None = None, split: Split = "train"
) -> Curriculum:
    """The curriculum `config` asks for over the tasks of `split` of anything `ToolEnv(tasks=...)`
    accepts: a generator (unbounded), or a list, JSONL file or `datasets.Dataset` (a finite pool).

    With `difficulty.adaptive`, a `LeveledCurriculum` over the source's leveled generator (task i is
    made at the level the curriculum steers); otherwise the band sampler over task i = the source's
    task i of `split`.
    """
    config = config if config is not None else CurriculumConfig()
    src = as_task_source(source)
    if config.difficulty.adaptive:
        return LeveledCurriculum(leveled_generator(src), config, split)
    return Curriculum(lambda index: src.get(index, split), config, pool_size=src.size(split))
