"""What the command groups of the `agentrl` command line share: the one-line error, options validated by their
config model, `--set KEY=VALUE` and `--parser` as `agentrl.make` overrides, and the env a check plays."""

from __future__ import annotations

from typing import Any

import typer

SET_HELP = "An environment setting, KEY=VALUE (repeatable; the value read as YAML): --set path=tasks/."

PARSER_HELP = "Tool-call format the environment is made with (hermes, llama3-json); default: its own."


def error(message: str) -> None:
    from agentrl.core.errors import one_line

    typer.echo(f"error: {one_line(message)}", err=True)


def validated(model_cls: Any, what: str, **fields: Any) -> Any:
    """`model_cls(**fields)` of the options given (None: not given, the model's default holds), an
    invalid value said in one line with the option's name."""
    from pydantic import ValidationError

    from agentrl.core.errors import UserError, format_validation_error

    try:
        return model_cls(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise UserError(format_validation_error(exc, model_cls, what=what)) from None


def format_override(parser: str) -> dict[str, str]:
    """`agentrl.make` overrides for a `--parser` option ("": the environment's own format)."""
    return {"parser": parser} if parser else {}


def set_overrides(pairs: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` options as `agentrl.make` overrides; a value is read as YAML (`path=tasks/`,
    `max_turns=5`, `from_map={"python:*": "agentrl/base:bookworm"}`)."""
    import yaml

    from agentrl.core.errors import UserError

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set {pair!r}: expected KEY=VALUE, e.g. --set path=tasks/")
        out[key.strip()] = yaml.safe_load(value) if value.strip() else ""
    return out


def played(env: Any, env_id: str) -> Any:
    """The environment the checks exercise: a harness env's (`agentrl.gateway.HarnessEnv`) is the one its
    agent plays (its tasks, tools, sandbox and verifier); the harness adds nothing they could check."""
    from agentrl.gateway.harness import is_harness_env

    if not is_harness_env(env):
        return env
    typer.echo(f"{env_id} is a harness: checking the environment it plays, {env.env.env_id}")
    return env.env
