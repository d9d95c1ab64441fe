"""Command-line options generated from the config models (`agentrl.cli.options`): every field an option,
with its description and default in `--help`, checked against its type before the command runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer
from pydantic import BaseModel, Field
from typer.testing import CliRunner

from agentrl.cli import _Group, app
from agentrl.cli.options import model_options, settings_command, with_options
from agentrl.eval.evaluate import EvalConfig
from agentrl.rollout.config import RolloutConfig
from agentrl.train.config import SFTConfig, TrainConfig


def help_text(*args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--help"])
    assert result.exit_code == 0, result.output
    return squeeze(result.output)


def squeeze(text: str) -> str:
    """`text` without whitespace: help wraps its lines (at hyphens too), the comparisons must not care."""
    return "".join(text.split())


def leaf_keys(model: type[BaseModel], prefix: str = "") -> dict[str, Any]:
    """Every setting of `model` by dotted key, sections walked into."""
    keys: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            keys |= leaf_keys(info.annotation, f"{prefix}{name}.")
        else:
            keys[prefix + name] = info
    return keys


def flag(dotted: str) -> str:
    *sections, name = dotted.split(".")
    return "--" + "".join(f"{s}." for s in sections) + name.replace("_", "-")


def test_train_help_lists_every_section_and_every_key_with_its_description():
    """What examples/calc_grpo.yaml promises: `agentrl train --help` lists the config, section by section."""
    text = help_text("train")
    for name, info in TrainConfig.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            assert squeeze(f"{name}: {info.description}") in text, name  # the section's heading
    keys = leaf_keys(TrainConfig)
    assert len(keys) > 60
    for key, info in keys.items():
        assert flag(key) in text, key
        assert squeeze(info.description) in text, key


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("eval", {**leaf_keys(EvalConfig.model_fields["rollout"].annotation), **EvalConfig.model_fields}),
        ("sft", SFTConfig.model_fields),
        ("rollout", RolloutConfig.model_fields),
    ],
)
def test_each_command_shows_every_field_of_its_models(command, expected):
    text = help_text(command)
    # eval: rollout's fields, flat; neither eval nor rollout pushes weights (no on_push, max_restarts).
    skipped = {"on_push", "max_restarts"} | ({"rollout", "group_size"} if command == "eval" else set())
    for name, info in expected.items():
        if name not in skipped:
            assert squeeze(info.description) in text, (command, name)
    if command == "eval":
        # Each episode of an evaluation is its own rollout: no group size; `--n` stays `--samples`' alias.
        assert "--group-size" not in text and "--samples,--n" in text
    if command in ("eval", "rollout"):
        assert "--on-push" not in text and "--max-restarts" not in text


class Knobs(BaseModel):
    """A stand-in for a config model that gains a field."""

    steps: int = Field(3, ge=1, description="How many steps.")
    ratio: float = Field(0.5, gt=0, le=1, description="A ratio in (0, 1].")
    mode: str = Field("a", description="Which mode.")
    devices: list[int] | None = Field(None, description="Devices, or null for all.")
    sleep: bool = Field(True, description="Sleep between steps.")
    extra: dict[str, Any] = Field(default_factory=dict, description="Anything else, as a YAML mapping.")


class Grown(Knobs):
    new_knob: float = Field(0.25, gt=0, description="A knob added after the command was written.")


def make_app(model: type[BaseModel], **kwargs: Any) -> tuple[typer.Typer, list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []
    demo = typer.Typer(cls=_Group, pretty_exceptions_enable=False)

    @settings_command(demo, "run", model_options(model, into="knobs", **kwargs))
    def run(settings: dict[str, Any], own: int = typer.Option(0, help="The command's own option.")) -> None:
        seen.append({**settings, "own": own})

    @demo.command("other")  # a group of two, so `run` is a subcommand as in agentrl
    def other() -> None:
        pass

    return demo, seen


def test_a_field_added_to_a_model_is_an_option_without_an_edit_to_the_command():
    before, _ = make_app(Knobs)
    after, seen = make_app(Grown)
    assert "--knobs.new-knob" not in CliRunner().invoke(before, ["run", "--help"]).output
    text = squeeze(CliRunner().invoke(after, ["run", "--help"]).output)
    assert (
        squeeze("--knobs.new-knob <float> A knob added after the command was written. [default: 0.25]")
        in text
    )
    result = CliRunner().invoke(after, ["run", "--knobs.new-knob", "0.75"])
    assert result.exit_code == 0, result.output
    assert seen == [{"knobs": {"new_knob": 0.75}, "own": 0}]  # only what was given
    result = CliRunner().invoke(after, ["run", "--knobs.new_knob", "0.5"])  # as config files spell the key
    assert result.exit_code == 0, result.output
    assert seen[-1] == {"knobs": {"new_knob": 0.5}, "own": 0}


def test_values_are_parsed_by_the_fields_type():
    demo, seen = make_app(Knobs)
    args = ["--knobs.steps", "7", "--knobs.devices", "0,1", "--knobs.devices", "3", "--knobs.no-sleep"]
    args += ["--knobs.extra", "{backend: bwrap, n: 2}", "--knobs.mode", "2.0", "--knobs.ratio", "1"]
    result = CliRunner().invoke(demo, ["run", *args, "--own", "5"])
    assert result.exit_code == 0, result.output
    assert seen[-1] == {
        "knobs": {
            "steps": 7,
            "devices": [0, 1, 3],  # comma-separated or repeated
            "sleep": False,
            "extra": {"backend": "bwrap", "n": 2},
            "mode": "2.0",  # a text field keeps its text
            "ratio": 1.0,
        },
        "own": 5,
    }
    assert CliRunner().invoke(demo, ["run", "--knobs.devices", "null"]).exit_code == 0
    assert seen[-1]["knobs"] == {"devices": None}
    assert CliRunner().invoke(demo, ["run", "--knobs.devices", "[4, 5]"]).exit_code == 0
    assert seen[-1]["knobs"] == {"devices": [4, 5]}


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--knobs.steps", "many"], "invalid value for --knobs.steps: input should be a valid integer"),
        (["--knobs.steps", "0"], "invalid value for --knobs.steps: input should be greater than or equal to 1 (got '0')"),
        (["--knobs.ratio", "2"], "invalid value for --knobs.ratio: input should be less than or equal to 1"),
        (["--knobs.devices", "0,gpu"], "invalid value for --knobs.devices: input should be a valid integer"),
        (["--knobs.extra", "[1]"], "invalid value for --knobs.extra: input should be a valid dictionary"),
        (["--knobs.stepz", "1"], "No such option: --knobs.stepz"),
    ],
)  # fmt: skip
def test_a_bad_value_is_one_line_naming_the_option(args, said):
    demo, seen = make_app(Knobs)
    result = CliRunner().invoke(demo, ["run", *args])
    assert result.exit_code == 2 and seen == []
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and said in lines[0], lines


def test_an_option_cannot_be_generated_twice_or_over_a_command_option():
    with pytest.raises(TypeError, match="--steps of steps is already an option"):

        @with_options(model_options(Knobs))
        def clash(settings: dict[str, Any], steps: int = typer.Option(1)) -> None:
            pass

    with pytest.raises(TypeError, match="is a section"):
        model_options(TrainConfig)  # a section needs sections=True or its own model_options


# --- the real commands ---------------------------------------------------------------------------------


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[TrainConfig]:
    import agentrl.train.launch as launch_mod

    configs: list[TrainConfig] = []
    monkeypatch.setattr(launch_mod, "launch", lambda cfg, **kwargs: configs.append(cfg) or "launched")
    return configs


def test_train_options_override_the_file_and_what_is_not_given_keeps_its_value(launched, tmp_path: Path):
    config = tmp_path / "c.yaml"
    config.write_text(
        "model: m\nsteps: 5\nrollout:\n  temperature: 0.5\n  group_size: 4\noptim:\n  lr: 1.0e-4\n"
    )
    args = ["train", str(config), "--optim.lr", "3e-5", "--engine.no-sleep", "--report-to", "jsonl,wandb"]
    args += ["--rollout.max_tokens_per_turn", "64", "--loss.tis-cap", "null", "optim.epochs=2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (cfg,) = launched
    assert (cfg.steps, cfg.rollout.temperature, cfg.rollout.group_size) == (5, 0.5, 4)  # the file's
    assert (cfg.optim.lr, cfg.engine.sleep, cfg.report_to) == (3e-5, False, ["jsonl", "wandb"])
    assert (cfg.rollout.max_tokens_per_turn, cfg.loss.tis_cap, cfg.optim.epochs) == (64, None, 2)


def test_eval_options_build_its_config(monkeypatch: pytest.MonkeyPatch):
    import agentrl.core.errors
    import agentrl.eval.evaluate

    configs: list[EvalConfig] = []

    def evaluate(cfg: EvalConfig) -> list:
        configs.append(cfg)
        raise KeyboardInterrupt  # stop before the report

    monkeypatch.setattr(agentrl.eval.evaluate, "evaluate", evaluate)
    monkeypatch.setattr(agentrl.core.errors, "check_model_dir", lambda path, **kw: None)
    args = ["eval", "--env", "agentrl/calc-v0", "--model", "a", "--model", "b", "--n", "4", "--k", "1,2"]
    args += ["--k", "4", "--tasks", "3", "--temperature", "0.5", "--no-progress", "--backend", "local"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 130, result.output
    (cfg,) = configs
    assert (cfg.models, cfg.samples, cfg.ks, cfg.tasks) == (["a", "b"], 4, [1, 2, 4], 3)
    assert (cfg.rollout.temperature, cfg.progress, cfg.env_kwargs) == (0.5, False, {"backend": "local"})
    assert cfg.rollout.max_tokens_per_turn == RolloutConfig().max_tokens_per_turn  # not given: the default


def test_env_list_is_envs_list():
    """`agentrl env list` (the group of `env show` and `env check`) prints what `agentrl envs list` does."""
    env = CliRunner().invoke(app, ["env", "list"])
    envs = CliRunner().invoke(app, ["envs", "list"])
    assert env.exit_code == envs.exit_code == 0
    assert env.output == envs.output and "agentrl/calc-v0" in env.output
