"""An environment's settings, declared as a pydantic model: validated, documented, shown by `agentrl env show`.

Every `ToolEnv` has `ToolEnvSettings` (its tasks, tools, verifier, turn and time limits, sandbox);
an environment with settings of its own subclasses it and names the result in its class:

    class MazeSettings(ToolEnvSettings):
        size: int = Field(8, ge=2, description="Side of the maze, in cells.")
        max_turns: int = Field(40, ge=1, description="...")      # a default of its own

    class MazeEnv(ToolEnv):
        settings_model = MazeSettings                           # self.settings.size in the env

`agentrl.make(id, size=12)`, `env_kwargs: {size: 12}` in a config and `MazeEnv(size=12)` all go
through the model: a misspelled name or a value of the wrong type is one line naming the setting,
the value and the fix. An environment that declares no model (a subclass that does not name one,
a factory function) gets its keyword arguments as they are given; `agentrl.register(...,
settings=Model)` declares one for an entry point that cannot.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from agentrl.core.errors import UserError, format_validation_error
from agentrl.core.types import Split
from agentrl.sandbox.spec import Limits


class EnvSettingsError(UserError, ValueError):
    """An environment setting that does not exist or has a value of the wrong type (one line, with the fix)."""


class EnvSettings(BaseModel):
    """The base of every environment's settings model: unknown names are errors, values are
    checked on assignment too, and a field may hold any Python object (a task generator, a tool)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, validate_assignment=True)

    @classmethod
    def build(
        cls, settings: BaseModel | Mapping[str, Any] | None = None, *, what: str = "", **overrides: Any
    ) -> typing.Self:
        """`settings` (a model or a mapping) with `overrides` on top, validated by this model.

        Only what was given travels from `settings`: a field it left at its default takes this
        model's default. `what` names the environment in the error (`EnvSettingsError`)."""
        if isinstance(settings, BaseModel):
            data = {name: getattr(settings, name) for name in settings.model_fields_set}
        else:
            data = dict(settings or {})
        data.update(overrides)
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise settings_error(exc, cls, what) from None

    def as_kwargs(self) -> dict[str, Any]:
        """Every setting, as keyword arguments (the objects themselves, not a serialisation)."""
        return {name: getattr(self, name) for name in type(self).model_fields}


def settings_error(exc: ValidationError, model: type[BaseModel], what: str = "") -> EnvSettingsError:
    """A validation error of an environment's settings as one line, with where to read them."""
    where = f" of {what}" if what else ""
    fix = f" (`agentrl env show {what}` lists them)" if what and "/" in what else ""
    return EnvSettingsError(format_validation_error(exc, model, what=f"settings{where}") + fix)


def _positive_or_none(name: str, value: float | None) -> float | None:
    if value is not None and not value > 0:
        raise ValueError(f"{name} must be > 0 seconds (or None for the default)")
    return value


class ToolEnvSettings(EnvSettings):
    """The settings of every `ToolEnv`: what the agent works on, what it may call, and its limits."""

    tasks: Any = Field(
        None,
        description="The tasks: a generator (generate(index, split) -> Task), a list of Tasks or dicts, a JSONL "
        "path, a datasets.Dataset, a split -> source mapping, or a callable returning one. None: the "
        "environment's own (its task_generator(seed)).",
    )
    tools: list[Any] | None = Field(
        None,
        description="The tools the agent calls: @agentrl.tool functions or built-in names (bash, python, "
        "read_file, write_file, str_replace, submit). None: the environment's own.",
    )
    mcp_servers: list[Any] = Field(
        default_factory=list,
        description="MCP servers whose tools the agent also gets (agentrl.env.mcp.MCPServer, a mapping of its "
        "fields, a command or a URL): a command starts inside each episode's sandbox unless where='host'.",
    )
    verifier: Any = Field(
        "exact-match",
        description="How an episode is scored: a registered verifier's name, (name, kwargs), or a Verifier.",
    )
    seed: int = Field(
        0,
        description="Seed of the environment's own task generator: task i of a split is a pure function of "
        "(seed, split, i). Unused when tasks are given.",
    )
    split: Split = Field(
        "train", description="Split reset() draws from (options={'split': ...} picks another per episode)."
    )
    max_turns: int = Field(
        10,
        ge=1,
        description="Most assistant messages per episode; the last one ends it (max_turns, truncated).",
    )
    max_action_chars: int = Field(
        65536,
        ge=1,
        description="Longest assistant message read, in characters; a longer one runs nothing and is a format "
        "error.",
    )
    max_tool_calls_per_step: int | None = Field(
        None,
        description="Most tool calls one message runs; the rest are not run and the observation says so. None: "
        "the environment class's default_max_tool_calls_per_step (4 for ToolEnv).",
    )
    exec_timeout_s: float = Field(
        30.0, gt=0, description="Timeout of one command a tool runs in the sandbox, in seconds."
    )
    step_timeout_s: float | None = Field(
        None,
        description="Wall-clock budget of all the tool calls of one message, in seconds; each call's commands "
        "get what is left of it, calls that find it spent are not run. None: 2 x exec_timeout_s.",
    )
    tool_timeout_s: float | None = Field(
        None,
        description="Deadline of one tool call whatever it does (host-side Python included); a call past it "
        "ends the episode env_error. None: exec_timeout_s + 30 s.",
    )
    verifier_timeout_s: float | None = Field(
        None,
        description="Deadline of the verifier, in seconds; past it the episode scores 0 with the reason. None: "
        "the verifier's own timeout_s plus a margin, else 300 s.",
    )
    parser: str = Field(
        "hermes",
        description="Tool-call format the model writes and reads: hermes, llama3-json, or one added with "
        "agentrl.env.parsers.register_parser.",
    )
    tools_in_prompt: bool = Field(
        True,
        description="Put the tools' schemas in the system prompt (off: a chat template renders them from "
        "info['tools']).",
    )
    backend: str = Field(
        "docker", description="Sandbox backend: docker, bwrap, or local (no isolation: trusted tests only)."
    )
    use_pool: bool = Field(
        True,
        description="Take sandboxes from the process-wide warm pool (sandbox.pool_size ready per "
        "configuration); off: start each one on reset.",
    )
    limits: Limits = Field(
        default_factory=Limits,
        description="Resource limits of each sandbox: memory_mb, cpus, pids, disk_mb, network, ...",
    )
    sandbox_env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables every sandbox starts with (the verifier runs with its own clean "
        "environment).",
    )
    render_mode: Literal["ansi"] | None = Field(None, description="Gymnasium render mode: ansi, or None.")

    @field_validator("max_tool_calls_per_step")
    @classmethod
    def _at_least_one(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError("max_tool_calls_per_step must be >= 1 (or None for the default)")
        return value

    @field_validator("step_timeout_s", "tool_timeout_s", "verifier_timeout_s")
    @classmethod
    def _deadline(cls, value: float | None, info: Any) -> float | None:
        return _positive_or_none(info.field_name, value)

    @field_validator("mcp_servers", mode="before")
    @classmethod
    def _servers(cls, value: Any) -> Any:
        from agentrl.env.mcp.server import as_servers

        return as_servers(value)

    @field_validator("limits", mode="before")
    @classmethod
    def _default_limits(cls, value: Any) -> Any:
        return {} if value is None else value


# --- reading a model, for `agentrl env show` ------------------------------------------------------


def type_name(annotation: Any) -> str:
    """A field's type as a person reads it: `int`, `float | None`, `'ansi' | None`, `any`."""
    if annotation is Any:
        return "any"
    if annotation is type(None):
        return "None"
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(annotation, "__name__", str(annotation))


def _shown(value: Any) -> str:
    """A default as a person reads it: a tool or verifier object by its name, a section by its fields."""
    if isinstance(value, BaseModel):
        return f"{type(value).__name__}({', '.join(f'{k}={v!r}' for k, v in value)})"
    if isinstance(value, list | tuple) and any(isinstance(getattr(v, "name", None), str) for v in value):
        inner = ", ".join(_shown(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    name = getattr(value, "name", None)
    if isinstance(name, str) and not isinstance(value, str | int | float | bool | dict | list | tuple):
        return name
    return repr(value)


def own_settings(model: type[BaseModel]) -> list[str]:
    """The fields a `ToolEnvSettings` subclass declares (new ones, and the ones it gives its own default)."""
    own: list[str] = []
    for cls in model.__mro__:
        if cls is ToolEnvSettings or not issubclass(cls, ToolEnvSettings):
            break
        own += [name for name in vars(cls).get("__annotations__", {}) if name not in own]
    return own


def describe(model: type[BaseModel]) -> list[tuple[str, str, str, str]]:
    """(name, type, default, description) of every field: an environment's own settings first (the ones
    its model declares or gives a default of its own), then the rest, each in declaration order."""
    own = own_settings(model) if issubclass(model, ToolEnvSettings) else []
    fields = sorted(model.model_fields.items(), key=lambda item: item[0] not in own)
    rows = []
    for name, field in fields:
        default = field.get_default(call_default_factory=True)
        rows.append((name, type_name(field.annotation), _shown(default), field.description or ""))
    return rows
