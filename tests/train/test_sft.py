"""SFT under FSDP2: masked loss, and 1 process vs 2 processes (torchrun, gloo) take the same steps."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agentrl.rollout.trajectory import Trajectory, save_trajectories
from agentrl.train.config import SFTConfig
from agentrl.train.packing import plan_micro_batches
from tests.fixtures_model import tiny_model_dir  # noqa: F401  (pytest fixture)


def synthetic_trajectories(n: int, vocab: int, seed: int = 0) -> list[Trajectory]:
    """Random token sequences with prompt (mask 0) then alternating action/observation spans."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(20, 60)
        ids = [rng.randrange(vocab) for _ in range(length)]
        mask = [0] * 8 + [1 if (j // 6) % 2 == 0 else 0 for j in range(length - 8)]
        out.append(
            Trajectory(
                task_id=f"t{i}",
                group_id=f"g{i}",
                token_ids=ids,
                loss_mask=mask,
                behavior_logprobs=[0.0] * length,
                prompt_len=8,
                reward=1.0,
                passed=True,
                finish_reason="submitted",
                policy_version=0,
            )
        )
    return out


def test_micro_batches_are_equal_in_number_and_cover_the_batch():
    trajs = synthetic_trajectories(5, 100)
    plan = plan_micro_batches(trajs, 2, max_tokens=None, max_sequences=2)
    per_rank = [plan.for_rank(r) for r in range(2)]
    assert [len(m) for m in per_rank] == [2, 2]
    real = [t.task_id for mbs in per_rank for mb in mbs for t in mb if any(t.loss_mask)]
    assert sorted(real) == sorted(t.task_id for t in trajs)
    # A rank with fewer sequences pads with a zero-mask copy, never extra loss.
    assert sum(sum(t.loss_mask) for mbs in per_rank for mb in mbs for t in mb) == sum(
        sum(t.loss_mask) for t in trajs
    )


def run_sft(cfg: SFTConfig, nproc: int) -> list[dict]:
    if nproc == 1:
        cmd = [sys.executable, "-m", "agentrl.train.sft", cfg.model_dump_json()]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "agentrl.train.sft",
            cfg.model_dump_json(),
        ]
    # gloo ranks on the CPU even where GPUs are visible: these compare fp32 numbers across process counts.
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
        env={"OMP_NUM_THREADS": "1", **__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_one_and_two_processes_give_the_same_losses(tiny_model_dir, tmp_path):  # noqa: F811
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    data = tmp_path / "data.jsonl"
    save_trajectories(data, synthetic_trajectories(12, vocab))
    base = dict(
        model=str(tiny_model_dir),
        data=str(data),
        epochs=1.0,
        batch_size=6,
        micro_batch_size=2,
        lr=1e-3,
        warmup_steps=0,
        log_every=1,
    )
    one = run_sft(SFTConfig(**base, out=str(tmp_path / "one")), 1)
    # The two-process run also recomputes its layers in backward and packs its micro-batches under a
    # token budget: neither may change a number.
    two = run_sft(
        SFTConfig(
            **{**base, "micro_batch_size": None},
            out=str(tmp_path / "two"),
            activation_checkpointing=True,
            packing="on",
            max_tokens_per_micro_batch=90,
        ),
        2,
    )
    assert [r["step"] for r in one] == [1, 2] == [r["step"] for r in two]
    assert one[0]["tokens"] == two[0]["tokens"]
    # Stated tolerance: fp32 on CPU; the sum is split over ranks in another order (1e-5 relative).
    for a, b in zip(one, two, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    # The step changed the weights the same way: the exported checkpoints agree.
    from safetensors.torch import load_file

    wa, wb = (
        load_file(tmp_path / "one" / "model.safetensors"),
        load_file(tmp_path / "two" / "model.safetensors"),
    )
    assert wa.keys() == wb.keys()
    # Adam's first steps move every weight by about lr (1e-3) whatever the gradient's size, so a
    # gradient that differs in its 6th digit near zero can flip a few updates' size: allow 5% of one step.
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=5e-5)
    # The first loss is the untrained model's NLL: about ln(vocab) for a random init.
    assert abs(one[0]["loss"] - torch.log(torch.tensor(float(vocab))).item()) < 1.0
