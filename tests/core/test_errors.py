"""The checks behind one-line errors: config validation, model directories, --nproc."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agentrl.core import errors
from agentrl.core.errors import UserError, check_model_dir, check_nproc, format_validation_error
from agentrl.train.config import TrainConfig


def validation_error(**data) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        TrainConfig.model_validate({"model": "m", **data})
    return info.value


def test_unknown_keys_get_the_closest_known_key_with_its_section():
    msg = format_validation_error(validation_error(optim={"lrr": 1}, stepz=3), TrainConfig)
    assert msg == (
        "invalid config (2 problems): unknown key 'optim.lrr'. Did you mean 'optim.lr'?; "
        "unknown key 'stepz'. Did you mean 'steps'?"
    )
    assert "use report_to: [jsonl, tensorboard]" in format_validation_error(
        validation_error(tensorboard=True), TrainConfig
    )


def test_a_wrong_value_names_the_key_and_the_value_given():
    msg = format_validation_error(validation_error(rollout={"group_size": 0}), TrainConfig)
    assert msg == "invalid config: 'rollout.group_size': input should be greater than or equal to 1 (got 0)"
    assert "\n" not in format_validation_error(
        validation_error(curriculum={"band_low": 0.9, "band_high": 0.1}), TrainConfig
    )


def test_nproc_must_be_positive_and_at_most_the_visible_gpus(monkeypatch):
    with pytest.raises(UserError, match=r"--nproc must be >= 1 \(processes, one FSDP rank each\), got 0"):
        check_nproc(0)
    monkeypatch.setattr(errors, "visible_gpus", lambda: 0)
    check_nproc(4)  # CPU ranks (gloo): any number
    monkeypatch.setattr(errors, "visible_gpus", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    check_nproc(2)
    with pytest.raises(
        UserError,
        match=r"--nproc 3 needs 3 GPUs \(one per trainer process\) but 2 are visible "
        r"\(CUDA_VISIBLE_DEVICES='0,1'\); use --nproc 2",
    ):
        check_nproc(3)


@pytest.mark.gpu
def test_nproc_beyond_the_gpus_of_this_machine_is_refused():
    import torch

    n = torch.cuda.device_count()
    check_nproc(n)
    with pytest.raises(UserError, match=f"but {n} (is|are) visible"):
        check_nproc(n + 1)


def test_model_directories(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "sft").mkdir(parents=True)
    with pytest.raises(UserError, match=r"--model runs/sfft: no such directory. Did you mean 'runs/sft'\?"):
        check_model_dir("runs/sfft")
    with pytest.raises(UserError, match="no such directory$"):
        check_model_dir(str(tmp_path / "a" / "b" / "c"))  # not Hugging Face's "Repo id must be in the form"
    check_model_dir("Qwen/Qwen2.5-0.5B-Instruct")  # a Hub id (no local `Qwen/`): transformers resolves it
    with pytest.raises(UserError, match="is not a checkpoint: no config.json"):
        check_model_dir("runs/sft")
    run = tmp_path / "runs" / "grpo"
    for name in ("final", "checkpoint-4"):
        (run / name).mkdir(parents=True)
        (run / name / "config.json").write_text("{}")
    with pytest.raises(UserError, match=r"holds checkpoints: use runs/grpo/final or runs/grpo/checkpoint-4"):
        check_model_dir("runs/grpo")
    with pytest.raises(UserError, match="has a config.json but no weights"):
        check_model_dir("runs/grpo/final")
    (run / "final" / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match="has no tokenizer"):
        check_model_dir("runs/grpo/final")
    (run / "final" / "tokenizer.json").write_text("{}")
    check_model_dir("runs/grpo/final")


def test_training_needs_groups_of_two_and_a_sampling_temperature():
    """The rollout settings are the rollout's (`RolloutConfig`); what GRPO needs of them is checked on top."""
    assert "GRPO compares the episodes of a group, so it needs at least 2" in format_validation_error(
        validation_error(rollout={"group_size": 1}), TrainConfig
    )
    assert "use a temperature > 0" in format_validation_error(
        validation_error(rollout={"temperature": 0}), TrainConfig
    )


def test_a_moved_key_says_where_it_went():
    msg = format_validation_error(validation_error(rollout={"devices": [1]}), TrainConfig)
    assert msg.startswith("invalid config: unknown key 'rollout.devices'; use engine.devices")
    assert "use seed" in format_validation_error(validation_error(rollout={"seed": 3}), TrainConfig)
