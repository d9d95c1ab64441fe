"""The names `curriculum.sampler` accepts, without importing a sampler: the built-in ones and the
installed plugins' (the entry-point group `agentrl.samplers`). `samplers` maps them to classes."""

from __future__ import annotations

from importlib.metadata import entry_points

ENTRY_POINT_GROUP = "agentrl.samplers"

BUILTIN_NAMES = ("band", "uniform", "dapo", "pools", "mgpo", "leveled")


def available_samplers() -> list[str]:
    """The names `curriculum.sampler` accepts: the built-in ones, then the installed plugins'."""
    plugins = sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name not in BUILTIN_NAMES)
    return [*BUILTIN_NAMES, *plugins]
