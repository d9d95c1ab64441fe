"""`agentrl model`: build the tiny model and tokenizer, warm-start it, merge a LoRA adapter."""

from __future__ import annotations

from typing import Any

import typer

from agentrl.cli.common import validated

# The config models whose fields are options: light modules (pydantic, no torch, no vLLM). Every field
# becomes an option (`agentrl.cli.options`), with the field's description and default, so that each
# setting is written once, in its model.
from agentrl.cli.options import model_options, settings_command
from agentrl.kit.warm_start import WarmStartRecipe

model_app = typer.Typer(
    help="Local models: build the tiny Qwen2 model and tokenizer, warm-start it, merge a LoRA adapter.",
    no_args_is_help=True,
)


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

    recipe = validated(WarmStartRecipe, "option", **settings)
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
