"""Robustness against an adversarial policy: what the attacks cost now, measured.

    .venv/bin/python benchmarks/robustness.py                  # reads on docker and bwrap, then signals
    .venv/bin/python benchmarks/robustness.py --skip-signals --reps 3

Prints ONE JSON object on stdout (progress on stderr):

- `reads`: per backend and path, `env.step(read_file(path))` wall time (median and max over
  `--reps`), the peak of Python memory allocated during the step (tracemalloc) and the growth of
  the process's resident set (VmRSS before/after), for /dev/zero, /dev/urandom and a 50 MB file.
- `step_limits`: one message of 8 x `sleep 1` on calc-v0's python tool: calls run, calls not run,
  and the step's wall time (the limit is 4 calls per message).
- `signals`: a rollout driver (the rollout API on calc-v0, docker, warm pool, 4 episodes each in a
  sleeping python call) stopped by SIGTERM, SIGINT and SIGKILL: its labelled containers before
  the signal, after it exits, and (SIGKILL) after the next process's start-up reap.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

from agentrl.core.task import Task
from agentrl.env.agents import tool_call
from agentrl.env.tool_env import ToolEnv

TASK = Task(id="bench/1", prompt="Read things.", answer="0")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def bench_reads(backend: str, reps: int) -> dict[str, Any]:
    env = ToolEnv(
        tasks=[TASK], tools=["bash", "read_file", "submit"], backend=backend, use_pool=False, max_turns=1000
    )
    out: dict[str, Any] = {}
    try:
        env.reset(seed=0)
        env.step(tool_call("bash", command="head -c 50000000 /dev/zero | tr '\\0' a > big.txt"))
        for path in ("/dev/zero", "/dev/urandom", "big.txt"):
            times, peaks, growths, chars = [], [], [], 0
            for _ in range(reps):
                rss0 = rss_bytes()
                tracemalloc.start()
                t0 = time.perf_counter()
                obs, *_ = env.step(tool_call("read_file", path=path))
                times.append(time.perf_counter() - t0)
                peaks.append(tracemalloc.get_traced_memory()[1])
                tracemalloc.stop()
                growths.append(max(0, rss_bytes() - rss0))
                chars = len(obs[0]["content"])
            out[path] = {
                "median_s": statistics.median(times),
                "max_s": max(times),
                "python_peak_bytes": max(peaks),
                "rss_growth_bytes": max(growths),
                "observation_chars": chars,
                "observation_start": obs[0]["content"][:80],
            }
            log(f"{backend} read_file({path}): {out[path]['median_s'] * 1000:.0f} ms, peak {max(peaks)} B")
    finally:
        env.close()
    return out


def bench_step_limits() -> dict[str, Any]:
    import agentrl

    env = agentrl.make("agentrl/calc-v0", use_pool=False)
    try:
        env.reset(seed=0)
        action = "".join(tool_call("python", code="import time; time.sleep(1)") for _ in range(8))
        t0 = time.perf_counter()
        _, _, _, _, info = env.step(action)
        return {
            "calls_in_message": 8,
            "max_tool_calls_per_step": env.max_tool_calls_per_step,
            "calls_run": info["step_tool_calls"],
            "calls_not_run": info["step_tool_calls_not_run"],
            "step_s": time.perf_counter() - t0,
        }
    finally:
        env.close()


DRIVER = """
import sys
from transformers import AutoTokenizer
from agentrl.env.agents import tool_call
from agentrl.kit.demonstrations import ScriptedPolicy
from agentrl.rollout.masker import ChatMasker
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.loop import collect_sync

masker = ChatMasker(AutoTokenizer.from_pretrained(sys.argv[1]))

class Sleeper:
    def act(self, observation):
        print("ACT", flush=True)
        return tool_call("python", code="import time; time.sleep(120)")

collect_sync(
    "agentrl/calc-v0", [0, 1], None, RolloutConfig(group_size=2, concurrency=4, episode_timeout_s=300),
    masker=masker, episode_policy=lambda env, seq: ScriptedPolicy(Sleeper(), seq, masker),
    env_kwargs={"exec_timeout_s": 200},
)
"""


def containers_of(run_id: str) -> int:
    import docker

    return len(docker.from_env().containers.list(all=True, filters={"label": f"agentrl.run_id={run_id}"}))


def bench_signal(signum: signal.Signals, model_dir: Path) -> dict[str, Any]:
    run_id = f"bench-robust-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "AGENTRL_RUN_ID": run_id, "AGENTRL_POOL_SIZE": "2"}
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(model_dir)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    for _ in range(4):
        if proc.stdout.readline().strip() != "ACT":
            raise RuntimeError("the rollout driver did not start its episodes")
    time.sleep(1.0)
    before = containers_of(run_id)
    t0 = time.perf_counter()
    proc.send_signal(signum)
    proc.communicate(timeout=120)
    result = {
        "containers_before": before,
        "exit_s": time.perf_counter() - t0,
        "returncode": proc.returncode,
        "containers_after_exit": containers_of(run_id),
    }
    if signum == signal.SIGKILL:
        reap = "from agentrl.sandbox import open_sandbox, reaper\nwith open_sandbox('docker'):\n    reaper.wait_startup_reap(timeout=60)\n"
        subprocess.run([sys.executable, "-c", reap], check=True, timeout=120)
        result["containers_after_next_startup_reap"] = containers_of(run_id)
    log(f"{signum.name}: {result}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="Reads per path and backend.")
    parser.add_argument("--backends", default="docker,bwrap", help="Comma-separated sandbox backends.")
    parser.add_argument("--skip-signals", action="store_true", help="Skip the rollout-driver signal runs.")
    args = parser.parse_args()
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "note": "shared 2-core box; other test suites ran at the same time",
        },
        "reads": {b: bench_reads(b, args.reps) for b in args.backends.split(",")},
        "step_limits": bench_step_limits(),
    }
    if not args.skip_signals:
        from agentrl.kit.tiny_model import init_tiny

        with tempfile.TemporaryDirectory() as tmp:
            model_dir = init_tiny(Path(tmp) / "tiny", seed=0)
            results["signals"] = {
                s.name: bench_signal(s, model_dir) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)
            }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
