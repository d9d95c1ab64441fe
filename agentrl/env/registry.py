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
import inspect
import os
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.core.errors import UserError, did_you_mean
from agentrl.core.plugins import Plugins

if TYPE_CHECKING:
    from pydantic import BaseModel

    from agentrl.core.task import Task
    from agentrl.core.types import Split
    from agentrl.env.protocols import AgentEnv
    from agentrl.env.tasksource import TaskSource

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
    settings: type[BaseModel] | None = None
    """The settings model of an entry point that declares none itself (a factory function); an
    environment class names its own as `settings_model` (`agentrl.env.settings`)."""

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


def register(
    id: str,
    entry_point: str | Callable[..., Any],
    *,
    max_turns: int | None = None,
    verifier: str | tuple[str, dict] | None = None,
    max_tool_calls_per_step: int | None = None,
    description: str = "",
    settings: type[BaseModel] | None = None,
    **kwargs: Any,
) -> EnvSpec:
    """Register an environment; `kwargs` become the constructor's defaults.

    `settings`: the pydantic model of the entry point's settings, for one that does not name its
    own (`settings_model` of a `ToolEnv` class): `make` then validates the keyword arguments with
    it and passes every field (its defaults included) to the entry point.
    """
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
        settings=settings,
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
    # `make` returns an `AgentEnv` (a protocol); Gymnasium types a creator as returning its `Env` class.
    gymnasium.register(id=env_id, entry_point=functools.partial(make, env_id))  # type: ignore[arg-type]


def _is_ours(entry_point: Any) -> bool:
    return isinstance(entry_point, functools.partial) and entry_point.func is make


def _run_registration(name: str, obj: Any) -> Any:
    """An `agentrl.envs` entry point names a function that registers ids (called here, once) or a module
    that registers them on import."""
    if callable(obj):
        obj()
    return obj


# The `agentrl.envs` entry points: each registers its ids when loaded (its name is the package's, not an id).
ENV_PLUGINS: Plugins[Any] = Plugins(ENTRY_POINT_GROUP, "environment plugin", on_load=_run_registration)


def load_plugins() -> None:
    """Load every `agentrl.envs` entry point once. A broken plugin warns and the others still load."""
    ENV_PLUGINS.load_all()


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
        f"environment {env_id!r} not found.{hint} If a module of yours registers it, name the module "
        f"before the id, `your_module:{env_id}` (imported from the current directory, or from an installed "
        "package), or make it an `agentrl.envs` entry point of your package; `agentrl envs list` lists the "
        "registered ids."
    )


def import_user_module(module: str) -> Any:
    """`importlib.import_module(module)`, looking in the current directory too when it is not found.

    `python -m` and `python script.py` put the current directory (or the script's) on `sys.path`; the
    `agentrl` console script puts its own bin directory there instead, so a user's `mylab/agents.py` run
    from the directory that holds `mylab/` would not be found. It is added at the end of `sys.path` (an
    installed package of the same name wins) and to PYTHONPATH, so the processes we start (torchrun
    ranks, sandboxes' relays, measurement subprocesses) find it as well."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.split(".")[0]
        cwd = os.getcwd()
        here = (Path(cwd) / top).is_dir() or (Path(cwd) / f"{top}.py").is_file()
        if exc.name != top or not here or cwd in sys.path or "" in sys.path:
            raise
    sys.path.append(cwd)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if cwd not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, cwd])
    importlib.invalidate_caches()
    return importlib.import_module(module)


def _import_prefix(env_id: str) -> str:
    """`"my_pkg.envs:my/Env-v0"` imports `my_pkg.envs` (which registers) and returns `"my/Env-v0"`, as Gymnasium does."""
    if ":" not in env_id:
        return env_id
    module, _, rest = env_id.partition(":")
    try:
        import_user_module(module)
    except ImportError as exc:
        raise EnvImportError(
            f"environment id {env_id!r}: cannot import {module!r} to register it ({exc}); install the "
            "package that holds it, or run from the directory that holds it (or add that to PYTHONPATH)"
        ) from exc
    if rest not in registry:
        load_plugins()
    if rest not in registry:
        raise UnknownEnvError(
            f"environment {rest!r} not found: {module} was imported but registered no such id"
            f"{did_you_mean(rest, registry)} (it registers with `agentrl.register({rest!r}, ...)` when it "
            "is imported)"
        )
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
        mod = import_user_module(module)
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
    if s.settings is not None:  # a declared model the entry point does not apply itself
        kwargs = {**kwargs, **_fields(_validated(s, s.settings, kwargs, cls))}
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


# --- settings ---------------------------------------------------------------------------------------


def settings_model(env_id: str | EnvSpec) -> tuple[type[BaseModel] | None, bool]:
    """The settings model of an environment, and whether it declares it.

    Declared: `register(settings=...)`, or `settings_model` named by the entry point's class itself.
    A class that inherits its model without naming one (a `ToolEnv` subclass that adds keyword
    arguments of its own) has it undeclared: the model covers only the settings it knows. None: no
    model at all (a factory function registered without one)."""
    from pydantic import BaseModel

    s = env_id if isinstance(env_id, EnvSpec) else spec(env_id)
    if s.settings is not None:
        return s.settings, True
    cls = _load_entry_point(s.entry_point)
    model = getattr(cls, "settings_model", None)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return None, False
    return model, "settings_model" in getattr(cls, "__dict__", {})


def _explicit_parameters(entry: Callable[..., Any]) -> set[str]:
    """The keyword parameters the entry point names itself (`env_id`, `oracle`, ...): not settings."""
    try:
        params = inspect.signature(entry).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


def _validated(
    s: EnvSpec, model: type[BaseModel], kwargs: dict[str, Any], entry: Callable[..., Any], strict: bool = True
) -> Any:
    """`kwargs` validated by `model`: all of them (`strict`), or only the ones it knows."""
    from pydantic import ValidationError

    from agentrl.env.settings import EnvSettings, EnvSettingsError, settings_error

    known = set(model.model_fields)
    explicit = _explicit_parameters(entry) - known
    data = {k: v for k, v in kwargs.items() if k in known or (strict and k not in explicit)}
    unknown = sorted(set(data) - known)  # a model that ignores extra keys must not hide a misspelling
    if unknown:
        hint = did_you_mean(unknown[0], known)
        fix = f" (`agentrl env show {s.id}` lists them)" if "/" in s.id else ""
        what = f"unknown key '{unknown[0]}'" + (f".{hint}" if hint else "")
        raise EnvSettingsError(f"invalid settings of {s.id}: {what}{fix}")
    try:
        if issubclass(model, EnvSettings):
            return model.build(data, what=s.id)
        return model.model_validate(data)
    except ValidationError as exc:
        raise settings_error(exc, model, s.id) from None


def settings_lines(env_id: str | EnvSpec) -> list[str]:
    """The environment's settings as `agentrl env show` prints them: each with its type, default and
    what it does."""
    import textwrap

    from agentrl.env.settings import describe

    s = env_id if isinstance(env_id, EnvSpec) else spec(env_id)
    model, declared = settings_model(s)
    if model is None:
        return ["settings:    none declared (keyword arguments go to the entry point as they are given)"]
    how = "agentrl.make(id, name=value), or env_kwargs: {name: value} in a config"
    if not declared:
        how += f"; inherited: {s.id} may take keyword arguments of its own too"
    lines = [f"settings:    ({model.__name__}; set with {how})"]
    for name, kind, default, description in describe(model):
        lines.append(f"  {name}: {kind} = {default}")
        lines += textwrap.wrap(description, width=100, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return lines


def _fields(settings: Any) -> dict[str, Any]:
    """Every field of a validated settings model, as keyword arguments (the objects, not a dump)."""
    return {name: getattr(settings, name) for name in type(settings).model_fields}


def check_env_kwargs(env_id: str | EnvSpec, env_kwargs: dict[str, Any]) -> None:
    """Validate a config's `env_kwargs` against the environment's settings model, at load time.

    An unknown name or a value of the wrong type is an `EnvSettingsError` naming it (and the
    closest known name). An environment without a declared model is checked only on the settings
    its inherited model knows; one with no model at all, not at all. An id that does not resolve is
    left for `make` to report where it always has."""
    try:
        s = env_id if isinstance(env_id, EnvSpec) else spec(env_id)
        model, declared = settings_model(s)
        entry = _load_entry_point(s.entry_point)
    except (UserError, ImportError, AttributeError):
        return
    if model is None:
        return
    kwargs = {k: v for k, v in _constructor_kwargs(s, env_kwargs).items() if k != "env_id"}
    _validated(s, model, kwargs, entry, strict=declared)


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
    model, declared = settings_model(s)
    if declared and model is not None and s.settings is None:  # the class's own model: from its settings
        kwargs = {**kwargs, **_fields(_validated(s, model, kwargs, cls))}
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


# The built-in environments (their table is in agentrl/envs/__init__.py), by entry-point string as
# any plugin's: the registry never imports an environment's module before `make` needs its class.
BUILTINS: tuple[tuple[str, str, int, str], ...] = (
    (
        "agentrl/calc-v0",
        "agentrl.envs.calc:CalcEnv",
        4,
        "Arithmetic and word problems; compute with python, then submit the number.",
    ),
    (
        "agentrl/calc-levels-v0",
        "agentrl.envs.calc_levels:CalcLevelsEnv",
        4,
        "calc-v0's arithmetic in 6 difficulty levels: a mixed pool, or one level with level=N.",
    ),
    (
        "agentrl/sqlite-v0",
        "agentrl.envs.sqlite:SqliteEnv",
        8,
        "A shop database in SQLite: answer questions by querying it, or change it (checked by state).",
    ),
    (
        "agentrl/sqlite-mcp-v0",
        "agentrl.envs.sqlite_mcp:SqliteMCPEnv",
        8,
        "sqlite-v0's shop database, its tools from the reference MCP server mcp-server-sqlite in the sandbox.",
    ),
    (
        "agentrl/guess-number-v0",
        "agentrl.envs.guess_number:GuessNumberEnv",
        12,
        "Stateful multi-turn game: find the secret number with higher/lower feedback.",
    ),
    (
        "agentrl/python-repair-v0",
        "agentrl.envs.python_repair.env:PythonRepairEnv",
        30,
        "Fix a bug planted by an AST mutation in a real package; scored by the package's own tests.",
    ),
    (
        "agentrl/harbor-v0",
        "agentrl.envs.harbor.env:HarborEnv",
        30,
        "Harbor task directories (path=): the task's image, instruction, tests/test.sh and solve.sh.",
    ),
)
"""(id, entry point, max_turns, description) of each built-in environment."""

for _id, _entry_point, _max_turns, _description in BUILTINS:
    register(_id, _entry_point, max_turns=_max_turns, description=_description)
