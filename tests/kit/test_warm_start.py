"""The warm start end to end with a tiny recipe: built once, measured, reused, rebuilt when the recipe changes.

The real recipe (1000+ demonstrations, minutes of SFT) is too slow for CI; its measurement is in
`WarmStartRecipe`'s docstring. These tests run every stage on a budget of seconds.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import agentrl.kit.warm_start as warm_start_module
from agentrl.cli import app
from agentrl.kit.warm_start import RECORD_FILE, WarmStartRecipe, advice, build_hash, warm_start

# Both SFT stages on a few demonstrations; every other field at its default, so the CLI can name it.
SMALL = WarmStartRecipe(short_demos=4, short_epochs=1, demos=8, epochs=1, batch_size=4, eval_tasks=4)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("ws") / "warm"
    t0 = time.perf_counter()
    result = warm_start(out, SMALL)
    return out, result, time.perf_counter() - t0


@pytest.mark.vllm
@pytest.mark.slow
def test_build_trains_measures_and_records(built):
    out, result, _ = built
    assert not result.reused and Path(result.path) == out
    for name in ("config.json", "model.safetensors", "tokenizer.json", "demos.jsonl", RECORD_FILE):
        assert (out / name).is_file(), name
    record = json.loads((out / RECORD_FILE).read_text())
    assert record["hash"] == result.build_hash == build_hash(SMALL)
    assert record["build"]["demos"]["passed"] == 8
    assert [st["sft_steps"] for st in record["build"]["stages"]] == [1, 2]  # 4 then 8 demos, batches of 4
    assert (out / "demos.jsonl").read_text().count("\n") == 8
    assert record["build"]["sft_last_loss"] < record["build"]["sft_first_loss"]
    m = record["measurement"]
    assert (m["tasks"], m["samples"]) == (4, 1) and result.pass_at_1 == m["pass_at_1"]
    assert 0.0 <= m["pass_at_1"] <= 1.0 and sum(m["finish_reasons"].values()) == 4


@pytest.mark.vllm
@pytest.mark.slow
def test_same_recipe_is_reused_without_training(built):
    out, first, _ = built
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    again = warm_start(out, SMALL)
    assert time.perf_counter() - t0 < 5.0
    assert again.reused and again.pass_at_1 == first.pass_at_1 and again.build_s == first.build_s
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    # The CLI finds the same cache (a measurement spec of 0 tasks skips measuring; no rebuild).
    args = ["model", "warm-start", "--out", str(out), "--short-demos", "4", "--short-epochs", "1"]
    args += ["--demos", "8", "--epochs", "1", "--batch-size", "4"]
    result = CliRunner().invoke(app, [*args, "--eval-tasks", "0"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown["reused"] and shown["build_hash"] == first.build_hash and shown["pass_at_1"] is None
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.vllm
@pytest.mark.slow
def test_changed_recipe_rebuilds_and_eval_only_change_does_not(built):
    out, first, _ = built
    changed = SMALL.model_copy(update={"lr": SMALL.lr / 2, "eval_tasks": 0})
    rebuilt = warm_start(out, changed)
    assert not rebuilt.reused and rebuilt.build_hash != first.build_hash
    assert json.loads((out / RECORD_FILE).read_text())["recipe"]["lr"] == SMALL.lr / 2
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    # Only the measurement spec differs: the model is kept.
    kept = warm_start(out, changed.model_copy(update={"eval_seed": 7}))
    assert kept.reused and (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_refuses_a_directory_it_did_not_write(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a warm-start build"):
        warm_start(tmp_path, SMALL)
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.vllm
@pytest.mark.slow
def test_a_target_pass_trains_in_measured_rounds_and_says_what_to_do_below_it(tmp_path):
    """Below the target the main stage trains again on the same demonstrations, measured each round; the
    tiny quick recipe cannot reach pass@1 1.0 in two rounds, and the advice says so."""

    recipe = SMALL.model_copy(update={"target_pass": 1.0, "max_rounds": 2})
    result = warm_start(tmp_path / "rounds", recipe)
    rounds = result.record["build"]["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    assert [r["sft_steps"] for r in rounds] == [2, 4]  # 8 demos in batches of 4, one epoch a round
    assert result.pass_at_1 == rounds[-1]["pass_at_1"] == result.record["measurement"]["pass_at_1"]
    m = result.record["measurement"]
    assert sum(m["task_pass_rates"].values()) == 4 and m["task_pass_rates"]["sometimes"] == 0  # 1 sample
    said = advice(result.record, recipe)
    assert said is not None and "below the target 1.0" in said
    # One epoch of 8 demonstrations a round has not fit them: train longer first; a fit model, more data.
    assert rounds[-1]["sft_last_loss"] > 0.5 and "train longer (--max-rounds, --epochs)" in said
    fit = {
        **result.record,
        "build": {**result.record["build"], "rounds": [{**rounds[-1], "sft_last_loss": 0.01}]},
    }
    assert "more demonstrations (--demos" in advice(fit, recipe)
    with pytest.raises(ValueError, match="target_pass needs the held-out measurement"):
        WarmStartRecipe.model_validate({**SMALL.model_dump(), "target_pass": 0.2, "eval_tasks": 0})


@pytest.mark.vllm
@pytest.mark.slow
def test_warm_start_on_a_plugin_env_unlike_calc_stops_in_the_band(tmp_path):
    """`agentrl model warm-start --env` on a one-tool env of a test package: measured rounds until the
    held-out pass@1 reaches the band's lower edge, then it stops, with the tasks' never / sometimes /
    always counts."""
    out = tmp_path / "pick"
    result = CliRunner().invoke(
        app,
        [
            *("model", "warm-start", "--env", "tests.coin_env:test/Pick-v0", "--out", str(out)),
            *("--target-pass", "0.2", "--max-rounds", "6", "--demos", "64", "--epochs", "6"),
            *("--short-demos", "32", "--short-epochs", "12", "--batch-size", "8"),
            *("--eval-tasks", "12", "--eval-samples", "2"),
        ],
    )
    assert result.exit_code == 0, result.output
    record = json.loads((out / RECORD_FILE).read_text())
    rounds = record["build"]["rounds"]
    passes = [r["pass_at_1"] for r in rounds]
    assert passes[-1] >= 0.2 and all(p < 0.2 for p in passes[:-1]), passes  # stopped at the first round in
    rates = record["measurement"]["task_pass_rates"]
    assert sum(rates.values()) == 12 and set(rates) == {"never", "sometimes", "always"}
    assert rounds[-1]["sft_last_loss"] < rounds[0]["sft_last_loss"]
    # The target met: no advice (below it, `test_a_target_pass_trains_in_measured_rounds...` has one).
    recipe = WarmStartRecipe.model_validate(record["recipe"])
    assert advice(record, recipe) is None and '"advice": null' in result.output


def test_from_a_checkpoint_only_the_main_stage_and_the_recipes_from_scratch_keep_their_hash(tmp_path):
    from pydantic import ValidationError

    from agentrl.core.errors import UserError

    scratch = WarmStartRecipe()
    assert "start_from" not in scratch.build_fields()  # every cached build from scratch stays valid
    recipe = WarmStartRecipe(start_from=str(tmp_path / "mine"), target_pass=0.2)
    assert recipe.short_stage == 0 and scratch.short_stage == scratch.short_demos
    assert WarmStartRecipe.model_validate_json(recipe.model_dump_json()) == recipe  # the measurement's copy
    with pytest.raises(ValidationError, match="short_demos: settings of the tiny model built from scratch"):
        WarmStartRecipe(start_from="x", short_demos=8)
    with pytest.raises(UserError, match="mine"):  # not a checkpoint: said before anything runs
        warm_start(tmp_path / "out", recipe)
    assert not (tmp_path / "out").exists()
    rounds = [{"round": 0, "sft_steps": 0, "sft_last_loss": None, "pass_at_1": 0.1}]
    said = advice({"build": {"rounds": rounds}}, recipe)
    assert said == "held-out pass@1 0.100 of the checkpoint is below the target 0.2"
    above = advice({"build": {"rounds": [{**rounds[0], "pass_at_1": 0.9}]}}, recipe)
    assert above is not None and "above the learnability band" in above


def test_a_change_to_the_code_that_builds_rebuilds(tmp_path, monkeypatch):
    # A cache built by other code (an SFT that batches otherwise) is another model: the build hash
    # holds a digest of that code's source, so editing it changes the hash.
    pkg = tmp_path / "wsdigest_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "step.py").write_text("LR = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = warm_start_module.code_digest(("wsdigest_probe.step",))
    (pkg / "step.py").write_text("LR = 2\n")
    assert warm_start_module.code_digest(("wsdigest_probe.step",)) != before
    with pytest.raises(ModuleNotFoundError, match="BUILD_CODE"):
        warm_start_module.code_digest(("wsdigest_probe.missing",))

    default = build_hash(SMALL)
    monkeypatch.setattr(warm_start_module, "code_digest", lambda: "another")
    assert build_hash(SMALL) != default
    assert warm_start_module.BUILD_CODE  # every listed module exists (the default digest above ran)
