"""Checkpoints and resuming `agentrl train`: Ctrl-C saves; the resumed run is the uninterrupted one, bit for bit.

The real command, docker sandboxes and vLLM rollouts, with tiny budgets. `rollout.concurrency: 1`
makes vLLM batch every request alone: with several requests in one batch its CPU kernels may round a
log-prob differently (~1e-7) depending on which requests happen to share a step, which would make
even two uninterrupted runs differ; everything agentrl itself controls is in the checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from agentrl.core.errors import UserError
from agentrl.train.checkpoint import STATE_DIR, checkpoints, prepare_run_dir
from agentrl.train.config import TrainConfig
from tests.fixtures_model import tiny_model_dir  # noqa: F401  (pytest fixture)

ROOT = Path(__file__).resolve().parents[2]
AGENTRL = str(ROOT / ".venv/bin/agentrl")


def train_cmd(cfg: Path, out: Path) -> list[str]:
    return [AGENTRL, "train", str(cfg), f"out={out}"]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def rows(out: Path) -> list[dict]:
    """Every metric of every step but the wall-clock times."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if not k.startswith("time/")} for x in lines]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ctrl_c_after_step_1(cfg: Path, out: Path) -> str:
    """`agentrl train cfg out=out`, Ctrl-C as soon as step 1 is in metrics.jsonl; its stderr (exit 130)."""
    proc = subprocess.Popen(
        train_cmd(cfg, out),
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A suite started as a background job inherits Ctrl-C ignored, and `agentrl train` keeps an
        # ignored Ctrl-C ignored (as under nohup): give the run a terminal's default disposition.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 600
    while not ((out / "metrics.jsonl").exists() and len(rows(out)) >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    return stderr


@pytest.mark.docker
@pytest.mark.vllm
@pytest.mark.slow
def test_resume_after_ctrl_c_reproduces_the_uninterrupted_run_exactly(tiny_model_dir, tmp_path):  # noqa: F811
    cfg = tmp_path / "coin.yaml"
    cfg.write_text(
        f"env: tests.coin_env:test/CoinBox-v0\nmodel: {tiny_model_dir}\nsteps: 3\nseed: 3\n"
        "rollout: {group_size: 4, max_tokens_per_turn: 12, max_total_tokens: 1024, concurrency: 1}\n"
        "curriculum: {batch_groups: 2}\noptim: {lr: 1.0e-3, micro_batch_size: 4}\n"
    )
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    done = subprocess.run(
        train_cmd(cfg, whole), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]

    stderr = ctrl_c_after_step_1(cfg, cut)  # while step 2's episodes are being generated
    said = [line for line in stderr.splitlines() if "interrupted at step" in line]
    assert said and f"interrupted at step 2/3: saved {cut}/checkpoint-1 (step 1 done" in said[0], stderr[
        -3000:
    ]
    assert f"Continue with the same command: agentrl train {cfg} out={cut}" in said[0]
    assert "Traceback" not in stderr
    assert (cut / "checkpoint-1" / STATE_DIR / "state.json").exists()

    resumed = subprocess.run(
        train_cmd(cfg, cut), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming checkpoint-1" in resumed.stderr
    assert [r["step"] for r in rows(cut)] == [1, 2, 3]
    assert rows(cut) == rows(whole)  # rewards, losses, gradient norms, curriculum, policy versions
    assert sha(cut / "final" / "model.safetensors") == sha(whole / "final" / "model.safetensors")
    # The trained steps actually changed the policy (the comparison is not between two copies of the start).
    assert any("losses/policy_loss" in r for r in rows(whole))
    assert sha(whole / "final" / "model.safetensors") != sha(tiny_model_dir / "model.safetensors")


@pytest.mark.vllm
@pytest.mark.slow
def test_resume_after_ctrl_c_with_overlapping_batches_keeps_the_curriculum_to_what_was_trained(
    tiny_model_dir,  # noqa: F811
    tmp_path,
):
    """Asynchronous, two batches built at once: Ctrl-C while the batches ahead are in flight saves the
    last trained step; the resumed run finishes, and its curriculum has learned from exactly the groups
    of the batches trained (every generated group of each, dropped ones included), none of the batches
    that were in flight when the run was stopped."""
    cfg = tmp_path / "coin.yaml"
    cfg.write_text(
        f"env: tests.coin_env:test/Coin-v0\nmodel: {tiny_model_dir}\nsteps: 3\nseed: 3\ncheckpoint_every: 1\n"
        "rollout: {group_size: 4, max_tokens_per_turn: 12, max_total_tokens: 512, concurrency: 8}\n"
        "curriculum: {batch_groups: 2}\noptim: {lr: 1.0e-3, micro_batch_size: 4}\n"
        "asynchronous: {mode: async, max_staleness: 2, overlap: true}\n"
    )
    out = tmp_path / "cut"
    stderr = ctrl_c_after_step_1(cfg, out)  # while the batches of steps 2 and 3 are being built
    assert "interrupted at step" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr
    resumed = subprocess.run(
        train_cmd(cfg, out), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming checkpoint-" in resumed.stderr
    trained = rows(out)
    assert [r["step"] for r in trained] == [1, 2, 3]
    state = json.loads((out / "checkpoint-3" / STATE_DIR / "state.json").read_text())
    learned = sum(t["samples"] for t in state["curriculum"]["tasks"])
    generated = sum(r["batch/generated_groups"] for r in trained)
    assert learned == 4 * generated, (learned, generated)  # coin episodes never break: all are evidence
    assert all(r["async/staleness_max"] <= 2 for r in trained)


# --- the run directory: resume, refuse a changed config, --force ---------------------------------------


def fake_run(out: Path, cfg: TrainConfig, step: int) -> None:
    """What a run that saved checkpoint-<step> leaves behind (enough for prepare_run_dir)."""
    ck = out / f"checkpoint-{step}"
    (ck / STATE_DIR).mkdir(parents=True)
    (ck / "model.safetensors").write_bytes(b"weights")
    (ck / STATE_DIR / "state.json").write_text(json.dumps({"step": step}))
    (out / "config.json").write_text(cfg.model_dump_json(indent=2))
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s + 1}) + "\n" for s in range(step)))


def test_a_changed_config_is_refused_with_the_changes_listed(tmp_path):
    cfg = TrainConfig(model="m", out=str(tmp_path), steps=4)
    fake_run(tmp_path, cfg, 2)
    changed = cfg.model_copy(update={"seed": 7, "optim": cfg.optim.model_copy(update={"lr": 3e-4})})
    with pytest.raises(UserError, match=r"at step 2 trained with another config: optim.lr: 1e-05 -> 0.0003; seed: 0 -> 7\. "
                       r"Resume it with the same config, train into another out=, or pass --force"):  # fmt: skip
        prepare_run_dir(changed)
    before = (tmp_path / "config.json").read_text()
    assert "resuming" in prepare_run_dir(cfg.model_copy(update={"steps": 8}))  # more steps: the same run
    assert json.loads((tmp_path / "config.json").read_text())["steps"] == 8
    assert (tmp_path / "config.step-2.json").read_text() == before  # never overwritten silently
    note = prepare_run_dir(changed, force=True)
    assert "under the changed config" in note and "config.step-2.json" in note
    assert json.loads((tmp_path / "config.json").read_text())["seed"] == 7


def test_a_setting_added_since_the_run_started_is_not_a_change(tmp_path):
    cfg = TrainConfig(model="m", out=str(tmp_path), steps=4)
    fake_run(tmp_path, cfg, 2)
    recorded = json.loads((tmp_path / "config.json").read_text())
    del recorded["collective_timeout_s"]  # a run written before that setting existed
    del recorded["engine"]["sleep_wait_s"]
    (tmp_path / "config.json").write_text(json.dumps(recorded))
    assert "resuming" in prepare_run_dir(cfg)


def test_resume_off_with_a_run_there_is_refused_unless_forced(tmp_path):
    cfg = TrainConfig(model="m", out=str(tmp_path), steps=4)
    fake_run(tmp_path, cfg, 2)
    fresh = cfg.model_copy(update={"resume": False})
    with pytest.raises(
        UserError, match=r"already holds a training run \(checkpoint at step 2\) and resume is off"
    ):
        prepare_run_dir(fresh)
    assert "starting a new run" in prepare_run_dir(fresh, force=True)
    assert checkpoints(tmp_path) == [] and not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_checkpoints_are_huggingface_directories_and_only_the_last_ones_are_kept(tiny_model_dir, tmp_path):  # noqa: F811
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.core.errors import check_model_dir
    from agentrl.rollout.trajectory import save_trajectories
    from tests.train.test_trainer import grpo_batch, run

    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    save_trajectories(tmp_path / "batch.jsonl", grpo_batch(vocab))
    cfg = TrainConfig(
        model=str(tiny_model_dir), replay=str(tmp_path / "batch.jsonl"), out=str(tmp_path / "run"), steps=4,
        checkpoint_every=1, keep_last=2, optim={"lr": 1e-3, "micro_batch_size": 4},
    )  # fmt: skip
    run(cfg, 1)
    out = tmp_path / "run"
    assert [s for s, _ in checkpoints(out)] == [3, 4]
    assert not (out / "checkpoint-3" / STATE_DIR).exists() and (out / "checkpoint-4" / STATE_DIR).exists()
    for path in (out / "checkpoint-3", out / "final"):
        check_model_dir(path)  # what `agentrl eval --model` accepts
        model = AutoModelForCausalLM.from_pretrained(path)
        assert (
            AutoTokenizer.from_pretrained(path).pad_token_id is not None and model.config.vocab_size == vocab
        )
    assert sha(out / "checkpoint-4" / "model.safetensors") == sha(out / "final" / "model.safetensors")


@pytest.mark.vllm
@pytest.mark.slow
def test_an_engine_that_dies_stops_the_run_with_a_checkpoint_and_the_run_resumes(tiny_model_dir, tmp_path):  # noqa: F811
    """The vLLM engine process killed mid-run (two training processes: the engine core is a process of its
    own): its episodes end with a recorded error, the next weight push finds it gone, every rank stops
    together after saving the step just trained, with one line saying where and how to resume; the same
    command then finishes the run."""
    import psutil

    cfg = tmp_path / "coin.yaml"
    cfg.write_text(
        f"env: tests.coin_env:test/Coin-v0\nmodel: {tiny_model_dir}\nsteps: 4\nseed: 5\n"
        "rollout: {group_size: 4, max_tokens_per_turn: 12, max_total_tokens: 512, concurrency: 8}\n"
        "curriculum: {batch_groups: 2, max_gen_factor: 2.0}\noptim: {lr: 1.0e-4, micro_batch_size: 4}\n"
        "stop_uninformative_after: 0\n"
    )
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [*train_cmd(cfg, out), "--nproc", "2"],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 600
    while not ((out / "metrics.jsonl").exists() and len(rows(out)) >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    cores = [
        p for p in psutil.Process(proc.pid).children(recursive=True) if "EngineCore" in " ".join(p.cmdline())
    ]
    assert cores, "no engine core process under the run"
    for p in cores:
        p.kill()
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2, stderr[-3000:]
    said = [line for line in stderr.splitlines() if line.startswith("error: the rollout engine died")]
    assert said and "Traceback" not in stderr, stderr[-3000:]
    step = int(said[0].split("after step ")[1].split("/")[0])
    assert f"Saved {out}/checkpoint-{step}" in said[0] and f"agentrl train {cfg} out={out}" in said[0]
    assert (out / f"checkpoint-{step}" / STATE_DIR / "state.json").exists()

    resumed = subprocess.run(
        [*train_cmd(cfg, out), "--nproc", "2"],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming checkpoint-{step}" in resumed.stderr
    assert [r["step"] for r in rows(out)][-1] == 4 and (out / "final" / "model.safetensors").exists()
