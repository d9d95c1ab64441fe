"""`agentrl sandbox`: build the images, reap leaked containers, say which backends work here."""

from __future__ import annotations

import sys

import typer

sandbox_app = typer.Typer(
    help="Sandbox backends: build images, diagnose, reap leaked containers.", no_args_is_help=True
)


@sandbox_app.command("build")
def sandbox_build(
    base: bool = typer.Option(
        False, "--base", help="Build only the base images (debootstrap + docker import)."
    ),
    force: bool = typer.Option(False, "--force", help="Rebuild even when the recipe hash matches."),
) -> None:
    """Build the sandbox images offline: base images from debootstrap, then environment images from their Dockerfiles."""
    from agentrl.sandbox.images import build_all

    for tag in build_all(base=True, envs=not base, force=force):
        typer.echo(tag)


@sandbox_app.command("reap")
def sandbox_reap(
    all_runs: bool = typer.Option(False, "--all", help="Remove every agentrl container, live runs included."),
    hosts: list[str] = typer.Option(
        [],
        "--host",
        help="Docker engine to reap (repeatable): unix:///..., tcp://host:2376, ssh://user@host. "
        "Default: DOCKER_HOST, else the local socket.",
    ),
    run: str | None = typer.Option(
        None, "--run", help="Remove every container of this run id (agentrl.run_id label), live or not."
    ),
) -> None:
    """Remove sandbox containers whose run is gone (found by their agentrl labels)."""
    from agentrl.sandbox.reaper import reap

    for host in hosts or [None]:
        removed = reap(include_live=all_runs, host=host, run=run)
        typer.echo(f"removed {len(removed)} container(s)" + (f" on {host}" if host else ""))
        for name in removed:
            typer.echo(f"  {name}")


@sandbox_app.command("doctor")
def sandbox_doctor() -> None:
    """Say which sandbox backends work on this machine, and why the others do not."""
    from agentrl.sandbox.doctor import diagnose

    ok_any = False
    for report in diagnose():
        mark = "ok" if report.ok else "no"
        ok_any |= report.ok
        typer.echo(f"[{mark}] {report.backend:7s} {report.detail}")
    sys.exit(0 if ok_any else 1)
