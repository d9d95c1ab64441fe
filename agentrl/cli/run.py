"""The commands that run a model, at the top of the command line: `agentrl sft`, `demos`, `train`, `eval`,
`rollout`, `gateway` and `demo`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from agentrl.cli.common import error, validated

# The config models whose fields are options: light modules (pydantic, no torch, no vLLM). Every field
# becomes an option (`agentrl.cli.options`), with the field's description and default, so that each
# setting is written once, in its model.
from agentrl.cli.options import model_options, settings_command
from agentrl.eval.evaluate import EvalConfig
from agentrl.rollout.config import RolloutConfig
from agentrl.train.config import ModelSettings, SFTConfig, TrainConfig

# Merged into the top-level `agentrl` (added without a name): `agentrl train`, not `agentrl run train`.
run_app = typer.Typer()


# `--model DIR` and `--lora '{rank: 16}'`: SFTConfig.model's two fields, under its own heading.
_SFT_MODEL_OPTIONS = model_options(
    ModelSettings,
    into="model",
    names={"path": "--model", "lora": "--lora"},
    required=True,
    panel=f"model: {SFTConfig.model_fields['model'].description}",
)


@settings_command(
    run_app,
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

    cfg = validated(SFTConfig, "option", **settings)
    typer.echo(str(launch(cfg, nproc=nproc)))


@settings_command(
    run_app, "demos", model_options(RolloutConfig, into="rollout", flat=True, only={"concurrency"})
)
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
        from agentrl.core.errors import check_model_dir

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
        rollout=validated(RolloutConfig, "option", **settings.get("rollout", {})),
    )
    typer.echo(json.dumps({"out": out, **asdict(stats)}, indent=2))
    if stats.passed == 0:  # nothing to train on: a script must not go on to `agentrl sft` with this file
        error(
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


@settings_command(run_app, "train", _TRAIN_OPTIONS, context_settings={"allow_extra_args": True})
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
    run_app,
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
    from agentrl.core.errors import check_model_dir
    from agentrl.eval.evaluate import evaluate

    for m in settings["models"]:
        check_model_dir(m, adapter_ok=True)  # a LoRA adapter is evaluated on its base (multi-LoRA engine)
    if backend:
        settings["env_kwargs"] = {**settings.get("env_kwargs", {}), "backend": backend}
    cfg = validated(EvalConfig, "option", **settings)
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
        error(
            f"every episode of {', '.join(broken)} ended outside the policy's control (see the warning above); "
            "its pass@k measures nothing"
        )
        raise typer.Exit(1)


@settings_command(
    run_app,
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

    cfg = validated(RolloutConfig, "option", **settings)
    from agentrl.core.errors import check_model_dir
    from agentrl.env.registry import spec

    spec(env)  # an unknown id: a UserError naming the closest ones
    check_model_dir(model)
    from agentrl.env.registry import task_source

    env_kwargs = {"backend": backend} if backend else {}
    source = task_source(env, split=split, **env_kwargs)
    tasks = [source.get(i, split) for i in range(n)]
    from agentrl.core.runlog import quiet_libraries

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
    run_app,
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
    parser: str = typer.Option("hermes", help="Tool-call format of the model (agentrl.env.parsers)."),
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
    from agentrl.core.errors import check_model_dir
    from agentrl.env.parsers import get_parser
    from agentrl.gateway.serve import serve
    from agentrl.rollout.engine import make_policy

    cfg = validated(RolloutConfig, "option", **settings)
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


@run_app.command("demo")
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
    from agentrl.core.errors import check_nproc
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
