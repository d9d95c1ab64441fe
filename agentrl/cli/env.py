"""`agentrl envs`, `agentrl env` (list, show, check) and `agentrl tasks` (synth, export)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from agentrl.cli.common import PARSER_HELP, SET_HELP, format_override, played, set_overrides

envs_app = typer.Typer(help="Registered environments.", no_args_is_help=True)
env_app = typer.Typer(help="One environment: show its spec, check its contract.", no_args_is_help=True)
tasks_app = typer.Typer(
    help="Task sets: synthesize them, export them as Harbor / SWE-bench.", no_args_is_help=True
)
tasks_synth_app = typer.Typer(help="Synthesize tasks for an environment.", no_args_is_help=True)
tasks_app.add_typer(tasks_synth_app, name="synth")


@envs_app.command("list")
@env_app.command("list")  # `agentrl env list`: the same list, under the group of the other env commands
def envs_list() -> None:
    """List every registered environment id (built-ins and `agentrl.envs` entry-point plugins)."""
    from agentrl.env.registry import all_specs

    for s in all_specs():
        typer.echo(f"{s.id:32s} {s.description}")


@env_app.command("show")
def env_show(
    env_id: str = typer.Argument(..., help="Environment id, e.g. agentrl/calc-v0."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """Print an environment's spec, its settings (type, default, what each does), tools, and one sample task."""
    import json

    from agentrl.env.registry import make, settings_lines, spec

    s = spec(env_id)
    typer.echo(f"id:          {s.id}")
    typer.echo(f"entry point: {s.entry_point}")
    typer.echo(f"max turns:   {s.max_turns}")
    typer.echo(f"description: {s.description}")
    typer.echo("\n".join(settings_lines(s)))
    env = make(env_id, backend="local", use_pool=False, **set_overrides(set_))
    typer.echo(
        f"tool calls:  at most {env.max_tool_calls_per_step} per message, {env.step_budget_s:g}s in all"
    )
    typer.echo(f"verifier:    {env.verifier.name}")
    typer.echo("tools:")
    for schema in env.toolbox.schemas:
        typer.echo("  " + json.dumps(schema["function"]))
    task = env.tasks.get(0, env.split)
    typer.echo(f"sample task ({task.id}):\n  " + task.prompt.replace("\n", "\n  "))
    env.close()


@env_app.command("check")
def env_check(
    env_id: str = typer.Argument(..., help="Environment id, e.g. agentrl/calc-v0."),
    backend: str = typer.Option("docker", help="Sandbox backend: docker, bwrap or local."),
    tasks: int = typer.Option(5, help="How many tasks the oracle must solve."),
    parser: str = typer.Option("", "--parser", help=PARSER_HELP),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """Run `check_env` on an environment, then its oracle on N tasks (each must score 1)."""
    from agentrl.checks.env_check import check_env
    from agentrl.core.errors import UserError
    from agentrl.env.agents import run_episode
    from agentrl.env.protocols import has_oracle
    from agentrl.env.registry import make

    env = played(make(env_id, backend=backend, **format_override(parser), **set_overrides(set_)), env_id)
    try:
        try:
            check_env(env)
        except AssertionError as exc:  # the environment breaks the contract: say how, no traceback
            typer.echo(f"[!!] {env_id}: {exc}")
            sys.exit(1)
        typer.echo(f"[ok] {env_id}: check_env passed")
        if tasks > 0 and not has_oracle(env):
            raise UserError(
                f"{env_id} has no oracle, so the oracle half of the check cannot run: give the env an "
                "oracle(task) -> agent (a method, or ToolEnv(oracle=...); docs/ENVIRONMENTS.md, Oracles), or pass --tasks 0"
            )
        solved = 0
        for i in range(tasks):
            task = env.tasks.get(i, env.split)
            result = run_episode(env, env.oracle(task), options={"task": task})
            solved += result.reward >= 1.0
            if result.reward < 1.0:
                typer.echo(f"[!!] oracle failed {task.id}: {result.verdict}")
        typer.echo(f"[{'ok' if solved == tasks else '!!'}] oracle solved {solved}/{tasks} tasks")
    finally:
        env.close()
    sys.exit(0 if solved == tasks else 1)


@tasks_synth_app.command("python-repair")
def tasks_synth_python_repair(
    packages: str = typer.Option(
        "toolz,inflection,parse,semver",
        "--packages",
        help="Comma-separated packages (see envs/python_repair/packages.py).",
    ),
    n: int = typer.Option(300, "--n", help="How many tasks in all, spread evenly over the packages."),
    seed: int = typer.Option(0, "--seed", help="Fixes which mutants are tried, so which tasks come out."),
    max_fail_fraction: float = typer.Option(
        0.25, help="Reject a mutant that fails more than this fraction of the passing tests."
    ),
    out: str = typer.Option("", "--out", help="Also write the tasks here as JSONL."),
    cache_dir: str = typer.Option(
        "", "--cache-dir", help="Trial logs directory; default ~/.cache/agentrl/python-repair/synth."
    ),
    every_failing_test: bool = typer.Option(
        False,
        "--every-failing-test",
        help="Keep only tasks whose every failing test gets a twin set (default: tasks whose twin sets make "
        "a blind guess win 1 in 32 at most; the statistics say how many have failing tests no set covers).",
    ),
) -> None:
    """Plant bugs in real packages by AST mutation; keep those the packages' own tests catch. Prints statistics as JSON."""
    import json

    from agentrl.core.task import save_tasks
    from agentrl.envs.python_repair.synth import SynthConfig, statistics, synthesize

    names = [p.strip() for p in packages.split(",") if p.strip()]
    config = SynthConfig(
        seed=seed,
        max_fail_fraction=max_fail_fraction,
        cache_dir=cache_dir or None,
        every_failing_test=every_failing_test,
    )
    result = synthesize(names, n, config)
    trials = [t for log in result.trials.values() for t in log]
    stats = statistics(trials, result.tasks)
    stats["seconds"] = round(result.seconds, 1)
    if out:
        save_tasks(out, result.tasks)
        stats["written_to"] = out
    typer.echo(json.dumps(stats, indent=2))
    if len(result.tasks) < n:
        typer.echo(
            f"only {len(result.tasks)} of {n} tasks: the packages ran out of good candidates", err=True
        )
        sys.exit(1)


@tasks_app.command("export")
def tasks_export(
    env_id: str = typer.Argument(
        ..., help="Environment id whose tasks have hidden tests, e.g. agentrl/python-repair-v0."
    ),
    out: str = typer.Option(
        ..., "--out", help="Folder to write: harbor/ (task directories) and swebench/ (JSONL + images/)."
    ),
    fmt: str = typer.Option("both", "--format", help="harbor, swebench or both."),
    split: str = typer.Option("train", "--split", help="The split whose tasks are written."),
    n: int = typer.Option(0, "--n", min=0, help="Tasks 0..n-1 of the split (0: all of a fixed set)."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """Write an env's tasks as Harbor task directories and SWE-bench-style JSONL, with their image recipes."""
    from agentrl.core.errors import UserError
    from agentrl.env.registry import task_source
    from agentrl.envs.harbor.export import export_harbor, export_swebench

    if fmt not in ("harbor", "swebench", "both"):
        raise UserError(f"--format {fmt!r}: expected harbor, swebench or both")
    source = task_source(env_id, split=split, **set_overrides(set_))
    size = source.size(split)
    count = n or size
    if not count:
        raise UserError(f"{env_id} has an unbounded task supply; say how many with --n")
    tasks = [source.get(i, split) for i in range(count)]
    if fmt in ("harbor", "both"):
        dirs = export_harbor(tasks, Path(out) / "harbor", source_env=env_id)
        typer.echo(f"harbor: {len(dirs)} task directories in {Path(out) / 'harbor'}")
    if fmt in ("swebench", "both"):
        path = export_swebench(tasks, Path(out) / "swebench", source_env=env_id)
        typer.echo(f"swebench: {len(tasks)} instances in {path} (image recipes in {path.parent / 'images'})")
