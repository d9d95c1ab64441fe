"""Training across nodes: `agentrl train --nnodes 2 --node-rank R --rdzv-endpoint HOST:PORT`, two
"nodes" on this machine (one process each), against the same run in one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agentrl.rollout.trajectory import save_trajectories
from tests.fixtures_dist import _free_port
from tests.fixtures_model import tiny_model_dir  # noqa: F401  (pytest fixture)
from tests.train.test_trainer import grpo_batch

AGENTRL_CLI = Path(sys.executable).with_name("agentrl")


def write_config(tmp_path: Path, model: Path, out: str) -> Path:
    data = tmp_path / "batch.jsonl"
    if not data.exists():
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        save_trajectories(data, grpo_batch(vocab))
    cfg = tmp_path / f"{out}.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "model": str(model),
                "replay": str(data),
                "steps": 2,
                "out": str(tmp_path / out),
                "optim": {"lr": 1e-3, "micro_batch_size": 2},
            }
        )
    )
    return cfg


def metrics(tmp_path: Path, out: str) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_nodes_of_one_process_give_the_loss_of_one_process(tiny_model_dir, tmp_path):  # noqa: F811
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    one = subprocess.run(
        [str(AGENTRL_CLI), "train", str(write_config(tmp_path, tiny_model_dir, "one"))],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    cfg = write_config(tmp_path, tiny_model_dir, "two")
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [
        subprocess.Popen(
            [
                str(AGENTRL_CLI),
                "train",
                str(cfg),
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--rdzv-endpoint",
                endpoint,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=600) for p in nodes]
    for p, (_, err) in zip(nodes, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    a, b = metrics(tmp_path, "one"), metrics(tmp_path, "two")
    assert [r["step"] for r in b] == [1, 2]
    # Stated tolerance: fp32 CPU, sums split across ranks in another order: 1e-5 relative on the loss.
    for x, y in zip(a, b, strict=True):
        assert y["losses/policy_loss"] == pytest.approx(x["losses/policy_loss"], rel=1e-5, abs=1e-7)
        assert y["losses/grad_norm"] == pytest.approx(x["losses/grad_norm"], rel=1e-4)
        assert y["batch/action_tokens"] == x["batch/action_tokens"]


def test_several_nodes_without_an_endpoint_is_one_line_naming_the_flag(tmp_path):
    (tmp_path / "c.yaml").write_text("model: m\n")
    out = subprocess.run(
        [str(AGENTRL_CLI), "train", str(tmp_path / "c.yaml"), "--nnodes", "2", "--node-rank", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0
    assert "--nnodes 2 needs --rdzv-endpoint HOST:PORT" in out.stderr
