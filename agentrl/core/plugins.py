"""One way in for every kind of plugin: an entry-point group, one loader, errors that name what is installed.

Five kinds of plugin reach agentrl through `importlib.metadata` entry points, each kind one `Plugins`:

| group                      | an entry point names                                   | held by                                |
|----------------------------|--------------------------------------------------------|----------------------------------------|
| `agentrl.envs`             | a function that registers env ids (called once)        | `agentrl.env.registry.ENV_PLUGINS`         |
| `agentrl.verifiers`        | a verifier factory, `factory(**kwargs) -> Verifier`    | `agentrl.verifiers.base.VERIFIERS`     |
| `agentrl.samplers`         | a curriculum sampler class                             | `agentrl.train.curriculum.names.SAMPLERS` |
| `agentrl.attacks`          | a verifier-audit attack (a class or an instance)       | `agentrl.checks.audit.ATTACK_PLUGINS`  |
| `agentrl.sandbox_backends` | a sandbox class (`agentrl.sandbox.base.SandboxBase`)   | `agentrl.sandbox.base.BACKENDS`        |

A `Plugins` holds the built-ins and whatever was registered in code, by name: the object itself, or a
`"module:attribute"` string imported on first use (so that a backend's SDK costs nothing until that
backend is asked for). The group's entry points are listed once per process (one lock, one flag) and
join under their names, unless the name is taken: what the code registered wins. Nothing is imported
to list names. `get(name)` imports one entry on first use; an entry that fails to import raises a
`PluginError` in one line (the plugin, its target, its group, the cause); `load_all()` imports every
entry and warns about a broken one instead, so one broken package does not take the others down.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from agentrl.core.errors import UserError, did_you_mean

__all__ = ["PluginError", "Plugins", "UnknownPluginError", "load_target"]

T = TypeVar("T")

_UNLOADED: Any = object()


class PluginError(UserError, ImportError):
    """A plugin was found but could not be loaded (its module does not import, its attribute is missing,
    or what it names is not a plugin of its kind)."""


class UnknownPluginError(UserError, KeyError, ValueError):
    """No plugin of that kind is registered or installed under that name (the message lists those that are).
    A KeyError (a name looked up) and a ValueError (a setting with a bad value) alike, as callers caught before."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def load_target(target: str) -> Any:
    """The object a `"package.module:attribute.path"` string names (an entry point's value)."""
    module, colon, attribute = target.partition(":")
    if not colon or not module or not attribute:
        raise ValueError(f"{target!r} must look like 'package.module:attribute'")
    obj: Any = importlib.import_module(module)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass
class _Entry:
    name: str
    target: str | None  # "module:attribute" to import, None for an object given as is
    source: str  # where it came from, for messages: "built in", "registered", "entry point of dist 1.0"
    value: Any = _UNLOADED  # the object given, then (once loaded) what on_load made of it
    loaded: bool = False
    error: str | None = None  # why it failed to load: said once, not retried
    installed: bool = False  # an entry point's (not a built-in, not registered in code)


class Plugins(Generic[T]):
    """The plugins of one kind: built-ins and registered ones by name, then the group's entry points.

    group: the entry-point group (`agentrl.verifiers`); kind: what one plugin is, for messages ("verifier");
    builtins: name -> object or "module:attribute"; on_load: applied once to each imported object, its
    result is what `get` returns (a check of its type, a registration call, an instance made of a class).
    """

    def __init__(
        self,
        group: str,
        kind: str,
        *,
        builtins: Mapping[str, T | str] | None = None,
        on_load: Callable[[str, Any], T] | None = None,
    ) -> None:
        self.group = group
        self.kind = kind
        self._on_load = on_load
        self._entries: dict[str, _Entry] = {}
        # Re-entrant: importing a plugin may register more plugins of the same kind.
        self._lock = threading.RLock()
        self._discovered = False
        for name, value in (builtins or {}).items():
            self._add(name, value, "built in")

    # --- adding ----------------------------------------------------------------------------------

    def register(self, name: str, value: T | str, *, override: bool = False) -> None:
        """Add `value` (the plugin, or a "module:attribute" string imported on first use) under `name`.
        A name already taken by something else raises, unless `override`."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} needs a non-empty name, got {name!r}")
        with self._lock:
            old = self._entries.get(name)
            if old is not None and not override and not self._same(old, value):
                raise ValueError(
                    f"a {self.kind} named {name!r} is already registered ({old.source}); pass override=True "
                    "to replace it"
                )
            self._add(name, value, "registered")

    def _add(self, name: str, value: Any, source: str) -> None:
        if isinstance(value, str):
            if ":" not in value:
                raise ValueError(f"{self.kind} {name!r}: {value!r} must look like 'package.module:attribute'")
            self._entries[name] = _Entry(name, value, source)
        else:
            self._entries[name] = _Entry(name, None, source, value)

    @staticmethod
    def _same(entry: _Entry, value: Any) -> bool:
        if isinstance(value, str):
            return entry.target == value
        return entry.value is value

    def discover(self) -> None:
        """List the group's installed entry points (once per process; nothing is imported)."""
        with self._lock:
            if self._discovered:
                return
            self._discovered = True
            for ep in importlib.metadata.entry_points(group=self.group):
                if ep.name in self._entries:
                    continue  # what the code registered (a built-in included) wins
                dist = getattr(ep, "dist", None)
                source = f"entry point of {dist.name} {dist.version}" if dist is not None else "entry point"
                self._entries[ep.name] = _Entry(ep.name, ep.value, source, installed=True)

    def rescan(self) -> None:
        """Forget the entry points not imported yet and list the group again on next use (a package
        installed after the first look, as tests do)."""
        with self._lock:
            for name in [n for n, e in self._entries.items() if e.installed and not e.loaded]:
                del self._entries[name]
            self._discovered = False

    # --- reading ---------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Every name: the built-ins and registered ones in their order, then the entry points', sorted."""
        self.discover()
        with self._lock:
            own = [n for n, e in self._entries.items() if not e.installed]
            installed = sorted(n for n, e in self._entries.items() if e.installed)
        return own + installed

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        if name not in self._entries:
            self.discover()
        return name in self._entries

    def __len__(self) -> int:
        return len(self.names())

    def target(self, name: str) -> str | None:
        """The "module:attribute" `name` loads from (None for an object registered as is); nothing is imported."""
        return self._entry(name).target

    def source(self, name: str) -> str:
        """Where `name` came from: "built in", "registered", or the entry point's distribution."""
        return self._entry(name).source

    def get(self, name: str) -> T:
        """The plugin named `name`, imported on first use. Unknown: `UnknownPluginError`; broken: `PluginError`."""
        entry = self._entry(name)
        with self._lock:
            if not entry.loaded:
                self._load(entry)
            return entry.value

    def load_all(self) -> dict[str, T]:
        """Every plugin, imported; one that fails warns (one line) and is left out."""
        loaded: dict[str, T] = {}
        for name in self.names():
            known_broken = self._entries[name].error is not None
            try:
                loaded[name] = self.get(name)
            except PluginError as exc:
                if not known_broken:
                    warnings.warn(str(exc), stacklevel=2)
        return loaded

    def copy(self) -> Plugins[T]:
        """An independent copy (the same entries, the same discovery state): tests register into it."""
        other: Plugins[T] = Plugins(self.group, self.kind, on_load=self._on_load)
        with self._lock:
            other._entries = {n: dataclasses.replace(e) for n, e in self._entries.items()}
            other._discovered = self._discovered
        return other

    @contextlib.contextmanager
    def isolated(self) -> Iterator[Plugins[T]]:
        """Within the block, registrations and rescans change this object as usual; after it, it is as it
        was before (for tests that install a plugin, wherever the object is referenced from)."""
        with self._lock:
            saved = {n: dataclasses.replace(e) for n, e in self._entries.items()}, self._discovered
        try:
            yield self
        finally:
            with self._lock:
                self._entries, self._discovered = saved

    def __repr__(self) -> str:
        return f"Plugins({self.group!r}, {len(self._entries)} known)"

    # --- inside ----------------------------------------------------------------------------------

    def _entry(self, name: str) -> _Entry:
        if name not in self._entries:
            self.discover()
        entry = self._entries.get(name)
        if entry is None:
            raise UnknownPluginError(self.unknown(name))
        return entry

    def unknown(self, name: str) -> str:
        """The one-line message for a name nothing answers to: the closest name, those there are, how to add one."""
        known = self.names()
        return (
            f"no {self.kind} named {name!r}.{did_you_mean(name, known)} Available: {', '.join(known) or 'none'} "
            f"(a package adds one in the entry-point group {self.group!r})"
        )

    def _load(self, entry: _Entry) -> None:
        """Import `entry` and apply on_load, once; a failure raises a one-line PluginError, the same one
        each time after (a module that failed to import is not imported again)."""
        if entry.error is not None:
            raise PluginError(entry.error)
        where = f"{self.kind} {entry.name!r} ({entry.target or 'an object'}, {entry.source}, group {self.group!r})"
        try:
            obj = entry.value if entry.target is None else load_target(entry.target)
        except Exception as exc:
            entry.error = f"{where} failed to load: {type(exc).__name__}: {_one_line(exc)}"
            raise PluginError(entry.error) from exc
        try:
            value = self._on_load(entry.name, obj) if self._on_load is not None else obj
        except Exception as exc:
            entry.error = f"{where} is not a usable {self.kind}: {type(exc).__name__}: {_one_line(exc)}"
            raise PluginError(entry.error) from exc
        entry.value, entry.loaded = value, True


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] + ("..." if len(text) > 300 else "")
