"""Smoke run of `benchmarks/lora.py --tiny` on the CPU: full and LoRA on one batch, both pushed into real vLLM
engines, and the engines' log-probs equal to the trainer's after each push."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "lora.py"


@pytest.mark.vllm
@pytest.mark.slow
def test_tiny_mode_measures_full_and_lora_and_their_pushes(tmp_path: Path) -> None:
    out_file = tmp_path / "lora.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--steps", "1", "--warmup", "0", "--trajectories", "8",
         "--push-reps", "1", "--check-trajectories", "4", "--out", str(out_file)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out_file.read_text())
    assert result["engine"] == "vllm" and result["device"] == "cpu"
    full, lora = (result["shapes"]["tiny"]["variants"][k] for k in ("full", "lora"))
    for v in (full, lora):
        assert v["ok"] and v["tokens_per_s"] > 0 and v["peak_memory_gib"] > 0 and v["engine_s"] > 0
        # fp32 engine and fp32 trainer: the push landed (a missed push would differ by ~1e-2 and more).
        assert v["logprob_abs_diff"] < 1e-4
    assert lora["trainable_params"] < full["trainable_params"] / 5
    assert lora["bytes"] < full["bytes"] / 5
    assert result["shapes"]["tiny"]["lora_vs_full"]["push_bytes"] == pytest.approx(
        lora["bytes"] / full["bytes"], abs=1e-4
    )
