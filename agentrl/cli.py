"""The `agentrl` command line. Each command imports what it needs when it runs, so `--help` is instant."""

from __future__ import annotations

import sys

import typer

app = typer.Typer(
    help="agentrl: agentic multi-turn RL environments, verifiers, training and evaluation.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
sandbox_app = typer.Typer(
    help="Sandbox backends: build images, diagnose, reap leaked containers.", no_args_is_help=True
)
app.add_typer(sandbox_app, name="sandbox")


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
) -> None:
    """Remove sandbox containers whose run is gone (found by their agentrl labels)."""
    from agentrl.sandbox.reaper import reap

    removed = reap(include_live=all_runs)
    typer.echo(f"removed {len(removed)} container(s)")
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


@app.command("demo")
def demo(
    out: str = typer.Option("runs/demo", help="Directory for the demo's outputs."),
) -> None:
    """Run the main job end to end: as far as the pipeline has been built, and say which stages ran."""
    from agentrl.demo import run_demo

    sys.exit(run_demo(out))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
