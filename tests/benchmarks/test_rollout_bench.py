"""Smoke run of `benchmarks/rollout.py` with a tiny budget: one JSON object of the documented shape on stdout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "rollout.py"


@pytest.mark.vllm
@pytest.mark.slow
def test_quick_run_prints_the_ratio_to_plain_generation(tmp_path: Path) -> None:
    from agentrl.kit.tiny_model import init_tiny

    model = init_tiny(tmp_path / "tiny", seed=0)
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--model",
            str(model),
            "--tasks",
            "2",
            "--group-size",
            "2",
            "--max-tokens-per-turn",
            "8",
            "--max-turns",
            "3",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)  # stdout holds the JSON object only; vLLM's logs went to stderr
    assert result["benchmark"] == "rollout_vs_plain_generate" and result["target"] == 0.85
    (run,) = result["runs"]
    assert run["episodes"] == 4 and run["sampled_tokens"] > 0
    assert run["rollout_tokens_per_s"] > 0 and run["plain_tokens_per_s"] > 0
    assert result["ratio"] > 0 and isinstance(result["meets_target"], bool)
    # The replay resubmits the rollout's own requests, one per turn (the seeded requests sample the same
    # tokens again, up to batch-dependent float differences, so the token count is only bounded).
    assert run["replay_requests"] == run["turns_mean"] * run["episodes"]
    assert 0 < run["replay_sampled_tokens"] <= run["replay_requests"] * 8
    assert result["ratio_vs_replay"] > 0 and isinstance(result["replay_meets_target"], bool)
