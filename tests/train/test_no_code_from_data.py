"""Loading state runs no code from the data: a checkpoint is plain tensors, or it is refused.

A checkpoint directory may come from anywhere (a shared filesystem, a downloaded run). Each place
that loads pickled state gets a real checkpoint, written by the project's own save code, with one
file replaced by a pickle that would create a marker file when unpickled; the project's real load
or resume function must refuse it with a one-line `UserError` naming the file, and the marker must
not exist afterwards. Checkpoints the current code writes still round-trip, and so do those written
before the RNG states were stored as plain types (numpy's key array).
"""

from __future__ import annotations

import builtins
import json
import os
import pickle
import random
import subprocess
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from agentrl.core.errors import UserError
from agentrl.rollout.trajectory import save_trajectories
from agentrl.train import checkpoint
from agentrl.train.checkpoint import STATE_DIR, prepare_run_dir
from agentrl.train.config import TrainConfig
from tests.fixtures_dist import one_rank_group  # noqa: F401  (pytest fixture)
from tests.fixtures_model import tiny_model_dir  # noqa: F401  (pytest fixture)

ROOT = Path(__file__).resolve().parents[2]
REFUSED = r"is not a plain-tensor checkpoint \("


class TouchWithSystem:
    """Unpickling it runs a shell command that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


class TouchWithOpen:
    """Unpickling it calls a builtin (`open(marker, "w")`), which creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.open, (str(self.marker), "w"))


def _torch_save(obj: Any, path: Path) -> None:
    torch.save(obj, path)


def _bare_pickle(obj: Any, path: Path) -> None:
    path.write_bytes(pickle.dumps(obj))


#: (payload class, how the file is written, whether numpy's key array sits beside it: the globals an
#: older checkpoint may use must not let anything else through).
PAYLOADS = {
    "os.system, torch.save": (TouchWithSystem, _torch_save, False),
    "builtin open, torch.save": (TouchWithOpen, _torch_save, False),
    "os.system, bare pickle": (TouchWithSystem, _bare_pickle, False),
    "os.system beside a numpy array": (TouchWithSystem, _torch_save, True),
}


def plant(path: Path, payload: str, marker: Path) -> None:
    """Replace the checkpoint file `path` by its own content plus a payload that creates `marker`."""
    cls, write, with_numpy = PAYLOADS[payload]
    blob = torch.load(path, map_location="cpu", weights_only=True)
    blob["extra"] = cls(marker)
    if with_numpy:
        blob["numpy_state"] = np.random.get_state()
    write(blob, path)


def new_marker(tmp_path: Path) -> Path:
    return tmp_path / f"pwned-{uuid.uuid4().hex}"


def assert_refused(exc: pytest.ExceptionInfo[UserError], path: Path, marker: Path) -> None:
    message = str(exc.value)
    assert "\n" not in message and str(path) in message, message
    assert not marker.exists(), "the planted pickle ran"


# --- the model, the optimizer, a step taken: what a run would checkpoint --------------------------------


def trained(model_dir: Path, steps: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from transformers import AutoModelForCausalLM

    from agentrl.train.distributed import shard_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    shard_model(model, bf16=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 12))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from agentrl.train.distributed import full_state_dict

    return {k: v.clone() for k, v in full_state_dict(model).items()}


def save_run(model_dir: Path, out: Path, step: int = 1) -> Path:
    model, opt = trained(model_dir)
    return checkpoint.save(out, step, model, opt, {"updates": step}, model_dir, keep_last=2)


# --- trainer_state/optimizer.pt (checkpoint.load, and the resume check before any process starts) -------


@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_planted_optimizer_state_is_refused_by_load(payload, one_rank_group, tiny_model_dir, tmp_path):  # noqa: F811
    ckpt = save_run(tiny_model_dir, tmp_path / "run")
    marker = new_marker(tmp_path)
    target = ckpt / STATE_DIR / "optimizer.pt"
    plant(target, payload, marker)
    model, opt = trained(tiny_model_dir, steps=0)
    with pytest.raises(UserError, match=REFUSED) as exc:
        checkpoint.load(ckpt, model, opt)
    assert_refused(exc, target, marker)
    assert "resume only from checkpoints agentrl train wrote" in str(exc.value)


@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_planted_optimizer_state_stops_the_resume_early(payload, one_rank_group, tiny_model_dir, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    ckpt = save_run(tiny_model_dir, out)
    marker = new_marker(tmp_path)
    target = ckpt / STATE_DIR / "optimizer.pt"
    plant(target, payload, marker)
    before = sorted(p.name for p in out.iterdir())
    cfg = TrainConfig(model=str(tiny_model_dir), out=str(out), steps=2)
    with pytest.raises(UserError, match=REFUSED) as exc:
        prepare_run_dir(cfg)
    assert_refused(exc, target, marker)
    assert sorted(p.name for p in out.iterdir()) == before  # the run directory is left as it was


@pytest.mark.slow
def test_agentrl_train_refuses_a_planted_checkpoint_in_one_line(one_rank_group, tiny_model_dir, tmp_path):  # noqa: F811
    from tests.train.test_trainer import grpo_batch

    out = tmp_path / "run"
    ckpt = save_run(tiny_model_dir, out)
    marker = new_marker(tmp_path)
    target = ckpt / STATE_DIR / "optimizer.pt"
    plant(target, "os.system, torch.save", marker)
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    save_trajectories(tmp_path / "batch.jsonl", grpo_batch(vocab))
    cfg = tmp_path / "replay.yaml"
    cfg.write_text(f"model: {tiny_model_dir}\nreplay: {tmp_path / 'batch.jsonl'}\nsteps: 2\n")
    # Without this process group's rendezvous variables: `agentrl train` makes its own.
    rendezvous = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in rendezvous}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [str(ROOT / ".venv/bin/agentrl"), "train", str(cfg), f"out={out}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and str(target) in errors[0] and "not a plain-tensor checkpoint" in errors[0]
    assert "Traceback" not in done.stderr
    assert not marker.exists()


# --- the payloads are real: loaded the unsafe way, each creates its marker ------------------------------


@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_each_planted_payload_does_run_when_loaded_unsafely(payload, tmp_path):
    path, marker = tmp_path / "blob.pt", new_marker(tmp_path)
    torch.save({"weights": torch.zeros(2)}, path)
    plant(path, payload, marker)
    assert not marker.exists()
    # What the loaders did before (weights_only=False), or plain pickle: the file's code runs.
    if PAYLOADS[payload][1] is _bare_pickle:
        pickle.loads(path.read_bytes())
    else:
        torch.load(path, weights_only=False)
    assert marker.exists()


# --- what the current code writes still resumes; older checkpoints too ----------------------------------


def test_a_checkpoint_round_trips_weights_optimizer_state_and_rngs(one_rank_group, tiny_model_dir, tmp_path):  # noqa: F811
    model, opt = trained(tiny_model_dir, steps=2)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    ckpt = checkpoint.save(tmp_path / "run", 2, model, opt, {"updates": 2}, tiny_model_dir, keep_last=1)
    expected = (random.random(), np.random.random(), torch.rand(1).item())
    # Everything in the trainer state is plain: it loads with nothing but weights_only=True.
    torch.load(ckpt / STATE_DIR / "optimizer.pt", weights_only=True)

    fresh, fresh_opt = trained(tiny_model_dir, steps=0)
    state = checkpoint.load(ckpt, fresh, fresh_opt)
    assert state["step"] == 2 and state["updates"] == 2
    saved, loaded = full_params(model), full_params(fresh)
    assert saved.keys() <= loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    a, b = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert a.keys() == b.keys()
    for k in a:
        assert all(torch.equal(torch.as_tensor(a[k][n]), torch.as_tensor(b[k][n])) for n in a[k])
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    checkpoint.set_rng_state(state["rng"])
    assert (random.random(), np.random.random(), torch.rand(1).item()) == expected


def test_an_older_checkpoint_with_numpy_rng_state_still_resumes(one_rank_group, tiny_model_dir, tmp_path):  # noqa: F811
    ckpt = save_run(tiny_model_dir, tmp_path / "run")
    path = ckpt / STATE_DIR / "optimizer.pt"
    blob = torch.load(path, weights_only=True)
    np.random.seed(5)
    blob["rng"] = [
        {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    ]
    expected = np.random.random()
    torch.save(blob, path)  # the layout before the RNG states were plain types
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    cfg = TrainConfig(model=str(tiny_model_dir), out=str(tmp_path / "run"), steps=2)
    assert "resuming" in prepare_run_dir(cfg)
    fresh, fresh_opt = trained(tiny_model_dir, steps=0)
    state = checkpoint.load(ckpt, fresh, fresh_opt)
    np.random.seed(0)
    checkpoint.set_rng_state(state["rng"])
    assert np.random.random() == expected


# --- the other state the project reads is parsed, never unpickled ---------------------------------------


def test_configs_parse_yaml_safely(tmp_path):
    """A YAML tag that would build a Python object is an error in a config or an override, not a call."""
    from agentrl.train.config import ConfigError, load_config

    marker = new_marker(tmp_path)
    tag = f"!!python/object/apply:os.system ['touch {marker}']"
    f = tmp_path / "c.yaml"
    f.write_text(f"model: m\nsteps: {tag}\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(f, [])
    with pytest.raises(ConfigError, match="the value is not valid YAML"):
        load_config(None, [f"steps={tag}"], model="m")
    assert not marker.exists()
