"""Model selection on validation (`eval.keep_best`): the choice, its record, pruning, resume, and the
test split never touched while training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.train.checkpoint import _prune, latest_resumable, save_weights
from agentrl.train.config import TrainConfig
from agentrl.train.selection import RECORD, Choice, best_of, eval_rows, write_best
from agentrl.train.trainer import _keep_best, checkpoint_due, eval_due, start_is_candidate
from tests.fixtures_model import tiny_model_dir  # noqa: F401  (pytest fixture)
from tests.train.test_trainer import coin_config, run


def _rows(*pairs: tuple[int, float]) -> list[dict]:
    return [{"step": s, "eval/pass@1": v} for s, v in pairs]


def test_the_best_trained_step_wins_ties_keep_the_earlier():
    assert best_of(_rows((0, 0.9), (2, 0.5), (4, 0.7), (6, 0.7), (8, 0.6))) == Choice(4, 0.7)
    assert best_of(_rows((0, 0.9))) is None
    assert best_of([]) is None


def test_with_the_start_a_candidate_a_trained_step_must_beat_it_not_tie_it():
    rows = _rows((0, 0.9), (2, 0.5), (4, 0.7))
    assert best_of(rows, start=True) == Choice(0, 0.9)
    assert best_of(_rows((0, 0.6), (2, 0.6), (4, 0.55)), start=True) == Choice(0, 0.6)
    assert best_of(_rows((0, 0.6), (2, 0.55), (4, 0.65)), start=True) == Choice(4, 0.65)
    assert best_of(_rows((2, 0.5)), start=True) == Choice(2, 0.5)  # no row of the start: trained steps only


def test_the_start_is_a_candidate_only_when_it_is_evaluated():
    def cfg(**evaluation):
        return TrainConfig(env="test/Coin-v0", model="m", eval={"every": 2, **evaluation})

    assert start_is_candidate(cfg(keep_best=True, at_start=True))
    assert not start_is_candidate(cfg(keep_best=True))
    assert not start_is_candidate(cfg(at_start=True))


def test_keep_best_needs_evaluations_on_validation():
    with pytest.raises(ValueError, match="eval.every"):
        TrainConfig(env="test/Coin-v0", model="m", eval={"keep_best": True})
    with pytest.raises(ValueError, match="select on validation"):
        TrainConfig(env="test/Coin-v0", model="m", eval={"keep_best": True, "every": 2, "split": "test"})


def test_evaluations_and_checkpoints_fall_on_every_n_steps_and_the_last():
    cfg = TrainConfig(
        env="test/Coin-v0", model="m", steps=7, checkpoint_every=5, eval={"keep_best": True, "every": 3}
    )
    assert [s for s in range(1, 8) if eval_due(cfg, s)] == [3, 6, 7]
    assert [s for s in range(1, 8) if checkpoint_due(cfg, s)] == [3, 5, 6, 7]
    plain = TrainConfig(env="test/Coin-v0", model="m", steps=7, checkpoint_every=5, eval={"every": 3})
    assert [s for s in range(1, 8) if eval_due(plain, s)] == [3, 6]
    assert [s for s in range(1, 8) if checkpoint_due(plain, s)] == [5]


def test_pruning_spares_the_best_checkpoint_weights_but_not_its_trainer_state(tmp_path):
    for step in (2, 4, 6, 8):
        (tmp_path / f"checkpoint-{step}" / "trainer_state").mkdir(parents=True)
        (tmp_path / f"checkpoint-{step}" / "model.safetensors").write_text("w")
    _prune(tmp_path, keep=tmp_path / "checkpoint-8", keep_last=1, protect=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-8"]
    assert (tmp_path / "checkpoint-2" / "model.safetensors").exists()
    assert not (tmp_path / "checkpoint-2" / "trainer_state").exists()


def test_write_best_copies_the_weights_and_records_the_choice(tmp_path):
    ckpt = tmp_path / "checkpoint-4"
    (ckpt / "trainer_state").mkdir(parents=True)
    (ckpt / "model.safetensors").write_text("weights of step 4")
    (ckpt / "config.json").write_text("{}")
    rows = _rows((0, 0.5), (2, 0.55), (4, 0.6))
    best = write_best(tmp_path, Choice(4, 0.6), rows)
    assert (best / "model.safetensors").read_text() == "weights of step 4"
    assert not (best / "trainer_state").exists()
    record = json.loads((best / RECORD).read_text())
    assert record["step"] == 4 and record["baseline"] == {"step": 0, "score": 0.5}
    assert [c["step"] for c in record["candidates"]] == [2, 4]
    with pytest.raises(FileNotFoundError, match="step 6"):
        write_best(tmp_path, Choice(6, 0.7), rows)


def _checkpoint(out: Path, step: int, resumable: bool = True) -> None:
    (out / f"checkpoint-{step}").mkdir(parents=True)
    (out / f"checkpoint-{step}" / "model.safetensors").write_text(f"weights of step {step}")
    if resumable:
        (out / f"checkpoint-{step}" / "trainer_state").mkdir()


def test_a_run_no_trained_step_improved_keeps_the_starting_model_and_says_so(tmp_path):
    """The trainer's end of a run with keep_best and at_start, where validation fell after the start."""
    from types import SimpleNamespace

    rows = _rows((0, 0.6), (2, 0.5), (4, 0.6))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _checkpoint(tmp_path, 0, resumable=False)
    _checkpoint(tmp_path, 4)
    cfg = TrainConfig(
        env="test/Coin-v0", model="m", steps=4, eval={"every": 2, "at_start": True, "keep_best": True}
    )
    said = _keep_best(SimpleNamespace(out=tmp_path, cfg=cfg, step=4))
    assert said.startswith("kept the starting model") and "no trained step of 4 beat" in said, said
    assert (tmp_path / "best" / "model.safetensors").read_text() == "weights of step 0"
    record = json.loads((tmp_path / "best" / RECORD).read_text())
    assert record["step"] == 0 and record["start_is_candidate"] and "starting model" in record["rule"]
    assert [c["step"] for c in record["candidates"]] == [0, 2, 4]

    # Without at_start the same rows keep the best trained step, which ties the start.
    cfg = TrainConfig(env="test/Coin-v0", model="m", steps=4, eval={"every": 2, "keep_best": True})
    assert _keep_best(SimpleNamespace(out=tmp_path, cfg=cfg, step=4)).startswith("kept step 4 of 4")
    assert (tmp_path / "best" / "model.safetensors").read_text() == "weights of step 4"


def test_the_starting_weights_are_saved_without_a_trainer_state(tiny_model_dir, tmp_path):  # noqa: F811
    """checkpoint-0 holds the model as it starts (a candidate for out/best), and a resume never starts from it:
    saving an optimizer that has not stepped would count an Adam step the run never took."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    path = save_weights(tmp_path, 0, model, tiny_model_dir)
    assert path == tmp_path / "checkpoint-0" and not (path / "trainer_state").exists()
    saved = load_file(path / "model.safetensors")
    own = model.state_dict()
    assert set(saved) <= set(own) and saved
    assert all(saved[k].equal(own[k]) for k in saved)
    assert latest_resumable(tmp_path) is None


@pytest.mark.vllm
@pytest.mark.slow
def test_keep_best_selects_on_validation_resumes_to_the_same_choice_and_never_touches_test(
    tiny_model_dir,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """Four GRPO steps on the coin env, evaluated on validation at the start and every 2 steps; then the
    same run in two halves (2 steps, then resumed to 4). Both keep the same step, the one with the best
    validation pass@1, its weights in out/best; no process of either run made a test task."""
    log = tmp_path / "splits.log"
    monkeypatch.setenv("AGENTRL_SPLIT_LOG", str(log))
    evaluation = {"every": 2, "tasks": 4, "samples": 2, "at_start": True, "keep_best": True}

    def config(out: Path, steps: int) -> TrainConfig:
        return coin_config(str(tiny_model_dir), out, steps=steps, lr=1e-3, env="tests.coin_env:test/SplitSpy-v0",
                           eval=evaluation, keep_last=1, checkpoint_every=0)  # fmt: skip

    run(config(tmp_path / "whole", 4), 1)
    run(config(tmp_path / "halves", 2), 1)
    run(config(tmp_path / "halves", 4), 1)

    splits = set(log.read_text().split())
    assert splits == {"train", "validation"}, splits
    choices = []
    for name in ("whole", "halves"):
        out = tmp_path / name
        rows = eval_rows(out)
        assert [r["step"] for r in rows] == [0, 2, 4]
        choice = best_of(rows, start=True)
        assert choice is not None
        record = json.loads((out / "best" / RECORD).read_text())
        assert (record["step"], record["score"]) == (choice.step, choice.score)
        assert (out / "best" / "model.safetensors").read_bytes() == (
            out / f"checkpoint-{choice.step}" / "model.safetensors"
        ).read_bytes()
        choices.append((choice, [r["eval/pass@1"] for r in rows]))
    assert choices[0] == choices[1]  # a resume is exact on CPU: the same evaluations, the same choice
