"""The curriculum: which tasks the next batch trains on.

- `config`: `CurriculumConfig`, the `curriculum` section of `agentrl train`'s config;
- `band`: `Curriculum`, a pass-rate estimate per task and the learnability-band sampler (tasks the
  policy solves about half the time, where GRPO's gradient is largest);
- `dynamic`: `DynamicBatch`, DAPO's dynamic sampling: zero-variance groups dropped and the batch
  refilled from the sampler;
- `leveled`: `LeveledCurriculum`, the band sampler whose probes come from a leveled task generator at
  a difficulty level that rises with the policy (`curriculum.difficulty.adaptive`);
- `samplers`: the other built-in samplers (uniform, dapo, pools, mgpo), the `Sampler` protocol and
  the registry `curriculum.sampler` names them in (plugins: the entry-point group `agentrl.samplers`).

`build_curriculum(source, config)` is the one way from a config to a sampler. The sampler only
picks tasks and records what their groups scored; the rollout producer (`agentrl.train.producer`)
plays the episodes and drives `DynamicBatch`.
"""

from __future__ import annotations

from typing import Any

from agentrl.core.types import Split
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
from agentrl.train.curriculum.samplers import (
    ENTRY_POINT_GROUP,
    DapoSampler,
    DifficultyPools,
    MgpoSampler,
    Sampler,
    UniformSampler,
    available_samplers,
    build_sampler,
    load_sampler,
    metrics_of,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "BatchMetrics",
    "Curriculum",
    "CurriculumConfig",
    "CurriculumMetrics",
    "DapoSampler",
    "DifficultyPools",
    "DifficultySettings",
    "DynamicBatch",
    "DynamicBatchResult",
    "Group",
    "LeveledCurriculum",
    "LeveledMetrics",
    "LeveledTaskGenerator",
    "MgpoSampler",
    "Sampler",
    "TaskDraw",
    "TaskStats",
    "UniformSampler",
    "available_samplers",
    "build_curriculum",
    "build_sampler",
    "filter_groups",
    "group_by_id",
    "leveled_generator",
    "load_sampler",
    "metrics_of",
]


def build_curriculum(source: Any, config: CurriculumConfig | None = None, split: Split = "train") -> Any:
    """The sampler `config` asks for (`curriculum.sampler`, the band by default) over the tasks of
    `split` of anything `ToolEnv(tasks=...)` accepts: a generator (unbounded), or a list, JSONL file or
    `datasets.Dataset` (a finite pool). With `difficulty.adaptive`, the `leveled` sampler over the
    source's leveled generator."""
    return build_sampler(source, config, split)
