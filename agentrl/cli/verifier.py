"""`agentrl verifier`: list the verifier plugins, check an env's verifier on its tasks, audit it with attacks."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from agentrl.cli.common import PARSER_HELP, SET_HELP, format_override, played, set_overrides

verifier_app = typer.Typer(
    help="Verifier plugins: list them, check an environment's verifier on its tasks, audit it with attacks.",
    no_args_is_help=True,
)


def _one_line_doc(obj: object) -> str:
    import inspect

    doc = inspect.getdoc(obj) or ""
    # A dataclass without a docstring gets its signature as __doc__: that describes nothing.
    if doc.startswith(f"{getattr(obj, '__name__', '')}("):
        doc = ""
    if not doc:
        doc = inspect.getdoc(sys.modules.get(getattr(obj, "__module__", ""))) or ""
    return doc.strip().splitlines()[0] if doc.strip() else "(no description)"


@verifier_app.command("list")
def verifier_list() -> None:
    """List every registered verifier (built-ins and `agentrl.verifiers` entry-point plugins)."""
    from agentrl.verifiers import factory as verifier_factory
    from agentrl.verifiers import names

    for name in names():  # names() loads the entry-point plugins first
        factory = verifier_factory(name)
        where = f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', '?')}"
        typer.echo(f"{name:14s} {_one_line_doc(factory)}  [{where}]")


@verifier_app.command("check")
def verifier_check(
    env_id: str = typer.Argument(..., help="Environment id, e.g. agentrl/calc-v0."),
    tasks: int = typer.Option(5, "--tasks", min=1, help="How many tasks to check (task indices 0..N-1)."),
    backend: str = typer.Option("docker", help="Sandbox backend: docker, bwrap or local."),
    parser: str = typer.Option("", "--parser", help=PARSER_HELP),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """Check the env's verifier on N tasks: the reference must pass, the untouched start must fail.

    Prints each task as kept or dropped with the reason; exits 1 if any task is dropped.
    """
    from agentrl.checks.verifier_check import check_verifier
    from agentrl.env.registry import make

    env = make(
        env_id, backend=backend, **format_override(parser), **set_overrides(set_)
    )  # an unknown id: the message says what exists
    dropped = 0
    try:
        for i in range(tasks):
            task = env.tasks.get(i, env.split)
            check = check_verifier(env, task)
            dropped += not check.ok
            reason = " ".join(check.reason.split())
            typer.echo(f"[{'kept' if check.ok else 'dropped'}] {task.id}: {reason}")
    finally:
        env.close()
    typer.echo(f"{env_id}: kept {tasks - dropped} of {tasks} tasks, dropped {dropped}")
    sys.exit(1 if dropped else 0)


@verifier_app.command("audit")
def verifier_audit(
    env_id: str = typer.Argument("", help="Environment id, e.g. agentrl/python-repair-v0."),
    tasks: int = typer.Option(1, "--tasks", min=1, help="How many tasks to attack (task indices 0..N-1)."),
    backend: str = typer.Option("docker", help="Sandbox backend: docker or bwrap."),
    json_path: str = typer.Option("", "--json", help="Also write the whole report as JSON here (for CI)."),
    attack: list[str] = typer.Option(
        [], "--attack", help="Play only this attack (repeatable); default: every attack that applies."
    ),
    list_attacks: bool = typer.Option(
        False, "--list", help="List the attacks (built-in and plugins), then exit."
    ),
    parser: str = typer.Option("", "--parser", help=PARSER_HELP),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    episodes: int = typer.Option(
        4,
        "--episodes",
        min=1,
        help="Episodes per task for the attacks that guess (the forge-* ones): each reports its win rate, "
        "exploited when it beats what a blind guess at the plan's odds would win.",
    ),
) -> None:
    """Play the reward-hacking attack library against an env's verifier, through env.step only.

    Per task: the controls (the oracle passes, the untouched start fails), then every attack that
    applies, each reported as contained, exploited or not applicable with its evidence. Exits 1
    when anything is exploited, a control fails or an attack could not be played.
    """
    import json

    from agentrl.checks.audit import AuditError, attacks, format_finding, run_audit
    from agentrl.env.registry import make

    if list_attacks:
        for a in attacks():
            typer.echo(f"{a.name:30s} {a.description}")
        return
    if not env_id:
        typer.echo("error: give an environment id (agentrl envs list shows them), or --list", err=True)
        raise typer.Exit(2)
    try:
        env = played(make(env_id, backend=backend, **format_override(parser), **set_overrides(set_)), env_id)
    except KeyError as exc:
        typer.echo(f"error: {exc.args[0]}", err=True)
        raise typer.Exit(2) from None
    try:
        report = run_audit(
            env,
            env_id=env_id,
            tasks=tasks,
            only=attack or None,
            on_finding=lambda f: typer.echo(format_finding(f)),
            episodes=episodes,
        )
    except AuditError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    finally:
        env.close()
    for c in report.controls:
        typer.echo(f"[control {'ok' if c.ok else 'FAILED'}] {c.task_id}: {c.reason}")
    typer.echo(
        f"{env_id} ({backend}): {report.summary()}; "
        f"controls {'ok' if all(c.ok for c in report.controls) else 'FAILED'} ({report.seconds:.0f}s)"
    )
    if json_path:
        Path(json_path).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    sys.exit(0 if report.ok else 1)
