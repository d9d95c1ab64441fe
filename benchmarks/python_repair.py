"""python-repair-v0: reset and verification latency, against a bare `docker run` of the same test command.

    .venv/bin/python benchmarks/python_repair.py                  # 12 cached tasks, all packages
    .venv/bin/python benchmarks/python_repair.py --tasks 4 --packages inflection

Prints ONE JSON object on stdout (progress on stderr). For each task, in the same run:

- `reset_s`: `env.reset()` (warm pool sandbox, staging the package from the image, writing the
  mutant module);
- `verify_s`: the `hidden-tests` verifier after the oracle's fix (kill the agent's processes,
  copy the tests in, the hardened pytest run, the JUnit report read back);
- `episode_s`: the oracle's whole episode, reset to verdict;
- `bare_docker_run_s`: `docker run --rm` (docker SDK `containers.run`) of the package's image
  with the fixed source and the tests bind-mounted read-only, running the same pytest over the
  same tests: the floor a verification could cost without our sandbox or hardening;
- `bare_pytest_s`: the time pytest itself took inside that bare container (its own clock),
  i.e. the suite's cost with no container start at all.

Tasks come from the synthesizer's cache (`agentrl tasks synth python-repair` first).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agentrl.agents import run_episode
from agentrl.envs.python_repair.env import PythonRepairEnv
from agentrl.envs.python_repair.packages import DEFAULT_PACKAGES, get_spec, source_dir, tests_dir
from agentrl.envs.python_repair.synth import cached_tasks
from agentrl.task import Task

BARE_SCRIPT = """
import sys, time
t0 = time.perf_counter()
import pytest
code = pytest.main(["-c", "/dev/null", "--rootdir=/t", "-p", "no:cacheprovider", "-q", "/t"])
print(f"BARE_PYTEST_S={time.perf_counter() - t0:.4f}")
sys.exit(int(code))
"""


def pct(xs: list[float]) -> dict[str, Any]:
    xs = sorted(xs)
    if not xs:
        return {"n": 0}
    return {
        "n": len(xs),
        "p50": round(statistics.median(xs), 4),
        "p99": round(xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))], 4),
        "mean": round(statistics.fmean(xs), 4),
    }


def pick(tasks: list[Task], n: int, packages: list[str]) -> list[Task]:
    """Round-robin over packages, in cache order: a fixed, spread-out sample."""
    by_pkg = {p: [t for t in tasks if t.metadata["package"] == p] for p in packages}
    out: list[Task] = []
    i = 0
    while len(out) < n and any(i < len(v) for v in by_pkg.values()):
        out.extend(v[i] for v in by_pkg.values() if i < len(v) and len(out) < n)
        i += 1
    return out


def bare_run(client: Any, task: Task) -> tuple[float, float, int]:
    """`docker run --rm` of the same tests over the fixed package; (wall s, pytest's own s, exit code)."""
    spec = get_spec(task.metadata["package"])
    with tempfile.TemporaryDirectory(prefix="agentrl-bare-") as tmp:
        script = Path(tmp, "run.py")
        script.write_text(BARE_SCRIPT)
        t0 = time.perf_counter()
        # What `docker run --rm` does (containers.run raises on a non-zero exit, and the suites
        # have tests that fail on the pristine package too, e.g. toolz's metadata check).
        container = client.containers.create(
            spec.image,
            ["python3", "-B", "/run/run.py"],
            network_disabled=True,
            working_dir="/tmp",
            environment={"PYTHONPATH": "/w"},
            volumes={
                str(source_dir(spec)): {"bind": "/w", "mode": "ro"},
                str(tests_dir(spec)): {"bind": "/t", "mode": "ro"},
                tmp: {"bind": "/run", "mode": "ro"},
            },
            labels={"agentrl.purpose": "python-repair-bench"},
        )
        try:
            container.start()
            code = container.wait()["StatusCode"]
            out = container.logs()
        finally:
            container.remove(force=True)
        wall = time.perf_counter() - t0
    text = out.decode(errors="replace")
    inner = next(
        (float(ln.split("=", 1)[1]) for ln in text.splitlines() if ln.startswith("BARE_PYTEST_S=")), 0.0
    )
    return wall, inner, code


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=12, help="How many cached tasks to time.")
    ap.add_argument("--packages", default=",".join(DEFAULT_PACKAGES), help="Comma-separated packages.")
    ap.add_argument("--seed", type=int, default=0, help="Synthesis seed of the cached tasks.")
    args = ap.parse_args()
    import docker

    packages = [p for p in args.packages.split(",") if p]
    tasks = pick(cached_tasks(packages, args.seed), args.tasks, packages)
    if not tasks:
        print(
            "no cached python-repair tasks: run `agentrl tasks synth python-repair --n 300` first",
            file=sys.stderr,
        )
        return 2
    client = docker.from_env()
    env = PythonRepairEnv(tasks=tasks, max_turns=4)
    reset_s: list[float] = []
    verify_s: list[float] = []
    episode_s: list[float] = []
    bare_s: list[float] = []
    bare_inner_s: list[float] = []
    per_package: dict[str, dict[str, list[float]]] = {}
    rewards: list[float] = []
    try:
        # One untimed episode: the pool's first sandbox of each image and imports are start-up costs.
        run_episode(env, env.oracle(tasks[0]), options={"task": tasks[0]})
        for i, task in enumerate(tasks):
            pkg = task.metadata["package"]
            t0 = time.perf_counter()
            obs, _ = env.reset(options={"task": task})
            reset_s.append(time.perf_counter() - t0)
            agent = env.oracle(task)
            while True:
                obs, reward, terminated, truncated, info = env.step(agent.act(obs))
                if terminated or truncated:
                    break
            episode_s.append(time.perf_counter() - t0)
            verify_s.append(info["verdict"].duration_s)
            rewards.append(reward)
            wall, inner, code = bare_run(client, task)
            bare_s.append(wall)
            bare_inner_s.append(inner)
            d = per_package.setdefault(pkg, {"verify_s": [], "bare_docker_run_s": []})
            d["verify_s"].append(verify_s[-1])
            d["bare_docker_run_s"].append(wall)
            print(
                f"[bench] {i + 1}/{len(tasks)} {pkg}: reset {reset_s[-1]:.2f}s verify {verify_s[-1]:.2f}s "
                f"bare docker run {wall:.2f}s (pytest {inner:.2f}s, exit {code}) reward {reward}",
                file=sys.stderr,
                flush=True,
            )
    finally:
        env.close()
    result = {
        "env": "agentrl/python-repair-v0",
        "tasks": len(tasks),
        "oracle_reward_mean": statistics.fmean(rewards),
        "reset_s": pct(reset_s),
        "verify_s": pct(verify_s),
        "episode_s": pct(episode_s),
        "bare_docker_run_s": pct(bare_s),
        "bare_pytest_s": pct(bare_inner_s),
        "verify_over_bare_docker_run": round(statistics.median(verify_s) / statistics.median(bare_s), 3),
        "per_package": {k: {kk: pct(vv) for kk, vv in v.items()} for k, v in sorted(per_package.items())},
        "docker_server": client.version().get("Version"),
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
