"""Environment registry, after Gymnasium's: `register(id, entry_point=..., **spec)`, `make(id, **overrides)`, `spec(id)`.

Ids look like `ns/Name-vN` (`agentrl/calc-v0`). Third-party packages register through the
`agentrl.envs` entry-point group; each entry point is loaded lazily, the first time an id is
not found or the registry is listed (or by `load_plugins()`), never at `import agentrl`:

    [project.entry-points."agentrl.envs"]
    my_envs = "my_pkg:register_envs"      # a function that calls agentrl.register(...)

Every id registered here is registered with Gymnasium too, so `gymnasium.make("agentrl/calc-v0")`
works once agentrl is imported (and a third-party id once its plugin is loaded); Gymnasium's
`make` builds it through `agentrl.make`, and Gymnasium's own `check_env` passes on it.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from agentrl.errors import UserError

if TYPE_CHECKING:
    from agentrl.task import Task
    from agentrl.tasksource import TaskSource
    from agentrl.types import AgentEnv, Split

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

    def make(self, **overrides: Any) -> AgentEnv:
        return make(self.id, **overrides)


def parse_env_id(env_id: str) -> tuple[str | None, str, int | None]:
    m = _ID_RE.match(env_id)
    if not m:
        raise MalformedEnvIdError(
            f"malformed environment id {env_id!r}: expected 'namespace/name-vN', e.g. 'agentrl/calc-v0'"
        )
    version = m.group("version")
    return m.group("namespace"), m.group("name"), int(version) if version is not None else None


class UnknownEnvError(UserError, KeyError):
    """No environment is registered under this id (the message lists the closest ones)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class MalformedEnvIdError(UserError, ValueError):
    """An id that does not look like `namespace/name-vN`."""


class EnvImportError(UserError, ImportError):
    """The module named in a `module:namespace/name-vN` id cannot be imported."""


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
    _register_with_gymnasium(id)
    return spec


def _register_with_gymnasium(env_id: str) -> None:
    """Make `gymnasium.make(env_id)` build this environment through `agentrl.make`."""
    import gymnasium

    gym_registry = gymnasium.envs.registration.registry
    previous = gym_registry.get(env_id)
    if previous is not None and not _is_ours(previous.entry_point):
        return  # an id Gymnasium (or another library) owns: never shadow it
    gym_registry.pop(env_id, None)  # ours, re-registered: no "Overriding" warning from Gymnasium
    gymnasium.register(id=env_id, entry_point=functools.partial(make, env_id))


def _is_ours(entry_point: Any) -> bool:
    return isinstance(entry_point, functools.partial) and entry_point.func is make


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


def _not_found(env_id: str) -> UnknownEnvError:
    ns, name, version = parse_env_id(env_id)
    same_name = sorted(i for i in registry if parse_env_id(i)[:2] == (ns, name))
    if same_name:
        return UnknownEnvError(
            f"environment {env_id!r} not found: version v{version} does not exist. "
            f"Versions registered: {same_name}"
        )
    close = difflib.get_close_matches(env_id, list(registry), n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return UnknownEnvError(
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
        raise EnvImportError(
            f"environment id {env_id!r}: cannot import {module!r} to register it ({exc}); install the "
            "package that holds it, or run from the directory that holds it (or add that to PYTHONPATH)"
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


def _constructor_kwargs(s: EnvSpec, overrides: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments `make` passes the entry point: the spec's, then the caller's overrides."""
    kwargs = dict(s.kwargs)
    if s.max_turns is not None:
        kwargs.setdefault("max_turns", s.max_turns)
    if s.verifier is not None:
        kwargs.setdefault("verifier", s.verifier)
    if s.max_tool_calls_per_step is not None:
        kwargs.setdefault("max_tool_calls_per_step", s.max_tool_calls_per_step)
    kwargs.update(overrides)
    kwargs.setdefault("env_id", s.id)
    return kwargs


def make(env_id: str | EnvSpec, **overrides: Any) -> AgentEnv:
    """Build a registered environment; `overrides` replace the spec's kwargs (max_turns, verifier included)."""
    s = env_id if isinstance(env_id, EnvSpec) else spec(env_id)  # spec() handles "module:id"
    kwargs = _constructor_kwargs(s, overrides)
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


def task_source(env_id: str | EnvSpec, *, split: Split = "train", **overrides: Any) -> TaskSource:
    """The tasks `make(env_id, split=split, **overrides)` would pose, without building the environment.

        source = agentrl.task_source("agentrl/calc-v0", split="test")
        source.get(7, "test"), source.size("test")      # task 7 of the test split; None: unbounded

    No sandbox, verifier or tool is made: the environment class answers with its `make_tasks`
    classmethod (every `ToolEnv` has one). `split` matters to environments that load one split at a
    time (python-repair). A class that cannot answer without an instance (no `make_tasks`, or one
    that returns None) is built once, with `backend="local", use_pool=False` so that no container
    starts, asked for its `tasks` and closed.
    """
    s = env_id if isinstance(env_id, EnvSpec) else spec(env_id)
    kwargs = _constructor_kwargs(s, {"split": split, **overrides})
    cls = _load_entry_point(s.entry_point)
    make_tasks = getattr(cls, "make_tasks", None)
    source = make_tasks(**kwargs) if callable(make_tasks) else None
    if source is not None:
        return source
    kwargs.update(backend="local", use_pool=False)
    try:
        env = cls(**kwargs)
    except TypeError as exc:  # a constructor without `split`: it has one task supply for every split
        if "split" not in str(exc):
            raise
        env = cls(**{k: v for k, v in kwargs.items() if k != "split"})
    try:
        return env.tasks
    finally:
        env.close()


def get_task(env_id: str | EnvSpec, index: int, *, split: Split = "train", **overrides: Any) -> Task:
    """Task `index` of `split` of a registered environment, without building it (see `task_source`)."""
    return task_source(env_id, split=split, **overrides).get(index, split)


def _register_builtins() -> None:
    from agentrl.envs import register_builtins

    register_builtins()


_register_builtins()
