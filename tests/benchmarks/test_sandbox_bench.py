"""Smoke run of `benchmarks/sandbox.py --quick`: the real script, a tiny budget, its JSON's shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sandbox.py"
LATENCY_KEYS = {"n", "p50", "p99", "mean", "min", "max"}


@pytest.mark.docker
@pytest.mark.slow
def test_quick_run_prints_one_json_object_and_leaves_nothing_behind() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--backends", "docker,local"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)  # stdout is the JSON object and nothing else

    for name in ("docker", "local"):
        backend = result["backends"][name]
        assert backend["available"] is True, backend
        assert "error" not in backend, backend["error"]
        for key in (
            "start_ms",
            "close_ms",
            "exec_true_ms",
            "exec_python_ms",
            "reset_no_pool_ms",
            "reset_pool_ms",
        ):
            assert set(backend[key]) == LATENCY_KEYS, (name, key, backend[key])
            assert 0 < backend[key]["p50"] <= backend[key]["p99"], (name, key, backend[key])
        assert backend["pool"]["hits"] + backend["pool"]["misses"] == result["config"]["episodes"]

    overhead = result["docker_exec_overhead"]
    assert overhead["ratio_p50"] > 0 and overhead["reps"] == result["config"]["reps"]
    concurrency = result["docker_concurrency"]
    assert concurrency["started"] == concurrency["answered_exec"] == concurrency["requested"]
    assert concurrency["answered_through_executor"] == concurrency["requested"]
    assert concurrency["error"] is None

    # Tool calls and env steps with and without the resident executor, at each concurrency.
    for mode in ("docker_exec", "docker_executor"):
        for n in result["config"]["concurrency"]:
            calls = result["tool_calls"][mode][str(n)]
            assert set(calls["latency_ms"]) == LATENCY_KEYS and calls["calls_per_s"] > 0, (mode, n, calls)
            assert calls["cpu_ms_per_call"]["stack"] > 0 and len(calls["load_before"]) == 3
            assert result["env_steps"][mode][str(n)]["steps_per_s"] > 0, (mode, n)
    assert {
        "docker.exec_overhead_ratio_p50",
        "docker.concurrent_sandboxes",
        "docker.pool_reset_p50_ms",
        "docker.executor_p50_ms",
        "docker.executor_speedup_p50",
    } <= set(result["targets"])

    import docker

    left = docker.from_env().api.containers(all=True, filters={"label": f"agentrl.bench={result['run_tag']}"})
    assert left == [], [c["Names"] for c in left]
