"""`agentrl demo --quick`: the real demo script end to end with tiny budgets, then a second run that reuses it."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_demo(out: Path) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [str(ROOT / ".venv/bin/agentrl"), "demo", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return proc, time.perf_counter() - t0


@pytest.mark.docker
@pytest.mark.vllm
@pytest.mark.slow
def test_quick_demo_runs_every_stage_and_a_second_run_reuses_them(tmp_path):
    out = tmp_path / "demo"
    proc, first_s = run_demo(out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "demo.json").read_text())
    assert report["train"]["steps"] == 2
    assert set(report["eval"]["before"]) == {"pass@1", "pass@2"} == set(report["eval"]["after"])
    for png in (out / "training.png", out / "eval" / "pass_at_k.png", out / "eval" / "task_scatter.png"):
        assert png.read_bytes()[:4] == b"\x89PNG"
    assert (out / "eval" / "report.md").read_text().startswith("# Evaluation")
    # The model judged on test was selected on validation (evaluated at the start and after each step),
    # the warm start among the candidates: the best of the three, the earlier on a tie.
    rows = [json.loads(line) for line in (out / "train" / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    scores = [r["eval/pass@1"] for r in rows]
    kept = report["train"]["selected_step"]
    assert kept == scores.index(max(scores)) and report["train"]["selected"].endswith("best")
    said = "the warm start itself" if kept == 0 else f"step {kept} of 2"
    assert f"[demo] model selection: {said}" in proc.stdout and "never seen in training" in proc.stdout
    assert report["numerics"] == "pinned" and report["seed"] == 0
    # A quiet console: stage lines and results only; the engines' and libraries' output is in demo.log.
    assert all(line.startswith("[demo]") for line in proc.stdout.splitlines())
    assert "vllm" not in proc.stderr.lower() and "warning" not in proc.stderr.lower()
    assert "[demo] 2/3 GRPO: step 2/2" in proc.stdout and "[demo] 3/3 evaluation: done in" in proc.stdout
    assert "[warm-start]" in (out / "demo.log").read_text()
    assert "grpo vs warm-start: " in proc.stdout  # the paired verdict
    paired = report["paired"]
    assert paired["verdict"] in proc.stdout and 0.0 <= paired["p_value"] <= 1.0
    assert paired["ci_low"] <= paired["difference"] <= paired["ci_high"] and paired["episodes"] == 8
    # Second run: warm start, training and evaluation episodes are all reused.
    proc2, second_s = run_demo(out)
    assert proc2.returncode == 0, proc2.stderr[-4000:]
    assert "reused" in proc2.stdout and "GRPO: reusing" in proc2.stdout
    assert second_s < first_s


def test_counted_progress_counts_from_where_a_resumed_stage_starts():
    from agentrl.kit.demo import _counted

    rows = [3]  # 3 of 8 steps finished by an earlier session
    progress = _counted(lambda: rows[0], 8, "step")
    rows[0] = 4
    assert progress() == (1, 5, "step")


def test_milestones_reads_only_whole_lines_written_after_the_stage_started(tmp_path):
    from agentrl.kit.demo import _milestones

    log = tmp_path / "demo.log"
    log.write_text("[warm-start] from an earlier run\n")
    progress = _milestones(log, "[warm-start] ")
    assert progress() == (0, 0, "")
    with log.open("a") as f:
        f.write(
            "INFO vllm noise\n[warm-start] main: 40 SFT steps\n[warm-start] built"
        )  # last line unfinished
    assert progress() == (0, 0, "main: 40 SFT steps")
    with log.open("a") as f:
        f.write(" runs/demo/warm-start in 300s\n")
    assert progress() == (0, 0, "built runs/demo/warm-start in 300s")


def test_the_verdict_line_shows_pass_at_k_when_it_moves_against_pass_at_1():
    from types import SimpleNamespace

    from agentrl.kit.demo import verdict_line

    def summary(p1: float, p4: float) -> SimpleNamespace:
        at = [SimpleNamespace(k=1), SimpleNamespace(k=2), SimpleNamespace(k=4)]
        return SimpleNamespace(pass_at=at, pass_at_dict=lambda: {"pass@1": p1, "pass@2": 0.0, "pass@4": p4})

    paired = SimpleNamespace(verdict="grpo vs warm-start: +5.0 points")
    assert verdict_line(paired, summary(0.60, 0.90), summary(0.65, 0.85)) == (
        "grpo vs warm-start: +5.0 points; but pass@4 0.900 -> 0.850 (-5.0 points)"
    )
    assert verdict_line(paired, summary(0.60, 0.85), summary(0.65, 0.90)) == paired.verdict


def test_pinned_numerics_set_every_pin_and_native_clears_them():
    from agentrl.kit.numerics import PINNED, pinned_env

    pinned = pinned_env("pinned", {"PATH": "/bin", "MKL_CBWR": "AVX512"})
    assert {k: pinned[k] for k in PINNED} == PINNED and pinned["PATH"] == "/bin"
    native = pinned_env("native", pinned)
    assert not set(PINNED) & set(native) and native["PATH"] == "/bin"


def test_demo_seeds_reads_its_starts_and_summarizes_the_spread():
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_seeds", ROOT / "benchmarks" / "demo_seeds.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.parse_starts("0,1:native, 2:pinned") == [(0, "pinned"), (1, "native"), (2, "pinned")]
    with pytest.raises(SystemExit, match="pinned or native"):
        mod.parse_starts("0:fast")
    rows = [
        {
            "gain_points": g,
            "significant": s,
            "pass@4_gain_points": k,
            "warm_start": {"pass@1": 0.6},
            "trained": {"pass@1": 0.6 + g / 100},
        }
        for g, s, k in ((10.0, True, 2.0), (4.0, False, -1.0), (-6.0, True, 0.0))
    ] + [
        {"error": "agentrl demo exited 1"},
        {"error": "agentrl demo exited 2", "warm_start_never_learned": True},
    ]
    summary = mod.summarize(rows)
    assert summary["finished"] == 3 and summary["warm_starts"] == 5
    assert summary["warm_starts_that_never_learned"] == 1
    assert (summary["gain_mean_points"], summary["gain_min_points"], summary["gain_max_points"]) == (
        2.7,
        -6.0,
        10.0,
    )
    assert (summary["better"], summary["significant_better"], summary["significant_worse"]) == (2, 1, 1)
    assert summary["pass@k_gain_mean_points"] == 0.3
