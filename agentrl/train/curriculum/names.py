"""The names `curriculum.sampler` accepts, without importing a sampler: the built-in ones and the
installed plugins' (the entry-point group `agentrl.samplers`). `samplers.load_sampler` imports them."""

from __future__ import annotations

from typing import Any

from agentrl.core.plugins import Plugins

ENTRY_POINT_GROUP = "agentrl.samplers"

_HERE = "agentrl.train.curriculum"
# Strings, imported when first asked for: naming a sampler (a config's validation) imports none.
_BUILTINS = {
    "band": f"{_HERE}.band:Curriculum",
    "uniform": f"{_HERE}.samplers:UniformSampler",
    "dapo": f"{_HERE}.samplers:DapoSampler",
    "pools": f"{_HERE}.samplers:DifficultyPools",
    "mgpo": f"{_HERE}.samplers:MgpoSampler",
    "leveled": f"{_HERE}.leveled:LeveledCurriculum",
}
BUILTIN_NAMES = tuple(_BUILTINS)

SAMPLERS: Plugins[Any] = Plugins(ENTRY_POINT_GROUP, "curriculum sampler", builtins=_BUILTINS)


def available_samplers() -> list[str]:
    """The names `curriculum.sampler` accepts: the built-in ones, then the installed plugins'."""
    return SAMPLERS.names()
