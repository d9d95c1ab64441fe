"""The `agentrl` command line. Each command imports what it needs when it runs, so `--help` is instant.

Errors, one mechanism for every command (`_Group.invoke`): bad input (a `UserError`, an invalid
config, a usage error) prints one line, `error: ...`, and exits 2, without a traceback;
`agentrl --debug COMMAND` (or AGENTRL_DEBUG=1) shows the traceback. Anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperGroup

# The config models whose fields are options: light modules (pydantic, no torch, no vLLM). Every field
# becomes an option (`agentrl.cli_options`), with the field's description and default, so that each
# setting is written once, in its model.
from agentrl.cli_options import model_options, settings_command
from agentrl.eval.evaluate import EvalConfig
from agentrl.kit.warm_start import WarmStartRecipe
from agentrl.rollout.config import RolloutConfig
from agentrl.train.config import ModelSettings, SFTConfig, TrainConfig

_debug = os.environ.get("AGENTRL_DEBUG", "") not in ("", "0")


def _user_error_message(exc: BaseException) -> str | None:
    """The one-line message for an exception that is the user's input going wrong; None for a bug."""
    from agentrl.errors import UserError, format_validation_error, one_line

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
            _error(f"{exc.format_message()} (see `{where} --help`)")
            raise typer.Exit(2) from None
        except Exception as exc:
            message = _user_error_message(exc)
            if message is None or _debug:
                raise
            _error(message)
            raise typer.Exit(2) from None


def _error(message: str) -> None:
    from agentrl.errors import one_line

    typer.echo(f"error: {one_line(message)}", err=True)


def _validated(model_cls: Any, what: str, **fields: Any) -> Any:
    """`model_cls(**fields)` of the options given (None: not given, the model's default holds), an
    invalid value said in one line with the option's name."""
    from pydantic import ValidationError

    from agentrl.errors import UserError, format_validation_error

    try:
        return model_cls(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise UserError(format_validation_error(exc, model_cls, what=what)) from None


def _format_override(parser: str) -> dict[str, str]:
    """`agentrl.make` overrides for a `--parser` option ("": the environment's own format)."""
    return {"parser": parser} if parser else {}


def _settings(pairs: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` options as `agentrl.make` overrides; a value is read as YAML (`path=tasks/`,
    `max_turns=5`, `from_map={"python:*": "agentrl/base:bookworm"}`)."""
    import yaml

    from agentrl.errors import UserError

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set {pair!r}: expected KEY=VALUE, e.g. --set path=tasks/")
        out[key.strip()] = yaml.safe_load(value) if value.strip() else ""
    return out


_SET_HELP = "An environment setting, KEY=VALUE (repeatable; the value read as YAML): --set path=tasks/."

_PARSER_HELP = "Tool-call format the environment is made with (hermes, llama3-json); default: its own."


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


sandbox_app = typer.Typer(
    help="Sandbox backends: build images, diagnose, reap leaked containers.", no_args_is_help=True
)
app.add_typer(sandbox_app, name="sandbox")
envs_app = typer.Typer(help="Registered environments.", no_args_is_help=True)
app.add_typer(envs_app, name="envs")
env_app = typer.Typer(help="One environment: show its spec, check its contract.", no_args_is_help=True)
app.add_typer(env_app, name="env")
model_app = typer.Typer(
    help="Local models: build the tiny Qwen2 model and tokenizer, warm-start it, merge a LoRA adapter.",
    no_args_is_help=True,
)
app.add_typer(model_app, name="model")
verifier_app = typer.Typer(
    help="Verifier plugins: list them, check an environment's verifier on its tasks, audit it with attacks.",
    no_args_is_help=True,
)
app.add_typer(verifier_app, name="verifier")
tasks_app = typer.Typer(
    help="Task sets: synthesize them, export them as Harbor / SWE-bench.", no_args_is_help=True
)
app.add_typer(tasks_app, name="tasks")
tasks_synth_app = typer.Typer(help="Synthesize tasks for an environment.", no_args_is_help=True)
tasks_app.add_typer(tasks_synth_app, name="synth")


@envs_app.command("list")
@env_app.command("list")  # `agentrl env list`: the same list, under the group of the other env commands
def envs_list() -> None:
    """List every registered environment id (built-ins and `agentrl.envs` entry-point plugins)."""
    from agentrl.registry import all_specs

    for s in all_specs():
        typer.echo(f"{s.id:32s} {s.description}")


@env_app.command("show")
def env_show(
    env_id: str = typer.Argument(..., help="Environment id, e.g. agentrl/calc-v0."),
    set_: list[str] = typer.Option([], "--set", help=_SET_HELP),
) -> None:
    """Print an environment's spec, its settings (type, default, what each does), tools, and one sample task."""
    import json

    from agentrl.registry import make, settings_lines, spec

    s = spec(env_id)
    typer.echo(f"id:          {s.id}")
    typer.echo(f"entry point: {s.entry_point}")
    typer.echo(f"max turns:   {s.max_turns}")
    typer.echo(f"description: {s.description}")
    typer.echo("\n".join(settings_lines(s)))
    env = make(env_id, backend="local", use_pool=False, **_settings(set_))
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


def _played(env: Any, env_id: str) -> Any:
    """The environment the checks exercise: a harness env's (`agentrl.gateway.HarnessEnv`) is the one its
    agent plays (its tasks, tools, sandbox and verifier); the harness adds nothing they could check."""
    from agentrl.gateway.harness import is_harness_env

    if not is_harness_env(env):
        return env
    typer.echo(f"{env_id} is a harness: checking the environment it plays, {env.env.env_id}")
    return env.env


@env_app.command("check")
def env_check(
    env_id: str = typer.Argument(..., help="Environment id, e.g. agentrl/calc-v0."),
    backend: str = typer.Option("docker", help="Sandbox backend: docker, bwrap or local."),
    tasks: int = typer.Option(5, help="How many tasks the oracle must solve."),
    parser: str = typer.Option("", "--parser", help=_PARSER_HELP),
    set_: list[str] = typer.Option([], "--set", help=_SET_HELP),
) -> None:
    """Run `check_env` on an environment, then its oracle on N tasks (each must score 1)."""
    from agentrl.agents import run_episode
    from agentrl.checks.env_check import check_env
    from agentrl.errors import UserError
    from agentrl.protocols import has_oracle
    from agentrl.registry import make

    env = _played(make(env_id, backend=backend, **_format_override(parser), **_settings(set_)), env_id)
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
    parser: str = typer.Option("", "--parser", help=_PARSER_HELP),
    set_: list[str] = typer.Option([], "--set", help=_SET_HELP),
) -> None:
    """Check the env's verifier on N tasks: the reference must pass, the untouched start must fail.

    Prints each task as kept or dropped with the reason; exits 1 if any task is dropped.
    """
    from agentrl.checks.verifier_check import check_verifier
    from agentrl.registry import make

    env = make(
        env_id, backend=backend, **_format_override(parser), **_settings(set_)
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
    parser: str = typer.Option("", "--parser", help=_PARSER_HELP),
    set_: list[str] = typer.Option([], "--set", help=_SET_HELP),
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
    from agentrl.registry import make

    if list_attacks:
        for a in attacks():
            typer.echo(f"{a.name:30s} {a.description}")
        return
    if not env_id:
        typer.echo("error: give an environment id (agentrl envs list shows them), or --list", err=True)
        raise typer.Exit(2)
    try:
        env = _played(make(env_id, backend=backend, **_format_override(parser), **_settings(set_)), env_id)
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

    from agentrl.envs.python_repair.synth import SynthConfig, statistics, synthesize
    from agentrl.task import save_tasks

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
    set_: list[str] = typer.Option([], "--set", help=_SET_HELP),
) -> None:
    """Write an env's tasks as Harbor task directories and SWE-bench-style JSONL, with their image recipes."""
    from agentrl.envs.harbor.export import export_harbor, export_swebench
    from agentrl.errors import UserError
    from agentrl.registry import task_source

    if fmt not in ("harbor", "swebench", "both"):
        raise UserError(f"--format {fmt!r}: expected harbor, swebench or both")
    source = task_source(env_id, split=split, **_settings(set_))
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


@model_app.command("init")
def model_init(
    kind: str = typer.Argument(..., help="Which model to build; only `tiny` exists (a random-init Qwen2)."),
    out: str = typer.Option(
        ..., "--out", help="Directory to write (created; reused if it holds the same build)."
    ),
    seed: int = typer.Option(
        0, "--seed", help="Seed of the weight initialisation (the tokenizer does not depend on it)."
    ),
) -> None:
    """Build a tiny Qwen2-architecture model and its BPE tokenizer, loadable by transformers and vLLM."""
    if kind != "tiny":
        raise typer.BadParameter(f"unknown model kind {kind!r}; the only kind is 'tiny'", param_hint="KIND")
    from agentrl.kit.tiny_model import init_tiny

    typer.echo(init_tiny(out, seed=seed))


@settings_command(
    model_app,
    "warm-start",
    model_options(WarmStartRecipe, names={"demo_kinds": ("--demo-kinds", "--kinds"), "start_from": "--from"}),
)
def model_warm_start(
    settings: dict[str, Any],
    out: str = typer.Option(
        ..., "--out", help="Checkpoint directory (reused when it holds the same recipe)."
    ),
    force: bool = typer.Option(False, "--force", help="Rebuild even when the cached recipe matches."),
) -> None:
    """Tiny model -> oracle demonstrations -> SFT -> held-out pass@1, cached by the recipe's hash. Prints JSON.

    Unset options take the recipe defaults (agentrl.kit.warm_start.WarmStartRecipe): the calc-v0 recipe
    tuned to land in RL's learnability band. For another environment, `--target-pass 0.2` trains in
    measured rounds until the held-out pass@1 reaches the band, and says what to try if it does not.
    `--from PATH` fine-tunes a checkpoint of yours instead of the tiny model; a harness env (your agent)
    plays the demonstrations and the measurement in its own prompt and tool format.
    """
    import json

    from agentrl.kit.warm_start import advice, warm_start

    recipe = _validated(WarmStartRecipe, "option", **settings)
    result = warm_start(out, recipe, force=force)
    said = advice(result.record, recipe)
    rounds = result.record["build"].get("rounds") or []
    shown = result.model_dump(exclude={"record"})
    shown["rounds"] = [
        {k: r.get(k) for k in ("round", "sft_steps", "sft_last_loss", "pass_at_1")} for r in rounds
    ]
    shown["task_pass_rates"] = (result.record.get("measurement") or {}).get("task_pass_rates")
    shown["advice"] = said
    typer.echo(json.dumps(shown, indent=2))
    if said:
        typer.echo(f"warm start: {said}", err=True)


@model_app.command("merge")
def model_merge(
    adapter: str = typer.Argument(
        ..., help="LoRA adapter directory (a checkpoint-N or final/ of a run trained with model.lora)."
    ),
    out: str = typer.Option(..., "--out", help="Directory to write the full model to (new or empty)."),
    base: str | None = typer.Option(
        None, "--base", help="Base checkpoint; default: the one the adapter names (adapter_config.json)."
    ),
) -> None:
    """Merge a LoRA adapter into its base: a full Hugging Face model (with the tokenizer) that
    transformers, vLLM and `agentrl eval` load like any other checkpoint."""
    from agentrl.train.lora import merge_adapter

    typer.echo(merge_adapter(adapter, out, base=base))


# `--model DIR` and `--lora '{rank: 16}'`: SFTConfig.model's two fields, under its own heading.
_SFT_MODEL_OPTIONS = model_options(
    ModelSettings,
    into="model",
    names={"path": "--model", "lora": "--lora"},
    required=True,
    panel=f"model: {SFTConfig.model_fields['model'].description}",
)


@settings_command(
    app,
    "sft",
    model_options(SFTConfig, names={"only_passed": "--only-passed/--all"}, required=True, exclude={"model"}),
    _SFT_MODEL_OPTIONS,
)
def sft(
    settings: dict[str, Any],
    nproc: int = typer.Option(1, help="Processes (FSDP ranks); >1 launches torchrun."),
) -> None:
    """Supervised fine-tuning on trajectories; only assistant tokens train (the RL loss mask)."""
    from agentrl.train.sft import launch

    cfg = _validated(SFTConfig, "option", **settings)
    typer.echo(str(launch(cfg, nproc=nproc)))


@settings_command(app, "demos", model_options(RolloutConfig, into="rollout", flat=True, only={"concurrency"}))
def demos(
    settings: dict[str, Any],
    env_id: str = typer.Argument(..., help="Environment id, e.g. agentrl/calc-v0; it must have an oracle."),
    n: int = typer.Option(..., "--n", min=1, help="How many demonstrations (one per task)."),
    out: str = typer.Option(..., "--out", help="Trajectory JSONL to write (the input of `agentrl sft`)."),
    model: str = typer.Option(
        "",
        "--model",
        help="Checkpoint whose tokenizer and chat template make the ids; default: the tiny model.",
    ),
    split: str = typer.Option("train", "--split", help="Task split: train, validation or test."),
    start: int = typer.Option(0, "--start", help="First task index of the split."),
    kinds: str = typer.Option(
        "", "--kinds", help="Comma-separated task kinds (task.metadata['kind']) to keep; default all."
    ),
    backend: str = typer.Option(
        "local",
        "--backend",
        help="Sandbox backend for the oracle's tool calls: local (trusted oracle code), docker, bwrap.",
    ),
) -> None:
    """Oracle demonstrations through the rollout engine and its masker: the RL trainer's exact token ids and loss mask.

    For a harness environment (your own agent) the agent plays them: the oracle's actions in its own
    prompt and tool format, token-exact as the gateway records them."""
    import json
    import tempfile
    from dataclasses import asdict

    from transformers import AutoTokenizer

    from agentrl.kit.demonstrations import generate_demos

    if split not in ("train", "validation", "test"):
        raise typer.BadParameter(
            f"unknown split {split!r}; use train, validation or test", param_hint="--split"
        )
    if not model:
        from agentrl.kit.tiny_model import init_tiny

        model = str(init_tiny(Path(tempfile.gettempdir()) / "agentrl-tiny", seed=0))
    else:
        from agentrl.errors import check_model_dir

        check_model_dir(model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    kind_list = [k.strip() for k in kinds.split(",") if k.strip()] or None
    _, stats = generate_demos(
        env_id,
        n,
        out,
        tokenizer,
        split=split,
        start=start,
        kinds=kind_list,
        backend=backend,
        rollout=_validated(RolloutConfig, "option", **settings.get("rollout", {})),
    )
    typer.echo(json.dumps({"out": out, **asdict(stats)}, indent=2))
    if stats.passed == 0:  # nothing to train on: a script must not go on to `agentrl sft` with this file
        _error(
            f"the oracle failed every one of the {stats.episodes} episodes, so {out} holds nothing to train on; "
            f"the first: {stats.first_failure}. Check the environment with `agentrl env check {env_id}`"
        )
        raise typer.Exit(1)
    if stats.passed < stats.episodes:
        typer.echo(
            f"warning: the oracle failed {stats.episodes - stats.passed} of {stats.episodes} episodes "
            f"(`agentrl sft` trains on passed ones only unless --all); the first: {stats.first_failure}",
            err=True,
        )


# Every field of TrainConfig, by section: what `agentrl train --help` lists (a field added to a section is
# an option here, with its description, without an edit in this file).
_TRAIN_OPTIONS = model_options(TrainConfig, panel="Top-level config keys", sections=True)


@settings_command(app, "train", _TRAIN_OPTIONS, context_settings={"allow_extra_args": True})
def train_cmd(
    ctx: typer.Context,
    settings: dict[str, Any],
    config: str = typer.Argument(
        ...,
        help="YAML or TOML config (see examples/); its keys are the options below, by section.",
    ),
    nproc: int = typer.Option(1, help="Processes (FSDP ranks); >1 launches torchrun."),
    force: bool = typer.Option(
        False,
        "--force",
        help="Resume even though the config changed (the old config is kept beside it), or start over "
        "when resume is off and the run directory already holds a run.",
    ),
    nnodes: int = typer.Option(
        1, "--nnodes", min=1, help="Nodes training together (run this command on each; --nproc per node)."
    ),
    node_rank: int = typer.Option(
        0, "--node-rank", min=0, help="This node's rank, 0..nnodes-1 (node 0 generates)."
    ),
    rdzv_endpoint: str | None = typer.Option(
        None, "--rdzv-endpoint", help="HOST:PORT of node 0, the same on every node (with --nnodes > 1)."
    ),
    ray: bool = typer.Option(
        False,
        "--ray",
        help="Rollout engines on the Ray cluster this machine joined (--cluster.ray-address auto).",
    ),
) -> None:
    """GRPO training with the learnability curriculum under FSDP2.

    Every config key is also an option (`--optim.lr 3e-5`, listed below by section; the defaults shown are
    the models', which the config file's values replace), and so is an extra `key.sub=value` argument
    (`optim.lr=3e-5`, the value read as YAML). Resumes from the run directory's newest checkpoint when
    there is one (same config, or --force). Ctrl-C saves a checkpoint and says how to continue.
    """
    from agentrl.train.config import load_config
    from agentrl.train.launch import launch

    overrides = list(ctx.args)
    given = "ray_address" in settings.get("cluster", {}) or any(
        a.startswith("cluster.ray_address=") for a in overrides
    )
    if ray and not given:
        overrides.append("cluster.ray_address=auto")
    cfg = load_config(config, overrides, settings=settings)
    typer.echo(
        str(
            launch(
                cfg, nproc=nproc, force=force, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint
            )
        )
    )


@settings_command(
    app,
    "eval",
    model_options(
        EvalConfig,
        exclude={"rollout"},
        names={"models": "--model", "names": "--name", "ks": "--k", "samples": ("--samples", "--n")},
        required=True,
    ),
    model_options(
        RolloutConfig,
        into="rollout",
        flat=True,
        # Each episode is its own rollout (`--samples` sets the episodes per task); no weights are
        # pushed during an evaluation.
        exclude={"group_size", "on_push", "max_restarts"},
        panel="rollout: sampling and limits (the budget), episodes in flight",
    ),
)
def eval_cmd(
    settings: dict[str, Any],
    backend: str = typer.Option(
        "", help="Sandbox backend override (docker, bwrap, local): env_kwargs' backend; part of the budget."
    ),
) -> None:
    """Budget-controlled, resumable pass@k evaluation; writes episodes, summary.json, report.md and plots."""
    from agentrl.errors import check_model_dir
    from agentrl.eval.evaluate import evaluate

    for m in settings["models"]:
        check_model_dir(m, adapter_ok=True)  # a LoRA adapter is evaluated on its base (multi-LoRA engine)
    if backend:
        settings["env_kwargs"] = {**settings.get("env_kwargs", {}), "backend": backend}
    cfg = _validated(EvalConfig, "option", **settings)
    try:
        summaries = evaluate(cfg)  # a budget mismatch, an unknown env id: UserErrors, said in one line
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    for s in summaries:
        typer.echo(f"{s.model}: " + ", ".join(f"{key} {v:.3f}" for key, v in s.pass_at_dict().items()))
    from agentrl.eval.paired import load_comparisons

    for c in load_comparisons(Path(cfg.out) / "summary.json"):  # each later model against the first
        typer.echo(c.verdict)
    typer.echo(f"report: {cfg.out}/report.md")
    from agentrl.eval.failures import OUTSIDE_THE_POLICY

    broken = [s.model for s in summaries if set(s.finish_reasons) <= set(OUTSIDE_THE_POLICY)]
    if broken:  # nothing was measured: the warning above says why; a script must not read it as a result
        _error(
            f"every episode of {', '.join(broken)} ended outside the policy's control (see the warning above); "
            "its pass@k measures nothing"
        )
        raise typer.Exit(1)


@settings_command(
    app,
    "rollout",
    model_options(RolloutConfig, flat=True, exclude={"on_push", "max_restarts"}),  # no pushes here
)
def rollout_cmd(
    settings: dict[str, Any],
    env: str = typer.Option(..., "--env", help="Environment id, e.g. agentrl/calc-v0."),
    model: str = typer.Option(
        ..., "--model", help="Checkpoint directory (Hugging Face layout) served by vLLM."
    ),
    n: int = typer.Option(
        8, "--tasks", "--n", min=1, help="Tasks: indices 0..N-1 of the environment's task generator."
    ),
    out: str = typer.Option(..., "--out", help="Trajectory JSONL file to write."),
    split: str = typer.Option("train", "--split", help="Task split."),
    seed: int = typer.Option(0, help="Base seed of the episodes' sampling and environment seeds."),
    backend: str = typer.Option("", help="Sandbox backend override (docker, bwrap, local)."),
    in_process: bool | None = typer.Option(
        None, "--in-process/--async-engine", help="vLLM engine in this process (default on CPU) or AsyncLLM."
    ),
) -> None:
    """Roll out N tasks x group-size episodes with a vLLM policy; write trajectories as JSONL."""
    from tqdm import tqdm

    from agentrl.rollout.engine import make_policy
    from agentrl.rollout.loop import collect_sync
    from agentrl.rollout.trajectory import save_trajectories

    cfg = _validated(RolloutConfig, "option", **settings)
    from agentrl.errors import check_model_dir
    from agentrl.registry import spec

    spec(env)  # an unknown id: a UserError naming the closest ones
    check_model_dir(model)
    from agentrl.registry import task_source

    env_kwargs = {"backend": backend} if backend else {}
    source = task_source(env, split=split, **env_kwargs)
    tasks = [source.get(i, split) for i in range(n)]
    from agentrl.runlog import quiet_libraries

    quiet_libraries(Path(f"{out}.engine.log"))  # vLLM's logs beside the trajectories, not over the bar
    bar = tqdm(total=n * cfg.group_size, desc="rollout", unit="ep")
    rewards: list[float] = []

    def on_trajectory(t) -> None:
        rewards.append(t.reward)
        bar.set_postfix(mean_reward=f"{sum(rewards) / len(rewards):.3f}", last=t.finish_reason)
        bar.update(1)

    with make_policy(model, cfg, seed=seed, in_process=in_process) as policy:
        trajectories = collect_sync(
            env, tasks, policy, cfg, seed=seed, env_kwargs=env_kwargs, on_trajectory=on_trajectory
        )
    bar.close()
    save_trajectories(out, trajectories)
    reasons: dict[str, int] = {}
    for t in trajectories:
        reasons[t.finish_reason] = reasons.get(t.finish_reason, 0) + 1
    drifted = sum(bool(t.drift and t.drift.drifted) for t in trajectories)
    typer.echo(
        f"{len(trajectories)} trajectories -> {out}; mean reward {sum(rewards) / len(rewards):.3f}; "
        f"finish reasons {reasons}; drifted {drifted}"
    )


@settings_command(
    app,
    "gateway",
    model_options(
        RolloutConfig, flat=True, only={"temperature", "top_p", "max_tokens_per_turn", "max_total_tokens"}
    ),
)
def gateway_cmd(
    settings: dict[str, Any],
    model: str = typer.Option(
        ..., "--model", help="Checkpoint directory (Hugging Face layout) served by vLLM."
    ),
    sessions: int = typer.Option(1, "--sessions", min=1, help="Session URLs to open (one per episode)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, help="Port to listen on (0: any free port)."),
    unix_socket: str = typer.Option("", "--unix-socket", help="Listen on this unix socket instead of TCP."),
    parser: str = typer.Option("hermes", help="Tool-call format of the model (agentrl.parsers)."),
    out: str = typer.Option(
        "", "--out", help="Write the sessions' calls here as trajectories (JSONL) at exit."
    ),
    seed: int = typer.Option(0, help="The engine's sampling seed."),
    tools_prompt: str = typer.Option(
        "system",
        "--tools-prompt",
        help="Where a request's tools reach the model: 'system' (written into the system message by the "
        "tool-call format, as agentrl's environments show them) or 'template' (the chat template's tools).",
    ),
    alias: list[str] = typer.Option(
        [], "--alias", help="Another model name to answer to (the one your agent hard-codes); repeatable."
    ),
) -> None:
    """Serve a checkpoint as an OpenAI-compatible API, one session URL per episode, until Ctrl-C.

    The calls are written (--out) as trajectories marked not scored: no verifier ran. To train an agent
    that runs as its own process, use the agent service (`HarnessEnv(service=...)`, docs/AGENTS.md)."""
    from agentrl.errors import check_model_dir
    from agentrl.gateway.serve import serve
    from agentrl.parsers import get_parser
    from agentrl.rollout.engine import make_policy

    cfg = _validated(RolloutConfig, "option", **settings)
    check_model_dir(model)
    get_parser(parser)  # an unknown format: one line naming the registered ones
    if tools_prompt not in ("system", "template"):
        raise typer.BadParameter(f"--tools-prompt takes 'system' or 'template', got {tools_prompt!r}")
    with make_policy(model, cfg, seed=seed) as policy:
        written = serve(
            policy,
            rollout=cfg,
            sessions=sessions,
            host=host,
            port=port,
            uds=unix_socket or None,
            parser=parser,
            aliases=alias,
            tools_prompt=tools_prompt,
            out=out or None,
            echo=typer.echo,
        )
    if out:
        typer.echo(f"{written} trajectories -> {out}", err=True)


@app.command("demo")
def demo(
    out: str = typer.Option("runs/demo", help="Directory for the demo's outputs (reused by a second run)."),
    quick: bool = typer.Option(
        False, "--quick", help="A minutes-long smoke version (tiny budgets; for tests)."
    ),
    nproc: int = typer.Option(2, help="Trainer processes (FSDP ranks) under torchrun."),
    steps: int = typer.Option(None, help="GRPO steps (default: examples/calc_grpo.yaml)."),
    eval_tasks: int = typer.Option(None, help="Held-out tasks for before/after evaluation."),
    eval_samples: int = typer.Option(None, help="Samples per held-out task."),
    seed: int = typer.Option(0, help="Seed of the warm start (its weight initialisation and SFT shuffling)."),
    numerics: str = typer.Option(
        "pinned",
        help="CPU kernel paths: pinned (the same rounding on any x86-64 box: agentrl.kit.numerics) or native.",
    ),
    overrides: list[str] = typer.Option(
        [],
        "--set",
        help="Override a key of the GRPO config (examples/calc_grpo.yaml), e.g. --set optim.lr=5e-5.",
    ),
) -> None:
    """Train a small tool-using agent with GRPO on calc-v0 and report pass@k before and after."""
    from agentrl.errors import check_nproc
    from agentrl.kit.demo import run_demo

    check_nproc(nproc)
    if numerics not in ("pinned", "native"):
        raise typer.BadParameter(f"{numerics!r} is not pinned or native", param_hint="--numerics")
    sys.exit(
        run_demo(
            out,
            quick=quick,
            nproc=nproc,
            steps=steps,
            eval_tasks=eval_tasks,
            eval_samples=eval_samples,
            seed=seed,
            numerics=numerics,  # type: ignore[arg-type]
            overrides=overrides,
        )
    )


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
