"""Smoke run of `benchmarks/train_gpu.py --tiny` on the CPU: the JSON the H100 run prints, every variant filled in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "train_gpu.py"


@pytest.mark.slow
def test_tiny_mode_prints_throughput_mfu_memory_and_the_ratio_to_plain(tmp_path: Path) -> None:
    out_file = tmp_path / "train_gpu.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--tiny",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--trajectories",
            "8",
            "--long-trajectories",
            "2",
            "--long-len",
            "256",
            "--out",
            str(out_file),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)  # stdout holds the JSON object only
    assert json.loads(out_file.read_text()) == result
    assert result["benchmark"] == "train_gpu" and result["mode"] == "tiny" and result["device"] == "cpu"
    tiny = result["shapes"]["tiny"]
    assert tiny["trajectories"] == 8 and tiny["tokens_per_step"] > 0
    assert tiny["defaults"]["packs_here"] is True  # auto packs on the CPU
    assert set(tiny["variants"]) == {"ours", "ours_packing_off", "plain", "ours_activation_checkpointing"}
    for name, v in tiny["variants"].items():
        assert v["ok"] and v["tokens_per_s"] > 0 and v["peak_memory_gib"] > 0, name
        assert v["mfu"] is None  # no peak FLOP/s for a CPU
    assert tiny["speedup_vs_plain"] > 0
    assert 0 < tiny["activation_checkpointing_memory_cut"] < 1
    assert tiny["long"]["ok"] and tiny["long"]["tokens"] == 256
    assert tiny["defaults"]["shares_prefix_here"] is True and tiny["defaults"]["compiles_here"] is False
    # The GRPO-shaped batch: groups of 8 sharing a prompt, held once per micro-batch by ours.
    grpo = tiny["grpo"]
    assert (grpo["groups"], grpo["group_size"], grpo["prompt_len"]) == (2, 8, 64)
    assert set(grpo["variants"]) == {"ours", "ours_share_prefix_off", "plain"}
    ours, off, plain = (grpo["variants"][k] for k in ("ours", "ours_share_prefix_off", "plain"))
    for v in (ours, off, plain):
        assert v["ok"] and v["tokens_per_s"] > 0 and v["computed_tokens_per_s"] > 0
    # computed: each group's prompt about once (twice where a group spans two micro-batches), against 8 times
    assert ours["computed_tokens_per_step"] == grpo["shared_plan_positions"]
    assert ours["computed_tokens_per_step"] < grpo["tokens_per_step"] - 2 * 5 * 64
    assert off["computed_tokens_per_step"] == grpo["tokens_per_step"]  # packed, unshared: every token once
    assert plain["computed_tokens_per_step"] > grpo["tokens_per_step"]  # padded
    assert grpo["trained_speedup_vs_plain"] > 0 and grpo["speedup_from_sharing"] > 0


@pytest.mark.slow
def test_a_token_budget_and_a_profile_of_our_step(tmp_path: Path) -> None:
    """`--max-tokens-per-micro-batch` reaches our variants (a budget below one trajectory runs each
    alone), and `--profile` writes the operator table of one more step of `ours`."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--quick", "--skip-long", "--steps", "1", "--warmup", "0",
         "--trajectories", "8", "--max-tokens-per-micro-batch", "64", "--profile", str(tmp_path / "prof")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    tiny = json.loads(proc.stdout)["shapes"]["tiny"]
    assert tiny["max_tokens_per_micro_batch"] == 64 and tiny["variants"]["ours"]["ok"]
    prof = tiny["profile"]
    assert prof["table"] == str(tmp_path / "prof") + ".tiny.txt"
    assert "aten::mm" in Path(prof["table"]).read_text()
    assert prof["busy_s"] > 0 and 0 < prof["matmul_share"] < 1
