"""The short stage's check: a stage that learned to copy runs once, as before; one that did not trains on
from where it stands for a bounded number of extra rounds, then fails and says so.

A fake stands in for the short stage's SFT (the real one takes minutes): it returns the loss each call
is given, the way `_stage` appends its entry to the build's stages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentrl.kit import warm_start as ws
from agentrl.kit.warm_start import RECORD_FILE, ShortStageNotLearned, WarmStartRecipe, build_hash


class FakeStage:
    """`_stage`'s signature; each call ends at the next of `tail_losses` after `steps` steps."""

    def __init__(self, tail_losses: list[float], steps: int = 768, round_steps: int = 256) -> None:
        self.tail_losses = list(tail_losses)
        self.steps, self.round_steps = steps, round_steps
        self.calls: list[dict[str, Any]] = []

    def __call__(self, name, work, base, tokenizer, recipe, n, env_kwargs, epochs, lr, threads, log, keep_files, demos=None):  # fmt: skip
        self.calls.append(
            dict(name=name, base=base, n=n, epochs=epochs, lr=lr, keep_files=keep_files, demos=demos)
        )
        tail = self.tail_losses.pop(0)
        steps = self.steps if demos is None else self.round_steps
        log.append({"stage": name, "sft_steps": steps, "sft_last_loss": tail * 0.9, "sft_tail_loss": tail})
        out = Path(work) / name
        out.mkdir(parents=True)
        return out


def run(tmp_path: Path, fake: FakeStage, **fields: Any):
    recipe = WarmStartRecipe(seed=1, eval_tasks=0, **fields)
    stages: list[dict[str, Any]] = []
    model, rounds = ws._short_stage(tmp_path, tmp_path / "base", None, recipe, 1, stages, stage=fake)
    return recipe, model, rounds, stages


def test_a_stage_that_learned_runs_once_as_it_did_before_the_check(tmp_path, capsys):
    fake = FakeStage([0.023])  # the highest final loss of the short stages that learned
    recipe, model, rounds, stages = run(tmp_path, fake)
    assert fake.calls == [
        dict(name="short", base=tmp_path / "base", n=1024, epochs=recipe.short_epochs, lr=recipe.short_lr,
             keep_files=False, demos=None)
    ]  # fmt: skip
    assert model == tmp_path / "short"
    assert rounds == [
        {"round": 0, "sft_steps": 768, "sft_last_loss": 0.023 * 0.9, "sft_tail_loss": 0.023, "learned": True}
    ]
    assert len(stages) == 1
    assert capsys.readouterr().err == ""  # nothing said when nothing extra happens


def test_a_stage_that_did_not_learn_trains_on_from_where_it_stands_and_says_so(tmp_path, capsys):
    fake = FakeStage([0.164, 0.09, 0.012])  # seed 1's short stage, then two extra rounds
    recipe, model, rounds, stages = run(tmp_path, fake)
    assert [c["name"] for c in fake.calls] == ["short", "short-round-1", "short-round-2"]
    # Each round starts from the checkpoint the last one ended at, on the stage's own demonstrations.
    assert [c["base"] for c in fake.calls[1:]] == [tmp_path / "short", tmp_path / "short-round-1"]
    assert all(c["demos"] == tmp_path / "short-demos.jsonl" for c in fake.calls[1:])
    assert all(
        c["epochs"] == recipe.short_round_epochs and c["n"] == recipe.short_demos for c in fake.calls[1:]
    )
    assert model == tmp_path / "short-round-2"
    assert [(r["round"], r["sft_steps"], r["learned"]) for r in rounds] == [
        (0, 768, False),
        (1, 1024, False),
        (2, 1280, True),
    ]
    assert [s["stage"] for s in stages] == ["short", "short-round-1", "short-round-2"]
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 3  # one line per extra round, one when it learned
    assert "loss 0.164 > 0.06 after 768 steps): extra round 1 of 3" in said[0]
    assert said[-1].endswith("learned to copy after 2 extra round(s), 1280 steps")


def test_a_stage_that_never_learns_fails_after_the_last_round_in_one_line(tmp_path):
    fake = FakeStage([0.236, 0.2, 0.15, 0.01])
    with pytest.raises(ShortStageNotLearned) as caught:
        run(tmp_path, fake, short_max_rounds=2)
    said = str(caught.value)
    assert "\n" not in said
    assert said.startswith("the short stage of seed 1 did not learn to copy: its SFT loss is 0.150")
    assert "after 1280 steps (2 extra round(s)), above 0.06" in said and said.endswith("use another seed")
    assert len(fake.calls) == 3  # the stage and two extra rounds, never a third
    from agentrl.cli import _user_error_message

    assert _user_error_message(caught.value) == said  # the command line says it as `error: ...`, no traceback
    with pytest.raises(ShortStageNotLearned, match="0.236 per action token after 768 steps \\(0 extra"):
        run(tmp_path / "none", FakeStage([0.236]), short_max_rounds=0)


def test_the_threshold_is_inclusive_and_none_turns_the_check_off(tmp_path):
    _, _, rounds, _ = run(tmp_path / "at", FakeStage([0.06]))
    assert rounds[-1]["learned"] is True
    fake = FakeStage([0.3])
    _, model, rounds, _ = run(tmp_path / "off", fake, short_fit_loss=None)
    assert len(fake.calls) == 1 and rounds[0]["learned"] is None and model.name == "short"


def test_the_check_at_its_defaults_keeps_every_cached_hash_and_changed_it_is_another_build():
    default = WarmStartRecipe(seed=1)
    fields = default.build_fields()
    assert not {"short_fit_loss", "short_round_epochs", "short_max_rounds"} & set(fields)
    assert build_hash(WarmStartRecipe(seed=1, short_max_rounds=4)) != build_hash(default)
    assert build_hash(WarmStartRecipe(seed=1, short_fit_loss=None)) != build_hash(default)
    # From a checkpoint there is no short stage to check.
    with pytest.raises(ValueError, match="short_max_rounds: settings of the tiny model"):
        WarmStartRecipe(start_from="x", short_max_rounds=1)


def _old_cache(out: Path, recipe: WarmStartRecipe, short_last_loss: float, **build: Any) -> None:
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_text("")
    stages = [{"stage": "short", "sft_last_loss": short_last_loss}, {"stage": "main", "sft_last_loss": 0.3}]
    record = {"hash": build_hash(recipe), "build": {"seconds": 1.0, "stages": stages, **build}}
    (out / RECORD_FILE).write_text(json.dumps(record))


@pytest.mark.parametrize(
    ("short_last_loss", "build", "fields", "rebuilt"),
    [
        (0.164, {}, {}, True),  # seed 1's cache: built before the check, never learned
        (0.013, {}, {}, False),  # learned: the check would have built the same model
        (0.164, {"short_rounds": []}, {}, False),  # built with the check already
        (0.164, {}, {"short_fit_loss": None}, False),  # the check turned off: the old model is this recipe's
    ],
)
def test_a_cache_whose_short_stage_never_learned_is_rebuilt(
    tmp_path, monkeypatch, short_last_loss, build, fields, rebuilt
):
    recipe = WarmStartRecipe(seed=1, eval_tasks=0, **fields)
    out = tmp_path / "ws"
    _old_cache(out, recipe, short_last_loss, **build)
    builds: list[str] = []

    def fake_build(out_, recipe_, digest, threads):
        builds.append(digest)
        return {"hash": digest, "build": {"seconds": 2.0}}

    monkeypatch.setattr(ws, "_build", fake_build)
    result = ws.warm_start(out, recipe)
    assert builds == ([build_hash(recipe)] if rebuilt else [])
    assert result.reused is not rebuilt


def test_a_short_stage_too_short_to_learn_is_not_checked():
    # A smoke run (`agentrl demo --quick`, a test's recipe) gives the stage far fewer sequences than copying
    # takes: it ends after its epochs, learned or not, and never fails the build.
    assert WarmStartRecipe(seed=1).short_checked
    assert not WarmStartRecipe(seed=1, short_demos=64).short_checked  # 64 x 12 sequences
    assert not WarmStartRecipe(seed=1, short_fit_loss=None).short_checked
    assert not WarmStartRecipe(seed=1, short_demos=4, short_epochs=1, eval_tasks=0).short_checked
