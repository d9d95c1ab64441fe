"""The `agentrl` command line. Each command imports what it needs when it runs, so `--help` is instant.

The commands live by group in `agentrl.cli_*` (`cli_run`: sft, demos, train, eval, rollout, gateway, demo;
`cli_env`: envs, env, tasks; `cli_verifier`, `cli_model`, `cli_sandbox`); this module puts them under one
`agentrl` group, in the order `agentrl --help` lists them.

Errors, one mechanism for every command (`_Group.invoke`): bad input (a `UserError`, an invalid
config, a usage error) prints one line, `error: ...`, and exits 2, without a traceback;
`agentrl --debug COMMAND` (or AGENTRL_DEBUG=1) shows the traceback. Anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import typer
from typer.core import TyperGroup

from agentrl.cli.common import error
from agentrl.cli.env import env_app, envs_app, tasks_app
from agentrl.cli.model import model_app
from agentrl.cli.run import run_app
from agentrl.cli.sandbox import sandbox_app
from agentrl.cli.verifier import verifier_app

_debug = os.environ.get("AGENTRL_DEBUG", "") not in ("", "0")


def _user_error_message(exc: BaseException) -> str | None:
    """The one-line message for an exception that is the user's input going wrong; None for a bug."""
    from agentrl.core.errors import UserError, format_validation_error, one_line

    if isinstance(exc, UserError):
        return one_line(exc.args[0] if exc.args else str(exc))
    try:
        from pydantic import ValidationError
    except ImportError:  # pragma: no cover - pydantic is a dependency
        ValidationError = ()  # type: ignore[assignment,misc]
    if isinstance(exc, ValidationError):
        return format_validation_error(exc, what=f"{exc.title} value")
    if isinstance(exc, FileNotFoundError | IsADirectoryError) and exc.filename:
        return one_line(f"{exc.filename}: {exc.strerror or exc}")
    return None


class _Group(TyperGroup):
    """The top-level group: every command's errors pass through here (see the module docstring)."""

    def invoke(self, ctx: Any) -> Any:
        import typer._click.exceptions as click_exc

        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, click_exc.NoArgsIsHelpError, KeyboardInterrupt, SystemExit):
            raise
        except click_exc.UsageError as exc:
            if _debug:
                raise
            where = getattr(exc.ctx, "command_path", None) or "agentrl"
            error(f"{exc.format_message()} (see `{where} --help`)")
            raise typer.Exit(2) from None
        except Exception as exc:
            message = _user_error_message(exc)
            if message is None or _debug:
                raise
            error(message)
            raise typer.Exit(2) from None


app = typer.Typer(
    help="agentrl: agentic multi-turn RL environments, verifiers, training and evaluation.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    cls=_Group,
)


@app.callback()
def _main_options(
    debug: bool = typer.Option(
        False, "--debug", help="Show the full traceback of an error (also: AGENTRL_DEBUG=1)."
    ),
) -> None:
    """agentrl: agentic multi-turn RL environments, verifiers, training and evaluation."""
    global _debug
    if debug:
        _debug = True
        os.environ["AGENTRL_DEBUG"] = "1"  # torchrun ranks and other children inherit it


app.add_typer(run_app)  # its commands at the top level, listed first
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(envs_app, name="envs")
app.add_typer(env_app, name="env")
app.add_typer(model_app, name="model")
app.add_typer(verifier_app, name="verifier")
app.add_typer(tasks_app, name="tasks")


def main() -> None:
    # The CLI's main thread: install the handlers that remove this process's containers on
    # SIGTERM/SIGINT before any command opens one (rollouts open them on worker threads).
    from agentrl.sandbox.reaper import install_signal_handlers

    install_signal_handlers()
    import shlex

    # What Ctrl-C in `agentrl train` tells you to run to continue (its torchrun ranks inherit it).
    os.environ["AGENTRL_COMMAND"] = shlex.join(["agentrl", *sys.argv[1:]])
    if not _debug and "--debug" not in sys.argv:
        # PyTorch's C++ warnings (vLLM's CPU worker start-up) would bury our lines; errors still show.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    app()


if __name__ == "__main__":
    main()
