"""The main stage's measured rounds (`target_pass`): each round after the first trains on the first round's
demonstrations again (`round_demos: same`) or on fresh ones from the next train tasks (`fresh`), and the
measurement that decides how many rounds run is part of the model's hash.

Fakes stand in for the stage (demonstrations and SFT take minutes) and for the measurement (vLLM): the
stage records what it was asked to train on, the measurement returns the next of its pass@1 values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentrl.kit import warm_start as ws
from agentrl.kit.warm_start import WarmStartRecipe


class FakeStage:
    """`_stage`'s signature: writes a checkpoint folder with the files a real stage keeps in it."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, name, work, base, tokenizer, recipe, n, env_kwargs, epochs, lr, threads, log, keep_files, demos=None, start=0):  # fmt: skip
        self.calls.append(dict(base=Path(base).name, n=n, epochs=epochs, demos=demos, start=start))
        log.append({"stage": name, "sft_steps": n * epochs // recipe.batch_size, "sft_last_loss": 0.05})
        out = Path(work) / name
        out.mkdir(parents=True)
        (out / "demos.jsonl").write_text(f"{start}\n" if demos is None else Path(demos).read_text())
        (out / "metrics.jsonl").write_text("{}\n")
        return out


def rounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, passes: list[float], **fields: Any):
    recipe = WarmStartRecipe(target_pass=0.4, eval_tasks=8, max_rounds=4, round_epochs=2, **fields)
    fake, measured = FakeStage(), iter(passes)
    monkeypatch.setattr(ws, "_stage", fake)
    monkeypatch.setattr(ws, "measure", lambda model, recipe: {"pass_at_1": next(measured)})
    stages: list[dict[str, Any]] = []
    model = ws._main_stage(tmp_path, tmp_path / "short", None, recipe, 1, stages)
    return recipe, fake.calls, ws._rounds_to_target(tmp_path, model, None, recipe, 1, stages)


def test_fresh_rounds_train_on_the_next_train_tasks_until_the_target(tmp_path, monkeypatch):
    recipe, calls, done = rounds(tmp_path, monkeypatch, [0.06, 0.17, 0.41], round_demos="fresh")
    assert [(c["start"], c["demos"], c["epochs"]) for c in calls] == [
        (0, None, 4),
        (256, None, 2),
        (512, None, 2),
    ]
    assert [c["base"] for c in calls] == ["short", "round-1", "round-2"]  # each from where the last ended
    assert [(r["round"], r["sft_steps"], r["pass_at_1"]) for r in done] == [
        (1, 64, 0.06),
        (2, 96, 0.17),
        (3, 128, 0.41),
    ]
    assert (tmp_path / "main" / "demos.jsonl").read_text() == "512\n"  # the last round's, kept with the model


def test_same_rounds_train_on_the_first_rounds_demonstrations_again(tmp_path, monkeypatch):
    recipe, calls, done = rounds(tmp_path, monkeypatch, [0.06, 0.09, 0.11, 0.10])
    assert calls[0]["demos"] is None and len(calls) == 4
    assert all(Path(c["demos"]).name == "round-demos.jsonl" for c in calls[1:])
    assert (tmp_path / "main" / "demos.jsonl").read_text() == "0\n"  # the first round's, every time
    assert [r["round"] for r in done] == [1, 2, 3, 4]  # below the target after max_rounds


def test_the_measurement_that_decides_the_rounds_is_in_the_hash_and_same_rounds_keep_old_hashes():
    plain = WarmStartRecipe()
    assert "round_demos" not in plain.build_fields() and "measured_by" not in plain.build_fields()
    assert "round_demos" not in WarmStartRecipe(target_pass=0.4).build_fields()
    assert WarmStartRecipe(target_pass=0.4, round_demos="fresh").build_fields()["round_demos"] == "fresh"
    on_test = WarmStartRecipe(target_pass=0.4, eval_split="test")
    on_validation = on_test.model_copy(update={"eval_split": "validation"})
    assert ws.build_hash(on_test) != ws.build_hash(
        on_validation
    )  # another split, other rounds: another model
    assert ws.build_hash(plain) == ws.build_hash(plain.model_copy(update={"eval_split": "validation"}))
