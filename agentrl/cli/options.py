"""Command-line options generated from the config models, so that each setting is written once.

A command lists the models (or parts of them) it takes settings from; `model_options` turns every
field into a typer option whose help is the field's description and whose shown default is the
field's default, and `settings_command` registers the command with those options (`with_options`),
its `--help` listing them section by section. A field added to a model is then an option of every
command that takes that model, with its docstring in `--help`, without an edit here or in
`agentrl.cli`.

    --rollout.temperature 0.7          a section's field (`agentrl train`): its dotted key
    --temperature 0.7                  the same field where the command takes the section flat
    --engine.sleep / --engine.no-sleep a bool: a pair of flags
    --report-to jsonl --report-to wandb, --k 1,2,4
                                       a list: repeat the option, or give comma-separated items
    --engine.devices null              null (or ~) sets an optional field to None
    --env-kwargs '{backend: bwrap}'    a mapping (any other type): a YAML value

The command receives the options given (and only those: a setting left out keeps the config file's
value, else the model's default) as a nested `settings` mapping, each value already checked against
its field's type and bounds: a bad one stops the command with one line naming the option.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import typer
import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from typer.core import TyperCommand

from agentrl.core.errors import UserError, one_line

_PARAM_PREFIX = "settings__"
"""Python parameter names of generated options start with this (they are never seen by the user)."""
_CONTEXT = "_settings_context"


@dataclass(frozen=True)
class Option:
    """One generated option: the config key it sets and how the command line spells it."""

    key: tuple[str, ...]
    """Where the value goes in the settings mapping, e.g. ("rollout", "temperature")."""
    decls: tuple[str, ...]
    """Its flags, e.g. ("--rollout.temperature",), or ("--engine.sleep/--engine.no-sleep",) for a bool."""
    info: FieldInfo = field(repr=False)
    """The model field it sets (annotation, bounds, description, default)."""
    required: bool = False
    """The command cannot run without it (a required field of a command that has no config file)."""
    panel: str | None = None
    """The `--help` section it is listed in; None: the command's own options."""

    @property
    def param(self) -> str:
        return _PARAM_PREFIX + "__".join(self.key)

    @property
    def flags(self) -> list[str]:
        return [f for decl in self.decls for f in decl.split("/")]


def _strip_optional(annotation: Any) -> tuple[Any, bool]:
    """(the annotation without None, whether None was allowed)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) < len(typing.get_args(annotation)):
            return (args[0] if len(args) == 1 else typing.Union[tuple(args)]), True  # noqa: UP007
    return annotation, False


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _kind(annotation: Any) -> str:
    """How the command line spells a value of this type: flag, list, text or yaml."""
    bare, _ = _strip_optional(annotation)
    if bare is bool:
        return "flag"
    if typing.get_origin(bare) is list:
        return "list"
    if bare is str or (
        typing.get_origin(bare) is Literal and all(isinstance(a, str) for a in typing.get_args(bare))
    ):
        return "text"
    return "yaml"


def _metavar(annotation: Any) -> str:
    bare, optional = _strip_optional(annotation)
    origin = typing.get_origin(bare)
    if origin is Literal:
        text = "[" + "|".join(str(a) for a in typing.get_args(bare)) + "]"
    elif origin is list:
        (item,) = typing.get_args(bare) or (Any,)
        text = f"{_metavar(item)},..."
    elif origin is dict:
        text = "<yaml mapping>"
    else:
        text = {int: "<int>", float: "<float>", str: "<str>", bool: "<bool>"}.get(bare, "<yaml>")
    return f"{text}|null" if optional else text


def _cli_default(info: FieldInfo) -> Any:
    """The field's default as the option's: shown in `--help`, never passed on (see `with_options`)."""
    if info.is_required():
        return None
    default = info.get_default(call_default_factory=True)
    if default is None or isinstance(default, bool):
        return default
    if isinstance(default, list):
        return [str(x) for x in default]
    if isinstance(default, dict):
        return yaml.safe_dump(default, default_flow_style=True, width=1 << 16).strip()
    return str(default)


def _flag_name(name: str) -> str:
    return name.replace("_", "-")


def model_options(
    model: type[BaseModel],
    *,
    into: str = "",
    flat: bool = False,
    only: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
    names: Mapping[str, str | tuple[str, ...]] | None = None,
    required: bool = False,
    panel: str | None = None,
    sections: bool = False,
) -> list[Option]:
    """An option for each field of `model` (each of `only`, if given; none of `exclude`).

    `into`: the dotted key the model sits at in the command's settings ("" for the top level).
    `flat`: its flags without that prefix (`--temperature`, not `--rollout.temperature`).
    `names`: flags of a field other than its own name (`{"models": "--model"}`); several: aliases.
    `required`: the model's required fields must be given (a command without a config file).
    `panel`: the `--help` section of these options (None: the command's own options).
    `sections`: a field that is itself a model gets options for its fields, each section under a
    heading of its own, its key and description (`agentrl train`); otherwise such a
    field must be excluded, or given its own `model_options` call.
    """
    names = dict(names or {})
    keep = set(only) if only is not None else None
    skip = set(exclude)
    prefix = tuple(into.split(".")) if into else ()
    options: list[Option] = []
    for name, info in model.model_fields.items():
        if name in skip or (keep is not None and name not in keep):
            continue
        key = (*prefix, name)
        if _is_section(info.annotation):
            if not sections:
                raise TypeError(
                    f"{model.__name__}.{name} is a section ({info.annotation.__name__}): exclude it, or "
                    "give it its own model_options(into=...), or pass sections=True"
                )
            title = f"{'.'.join(key)}: {info.description}" if info.description else ".".join(key)
            options += model_options(info.annotation, into=".".join(key), panel=title, sections=True)
            continue
        dotted = "" if flat else "".join(f"{p}." for p in prefix)
        given = names.get(name)
        if given is not None:
            decls = (given,) if isinstance(given, str) else tuple(given)
        elif _kind(info.annotation) == "flag":
            decls = (f"--{dotted}{_flag_name(name)}/--{dotted}no-{_flag_name(name)}",)
        else:
            decls = (f"--{dotted}{_flag_name(name)}",)
        options.append(Option(key, decls, info, required=required and info.is_required(), panel=panel))
    return sorted(options, key=lambda opt: not opt.required)  # what must be given first, in `--help` too


def _typer_parameter(opt: Option) -> inspect.Parameter:
    kind = _kind(opt.info.annotation)
    annotation: Any = {"flag": bool | None, "list": list[str] | None}.get(kind, str | None)
    extra: dict[str, Any] = {} if kind == "flag" else {"metavar": _metavar(opt.info.annotation)}
    default = typer.Option(
        ... if opt.required else _cli_default(opt.info),
        *opt.decls,
        help=opt.info.description or "(no description)",
        rich_help_panel=opt.panel,
        **extra,
    )
    return inspect.Parameter(
        opt.param, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
    )


def _is_null(raw: str) -> bool:
    return raw.strip() in ("null", "Null", "NULL", "~", "none", "None")


def _parse_yaml(raw: str) -> Any:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw  # not YAML: the type check below says what was expected


def _parse(opt: Option, raw: Any) -> Any:
    """The value an option's text stands for, before the field's type check."""
    kind = _kind(opt.info.annotation)
    if kind == "flag":
        return raw
    if kind == "list":
        _, optional = _strip_optional(opt.info.annotation)
        if optional and len(raw) == 1 and _is_null(raw[0]):
            return None
        items: list[Any] = []
        for text in raw:
            value = _parse_yaml(text)
            if isinstance(value, list):
                items += value
            elif isinstance(value, str) and "," in value:  # 1,2,4: parsed item by item
                items += [_parse_yaml(part.strip()) for part in value.split(",") if part.strip()]
            else:
                items.append(value)
        return items
    _, optional = _strip_optional(opt.info.annotation)
    if optional and _is_null(raw):
        return None
    return raw if kind == "text" else _parse_yaml(raw)


def check_value(opt: Option, raw: Any) -> Any:
    """`raw` (what the command line gave) as a value of the option's field, checked against its type
    and bounds; a `UserError` naming the option otherwise."""
    value = _parse(opt, raw)
    annotation = opt.info.annotation
    adapter = TypeAdapter(Annotated[annotation, *opt.info.metadata] if opt.info.metadata else annotation)
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = err.get("msg", "invalid")
        shown = " ".join(raw) if isinstance(raw, list) else raw
        raise UserError(
            one_line(f"invalid value for {', '.join(opt.flags)}: {msg[0].lower() + msg[1:]} (got {shown!r})")
        ) from None


def settings_of(options: Iterable[Option], values: Mapping[str, Any]) -> dict[str, Any]:
    """The options given (`values` by parameter name; those not given left out) as a nested mapping
    of checked values."""
    settings: dict[str, Any] = {}
    for opt in options:
        if opt.param not in values:
            continue
        raw = values[opt.param]
        node = settings
        for part in opt.key[:-1]:
            node = node.setdefault(part, {})
        node[opt.key[-1]] = check_value(opt, list(raw) if isinstance(raw, tuple) else raw)
    return settings


def with_options(*groups: list[Option]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add the generated options of `groups` to a typer command; it receives the ones given as
    `settings` (see `settings_of`), a keyword parameter it declares."""
    options = [opt for group in groups for opt in group]

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        own = inspect.signature(func, eval_str=True)
        if "settings" not in own.parameters:
            raise TypeError(f"{func.__name__} must take a `settings` parameter for its generated options")
        # All keyword-only (typer passes every parameter by name), so that they keep the order below.
        kept = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for name, p in own.parameters.items()
            if name != "settings"
        ]
        taken: dict[str, str] = {}
        for p in kept:
            if isinstance(p.default, typer.models.OptionInfo):
                for decl in p.default.param_decls or (f"--{_flag_name(p.name)}",):
                    for flag in decl.split("/"):
                        taken[flag] = p.name
        for opt in options:
            for flag in opt.flags:
                if flag in taken:
                    raise TypeError(f"{flag} of {'.'.join(opt.key)} is already an option ({taken[flag]})")
                taken[flag] = ".".join(opt.key)
        # The click context says which options were given; typer passes it to one parameter, the
        # command's own if it has one.
        has_context = [p.name for p in kept if p.annotation is typer.Context]
        context_name = has_context[0] if has_context else _CONTEXT
        if not has_context:
            kept.append(inspect.Parameter(_CONTEXT, inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context))
        # In `--help`: the command's arguments, its settings, then its own options.
        own_options = [p for p in kept if isinstance(p.default, typer.models.OptionInfo)]
        params = [p for p in kept if p not in own_options]
        params += [_typer_parameter(opt) for opt in options] + own_options
        # typer reads a command's parameters from its signature: the generated ones are added to it.

        @functools.wraps(func)
        def command(**kwargs: Any) -> Any:
            ctx = kwargs[context_name] if has_context else kwargs.pop(_CONTEXT)
            generated = {k: kwargs.pop(k) for k in list(kwargs) if k.startswith(_PARAM_PREFIX)}
            # An option's default is its field's, for `--help`; left out, the setting is not given at all
            # (a config file's value, else the model's default, holds).
            given = {
                k: v
                for k, v in generated.items()
                if getattr(ctx.get_parameter_source(k), "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP")
            }
            return func(**kwargs, settings=settings_of(options, given))

        command.__signature__ = own.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        del command.__wrapped__  # typer must see the signature above, not the function's own
        command.options = options  # type: ignore[attr-defined]
        return command

    return decorate


class SettingsCommand(TyperCommand):
    """A command with generated options: its `--help` lists them section by section, as plain text.

    Plain, not typer's rich tables: those cut long option names (`--curriculum.min-band-tasks`) short
    in an 80-column terminal, and read `[tracking]` in a description as markup.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rich_markup_mode = None
        # `--rollout.max_tokens_per_turn` as well as `--rollout.max-tokens-per-turn`: keys as config files
        # spell them.
        self.context_settings.setdefault("token_normalize_func", lambda name: name.replace("_", "-"))

    def format_options(self, ctx: Any, formatter: Any) -> None:
        sections: dict[str, list[tuple[str, str]]] = {"Arguments": [], "Options": []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                title = "Arguments"
            else:
                title = getattr(param, "rich_help_panel", None) or "Options"
            sections.setdefault(title, []).append(record)
        for title, records in sections.items():
            if not records:
                continue
            formatter.write_paragraph()
            formatter.write_text(title if title.endswith((".", ":")) else f"{title}:")
            with formatter.indentation():
                formatter.write_dl(records)


def settings_command(
    app: typer.Typer, name: str, *groups: list[Option], **kwargs: Any
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`app.command(name)` with the generated options of `groups` (see `with_options`)."""

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        return app.command(name, cls=SettingsCommand, **kwargs)(with_options(*groups)(func))

    return decorate
