"""Old module paths, kept importable for a while: `import agentrl.policy` still works, with a
DeprecationWarning that names the new path (the flat modules moved into stage packages;
docs/LAYOUT.md has the map).

An old path is a thin module that forwards attribute reads to the new one (PEP 562 `__getattr__`),
so `from agentrl.policy import VLLMPolicy` gives the very class `agentrl.rollout.policy` defines.
Patching the old module does not patch the new one: patch the new path. The two old modules whose
names are now packages (`agentrl.rollout`, `agentrl.train`) forward their old public names from the
package instead (`forward_old_names`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

MOVED: dict[str, str] = {
    # rollout: stage 2
    "agentrl.policy": "agentrl.rollout.policy",
    "agentrl.masker": "agentrl.rollout.masker",
    "agentrl.trajectory": "agentrl.rollout.trajectory",
    # train: stage 3
    "agentrl.train_config": "agentrl.train.config",
    "agentrl.grpo": "agentrl.train.grpo",
    "agentrl.batch": "agentrl.train.batch",
    "agentrl.packing": "agentrl.train.packing",
    "agentrl.varlen": "agentrl.train.varlen",
    "agentrl.logprobs": "agentrl.train.logprobs",
    "agentrl.curriculum": "agentrl.train.curriculum",
    "agentrl.distributed": "agentrl.train.distributed",
    "agentrl.placement": "agentrl.train.placement",
    "agentrl.weight_sync": "agentrl.train.weight_sync",
    "agentrl.checkpoint": "agentrl.train.checkpoint",
    "agentrl.tracking": "agentrl.train.tracking",
    "agentrl.peak_memory": "agentrl.train.peak_memory",
    "agentrl.sft": "agentrl.train.sft",
    # eval: stage 4
    "agentrl.evaluate": "agentrl.eval.evaluate",
    "agentrl.passk": "agentrl.eval.passk",
    "agentrl.report": "agentrl.eval.report",
    # kit: the tiny model and the demo, on top of the core
    "agentrl.model_kit": "agentrl.kit.tiny_model",
    "agentrl.tokenizer_kit": "agentrl.kit.tokenizer",
    "agentrl.demos": "agentrl.kit.demonstrations",
    "agentrl.demo": "agentrl.kit.demo",
    "agentrl.warm_start": "agentrl.kit.warm_start",
    # renamed in place
    "agentrl.checker": "agentrl.env_check",
}
"""Old module path -> new module path."""

MOVED_INTO_PACKAGE: dict[str, str] = {
    "agentrl.rollout": "agentrl.rollout.loop",
    "agentrl.train": "agentrl.train.trainer",
}
"""An old module whose name is now a package -> the module that holds its old contents."""


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"{old} moved to {new}; import it from there ({old} will be removed)",
        DeprecationWarning,
        stacklevel=3,
    )


class _Forward(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a plain module, filled in below

    def exec_module(self, module: ModuleType) -> None:
        _warn(module.__name__, self.new)
        target = importlib.import_module(self.new)
        module.__getattr__ = lambda name: getattr(target, name)  # type: ignore[method-assign]
        module.__dir__ = lambda: dir(target)  # type: ignore[method-assign]
        module.__doc__ = f"Moved to {self.new}."


class _OldPaths(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        return importlib.util.spec_from_loader(fullname, _Forward(new)) if new else None


def install() -> None:
    """Make the old paths importable (once; `import agentrl` calls it)."""
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.append(_OldPaths())


def forward_old_names(package: str, name: str) -> Any:
    """For a package's `__getattr__`: a public name the old module of that path defined, from where it
    lives now (with a DeprecationWarning); AttributeError for anything else."""
    new = MOVED_INTO_PACKAGE[package]
    if not name.startswith("_"):
        module = importlib.import_module(new)
        value = getattr(module, name, None)
        if value is not None and getattr(value, "__module__", None) == new:
            _warn(f"{package}.{name}", f"{new}.{name}")
            return value
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
