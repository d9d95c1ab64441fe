"""Environment registry, after Gymnasium's: `register(id, entry_point=..., **spec)`, `make(id, **overrides)`, `spec(id)`.

Ids look like `ns/Name-vN` (`agentrl/calc-v0`). Third-party packages register through the
`agentrl.envs` entry-point group; each entry point is loaded lazily, the first time an id is
not found or the registry is listed, never at `import agentrl`:

    [project.entry-points."agentrl.envs"]
    my_envs = "my_pkg:register_envs"      # a function that calls agentrl.register(...)
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

ENTRY_POINT_GROUP = "agentrl.envs"
_ID_RE = re.compile(r"^(?:(?P<namespace>[\w.-]+)/)?(?P<name>[\w.-]+?)(?:-v(?P<version>\d+))?$")


@dataclass(frozen=True)
class EnvSpec:
    """Everything `make` needs to build an environment, and what `agentrl env show` prints."""

    id: str
    entry_point: str | Callable[..., Any]
    max_turns: int | None = None
    verifier: str | tuple[str, dict] | None = None
    max_tool_calls_per_step: int | None = None
    """Most tool calls one message runs; None: the environment class's own default
    (`ToolEnv.default_max_tool_calls_per_step`: 4, or 1 for a game like guess-number)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    description: str = ""

    @property
    def namespace(self) -> str | None:
        return parse_env_id(self.id)[0]

    @property
    def name(self) -> str:
        return parse_env_id(self.id)[1]

    @property
    def version(self) -> int | None:
        return parse_env_id(self.id)[2]

    def make(self, **overrides: Any) -> Any:
        return make(self.id, **overrides)


def parse_env_id(env_id: str) -> tuple[str | None, str, int | None]:
    m = _ID_RE.match(env_id)
    if not m:
        raise ValueError(
            f"malformed environment id {env_id!r}: expected 'namespace/name-vN', e.g. 'agentrl/calc-v0'"
        )
    version = m.group("version")
    return m.group("namespace"), m.group("name"), int(version) if version is not None else None


registry: dict[str, EnvSpec] = {}
_lock = threading.Lock()
_plugins_loaded = False


def register(
    id: str,
    entry_point: str | Callable[..., Any],
    *,
    max_turns: int | None = None,
    verifier: str | tuple[str, dict] | None = None,
    max_tool_calls_per_step: int | None = None,
    description: str = "",
    **kwargs: Any,
) -> EnvSpec:
    """Register an environment; `kwargs` become the constructor's defaults."""
    parse_env_id(id)
    if max_tool_calls_per_step is not None and max_tool_calls_per_step < 1:
        raise ValueError(f"max_tool_calls_per_step must be >= 1 (or None), got {max_tool_calls_per_step}")
    if isinstance(entry_point, str) and ":" not in entry_point:
        raise ValueError(f"entry_point {entry_point!r} must look like 'package.module:ClassName'")
    if id in registry:
        warnings.warn(f"overriding environment {id!r} already in the registry", stacklevel=2)
    spec = EnvSpec(
        id=id,
        entry_point=entry_point,
        max_turns=max_turns,
        verifier=verifier,
        max_tool_calls_per_step=max_tool_calls_per_step,
        kwargs=dict(kwargs),
        description=description,
    )
    registry[id] = spec
    return spec


def load_plugins() -> None:
    """Load every `agentrl.envs` entry point once. A broken plugin warns and the others still load."""
    global _plugins_loaded
    with _lock:
        if _plugins_loaded:
            return
        _plugins_loaded = True
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                obj = ep.load()
                if callable(obj):
                    obj()
            except Exception as exc:
                warnings.warn(
                    f"environment plugin {ep.name!r} ({ep.value}) failed to load: {exc}", stacklevel=2
                )


def _not_found(env_id: str) -> KeyError:
    ns, name, version = parse_env_id(env_id)
    same_name = sorted(i for i in registry if parse_env_id(i)[:2] == (ns, name))
    if same_name:
        return KeyError(
            f"environment {env_id!r} not found: version v{version} does not exist. "
            f"Versions registered: {same_name}"
        )
    close = difflib.get_close_matches(env_id, list(registry), n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return KeyError(
        f"environment {env_id!r} not found.{hint} See `agentrl envs list` for all registered ids."
    )


def _import_prefix(env_id: str) -> str:
    """`"my_pkg.envs:my/Env-v0"` imports `my_pkg.envs` (which registers) and returns `"my/Env-v0"`, as Gymnasium does."""
    if ":" not in env_id:
        return env_id
    module, _, rest = env_id.partition(":")
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"environment id {env_id!r}: cannot import {module!r} to register it ({exc})"
        ) from exc
    return rest


def spec(env_id: str) -> EnvSpec:
    env_id = _import_prefix(env_id)
    if env_id not in registry:
        load_plugins()
    if env_id not in registry:
        raise _not_found(env_id)
    return registry[env_id]


def all_specs() -> list[EnvSpec]:
    load_plugins()
    return [registry[k] for k in sorted(registry)]


def _load_entry_point(entry_point: str | Callable[..., Any]) -> Callable[..., Any]:
    if callable(entry_point):
        return entry_point
    module, _, attr = entry_point.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"cannot import {module!r} for entry point {entry_point!r}: {exc}") from exc
    try:
        return getattr(mod, attr)
    except AttributeError:
        raise AttributeError(
            f"module {module!r} has no attribute {attr!r} (entry point {entry_point!r})"
        ) from None


def make(env_id: str | EnvSpec, **overrides: Any) -> Any:
    """Build a registered environment; `overrides` replace the spec's kwargs (max_turns, verifier included)."""
    s = env_id if isinstance(env_id, EnvSpec) else spec(env_id)  # spec() handles "module:id"
    kwargs = dict(s.kwargs)
    if s.max_turns is not None:
        kwargs.setdefault("max_turns", s.max_turns)
    if s.verifier is not None:
        kwargs.setdefault("verifier", s.verifier)
    if s.max_tool_calls_per_step is not None:
        kwargs.setdefault("max_tool_calls_per_step", s.max_tool_calls_per_step)
    kwargs.update(overrides)
    kwargs.setdefault("env_id", s.id)
    cls = _load_entry_point(s.entry_point)
    env = cls(**kwargs)
    spec_fields = ("max_turns", "verifier", "max_tool_calls_per_step", "env_id")
    env.spec = replace(
        s,
        kwargs={k: v for k, v in kwargs.items() if k not in spec_fields},
        max_turns=kwargs.get("max_turns", s.max_turns),
        # What this instance runs with (the class's default when neither spec nor caller set it).
        max_tool_calls_per_step=getattr(
            env, "max_tool_calls_per_step", kwargs.get("max_tool_calls_per_step")
        ),
    )
    return env


def _register_builtins() -> None:
    from agentrl.envs import register_builtins

    register_builtins()


_register_builtins()
