"""Environment step throughput: env steps per second with many envs in parallel, and where step time goes.

    .venv/bin/python benchmarks/env_step.py                      # calc-v0 on docker, 1/4/8/16 envs
    .venv/bin/python benchmarks/env_step.py --envs 1,4 --episodes 8 --env agentrl/sqlite-v0

Prints ONE JSON object on stdout (progress on stderr). Each parallel env runs in its own
thread, playing the env's oracle (a scripted agent that costs ~nothing), so the numbers are
the environment's own cost: parsing, tool dispatch, the sandbox, the verifier, resets.

`sandbox_share` is the fraction of step + reset wall time spent inside sandbox calls (exec,
file I/O, start via the pool, close), measured by wrapping the sandbox; `ours_share` is the
rest (parsing, validation, bookkeeping, verifier logic outside the sandbox).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import agentrl
from agentrl.sandbox.pool import get_default_pool


class TimedSandbox:
    """Forwards every call to the real sandbox and adds its wall time to a shared counter."""

    def __init__(self, inner: Any, clock: dict[str, float], lock: threading.Lock):
        self._inner, self._clock, self._lock = inner, clock, lock

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                with self._lock:
                    self._clock["sandbox_s"] += time.perf_counter() - t0

        return timed


def run_level(env_id: str, n_envs: int, episodes_per_env: int, backend: str) -> dict[str, Any]:
    clock = {"sandbox_s": 0.0}
    lock = threading.Lock()
    step_times: list[float] = []
    reset_times: list[float] = []

    def worker(k: int) -> int:
        env = agentrl.make(env_id, backend=backend)
        original = env._acquire_sandbox

        def acquire(task: Any) -> Any:
            t0 = time.perf_counter()
            sb = original(task)
            with lock:
                clock["sandbox_s"] += time.perf_counter() - t0
            return TimedSandbox(sb, clock, lock)

        env._acquire_sandbox = acquire
        steps = 0
        try:
            for e in range(episodes_per_env):
                task = env.tasks.get(k * 10_000 + e, env.split)
                agent = env.oracle(task)
                t0 = time.perf_counter()
                obs, _ = env.reset(options={"task": task})
                with lock:
                    reset_times.append(time.perf_counter() - t0)
                while True:
                    action = agent.act(obs)
                    t0 = time.perf_counter()
                    obs, _, terminated, truncated, _ = env.step(action)
                    with lock:
                        step_times.append(time.perf_counter() - t0)
                    steps += 1
                    if terminated or truncated:
                        break
        finally:
            env.close()
        return steps

    t0 = time.perf_counter()
    with ThreadPoolExecutor(n_envs) as pool:
        total_steps = sum(pool.map(worker, range(n_envs)))
    wall = time.perf_counter() - t0
    busy = sum(step_times) + sum(reset_times)
    q = statistics.quantiles(step_times, n=100) if len(step_times) > 1 else [step_times[0]] * 99
    return {
        "envs": n_envs,
        "episodes": n_envs * episodes_per_env,
        "steps": total_steps,
        "wall_s": round(wall, 3),
        "steps_per_s": round(total_steps / wall, 2),
        "episodes_per_s": round(n_envs * episodes_per_env / wall, 2),
        "step_ms_p50": round(q[49] * 1000, 2),
        "step_ms_p99": round(q[98] * 1000, 2),
        "reset_ms_p50": round(statistics.median(reset_times) * 1000, 2),
        "sandbox_share": round(clock["sandbox_s"] / busy, 3) if busy else None,
        "ours_share": round(1 - clock["sandbox_s"] / busy, 3) if busy else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", default="agentrl/calc-v0", help="environment id")
    ap.add_argument("--backend", default="docker", help="sandbox backend")
    ap.add_argument("--envs", default="1,4,8,16", help="comma-separated numbers of parallel envs")
    ap.add_argument("--episodes", type=int, default=6, help="episodes per env at each level")
    args = ap.parse_args()
    results = []
    for n in [int(x) for x in args.envs.split(",")]:
        print(f"[env_step] {args.env} with {n} parallel env(s)...", file=sys.stderr, flush=True)
        results.append(run_level(args.env, n, args.episodes, args.backend))
        print(f"[env_step]   {results[-1]}", file=sys.stderr, flush=True)
    get_default_pool().close()
    print(
        json.dumps(
            {"benchmark": "env_step", "env": args.env, "backend": args.backend, "levels": results}, indent=2
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
