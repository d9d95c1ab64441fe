"""python-repair-v0: reset and verification latency, this tree's verifier against an earlier one, canary false positives, and a bare `docker run`.

    .venv/bin/python benchmarks/python_repair.py                  # 12 cached tasks, all packages
    .venv/bin/python benchmarks/python_repair.py --tasks 4 --packages inflection --repeats 3
    .venv/bin/python benchmarks/python_repair.py --oracle-all     # plus every cached task's controls

Prints ONE JSON object on stdout (progress on stderr). For each task, in the same run:

- `reset_s`: `env.reset()` (warm pool sandbox, staging the package with the mutant in place);
- `verify_s` (after) and `verify_before_s` (before): the `hidden-tests` verifier on the same
  sandbox, after the oracle's fix and again on the untouched mutant, `--repeats` times each,
  the two verifiers interleaved in alternating order. "after" is this tree's verifier (canary
  twins included); "before" is `verifiers/hidden_tests.py` and its runner as they were at
  `--baseline-ref` (default: the verifier before the canary twins), loaded from git into a
  temporary module. Both kill the agent's processes, copy the tests in, run pytest and read the
  result, so they are compared whole;
- `bare_docker_run_s`: `docker run --rm` (docker SDK `containers.run`) of the package's image
  with the fixed source and the tests bind-mounted read-only, running the same pytest over the
  same tests: the floor a verification could cost without our sandbox or hardening;
- `bare_pytest_s`: the time pytest itself took inside that bare container (its own clock).

`--oracle-all`: every cached task of every split, the oracle's fix and the untouched mutant, by
this tree's verifier: `oracle_all` counts fixes scored 1 (with the canary twins, a fix scored 0
as tampering is a false positive of theirs), mutants scored 0, and the twins planted.

Tasks come from the synthesizer's cache (`agentrl tasks synth python-repair` first).
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agentrl.core.task import Task
from agentrl.envs.python_repair.env import PythonRepairEnv
from agentrl.envs.python_repair.packages import DEFAULT_PACKAGES, get_spec, source_dir, tests_dir
from agentrl.envs.python_repair.synth import cached_tasks
from agentrl.verifiers.hidden_tests import HiddenTestsVerifier

# The verifier before the canary twins (its hidden_tests.py and pytest_runner.py are "before").
BASELINE_REF = "65d73ada66ae292c8fab0509b64c526da5ea62de"

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


def _git_show(ref: str, path: str) -> str | None:
    repo = Path(__file__).resolve().parent.parent
    res = subprocess.run(["git", "-C", str(repo), "show", f"{ref}:{path}"], capture_output=True, text=True)
    return res.stdout if res.returncode == 0 else None


def _moved_imports(source: str) -> str:
    """`source` with its imports of modules that have moved since (`agentrl.MOVED_MODULES`) pointed at
    where they are now: an older verifier's code, run against this tree."""
    from agentrl import MOVED_MODULES

    for old, new in sorted(MOVED_MODULES.items(), key=lambda kv: -len(kv[0])):
        source = re.sub(rf"\b{re.escape(old)}\b(?![\w.])", new, source)
    return source


def baseline_verifier(ref: str) -> Any:
    """The hidden-tests verifier as it was at `ref` (git show), as a module of its own (with the
    runner it reads from beside itself, where that ref has one)."""
    source = _git_show(ref, "verifiers/hidden_tests.py")
    if source is None:
        raise SystemExit(f"no verifiers/hidden_tests.py at {ref}: pass --baseline-ref")
    folder = Path(tempfile.mkdtemp(prefix="agentrl-bench-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # read from until the benchmark ends
    if (runner := _git_show(ref, "verifiers/pytest_runner.py")) is not None:
        (folder / "pytest_runner.py").write_text(runner)
    path = folder / "hidden_tests_before.py"
    path.write_text(_moved_imports(source))
    spec = importlib.util.spec_from_file_location("agentrl_hidden_tests_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.HiddenTestsVerifier(mode="all", timeout_s=120.0)


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


def fix(env: PythonRepairEnv, task: Task) -> None:
    """Reset, then play the oracle's edits up to (not including) its submit."""
    agent = env.oracle(task)
    obs, _ = env.reset(options={"task": task})
    action = agent.act(obs)
    while '"submit"' not in action:
        obs, *_ = env.step(action)
        action = agent.act(obs)


def controls(env: PythonRepairEnv, verifier: HiddenTestsVerifier, tasks: list[Task]) -> dict[str, Any]:
    """Every task's oracle fix (must score 1) and untouched mutant (must score 0), by `verifier`."""
    fixed_ok = mutant_zero = tampered = twins = 0
    misses: list[str] = []
    for i, task in enumerate(tasks):
        fix(env, task)
        verdict = verifier.verify(env.sandbox, task, env.episode)
        fixed_ok += verdict.reward == 1.0
        if verdict.reward != 1.0:
            tampered += "tampered" in verdict.details
            misses.append(f"{task.id}: {verdict.details[:300]}")
        if m := re.search(r"\[(\d+) canary twins", verdict.details):
            twins += int(m.group(1))
        env.reset(options={"task": task})
        mutant_zero += verifier.verify(env.sandbox, task, env.episode).reward == 0.0
        print(
            f"[bench] controls {i + 1}/{len(tasks)}: fixes scored 1: {fixed_ok}", file=sys.stderr, flush=True
        )
    return {
        "tasks": len(tasks),
        "oracle_scored_1": fixed_ok,
        "oracle_pass_rate": round(fixed_ok / max(1, len(tasks)), 4),
        "canary_false_positives": tampered,
        "mutant_scored_0": mutant_zero,
        "canary_twins_planted": twins,
        "misses": misses[:10],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=12, help="How many cached tasks to time.")
    ap.add_argument("--packages", default=",".join(DEFAULT_PACKAGES), help="Comma-separated packages.")
    ap.add_argument("--seed", type=int, default=0, help="Synthesis seed of the cached tasks.")
    ap.add_argument("--repeats", type=int, default=2, help="Verifications per variant, state and task.")
    ap.add_argument("--backend", default="docker", help="Sandbox backend: docker or bwrap.")
    ap.add_argument("--baseline-ref", default=BASELINE_REF, help="Git ref whose hidden_tests.py is 'before'.")
    ap.add_argument(
        "--oracle-all", action="store_true", help="Also verify every cached task's fix and mutant (controls)."
    )
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
    after = HiddenTestsVerifier(mode="all", timeout_s=120.0)
    before = baseline_verifier(args.baseline_ref)
    env = PythonRepairEnv(tasks=tasks, max_turns=4, backend=args.backend)
    reset_s: list[float] = []
    times: dict[str, list[float]] = {"before": [], "after": []}
    by_state: dict[str, dict[str, list[float]]] = {
        s: {"before": [], "after": []} for s in ("fixed", "mutant")
    }
    bare_s: list[float] = []
    bare_inner_s: list[float] = []
    per_package: dict[str, dict[str, list[float]]] = {}
    rewards: dict[str, list[float]] = {
        "before_fixed": [],
        "after_fixed": [],
        "before_mutant": [],
        "after_mutant": [],
    }
    try:
        # Start-up costs (the pool's first sandbox of each image, imports) are not measured.
        fix(env, tasks[0])
        after.verify(env.sandbox, tasks[0], env.episode)
        before.verify(env.sandbox, tasks[0], env.episode)
        for i, task in enumerate(tasks):
            pkg = task.metadata["package"]
            d = per_package.setdefault(
                pkg, {"verify_before_s": [], "verify_after_s": [], "bare_docker_run_s": []}
            )
            for state in ("fixed", "mutant"):
                t0 = time.perf_counter()
                if state == "fixed":
                    fix(env, task)
                else:
                    env.reset(options={"task": task})
                reset_s.append(time.perf_counter() - t0)
                for rep in range(args.repeats):
                    order = [("before", before), ("after", after)]
                    if (i + rep) % 2:
                        order.reverse()
                    for name, verifier in order:
                        t0 = time.perf_counter()
                        verdict = verifier.verify(env.sandbox, task, env.episode)
                        took = time.perf_counter() - t0
                        times[name].append(took)
                        by_state[state][name].append(took)
                        d[f"verify_{name}_s"].append(took)
                        rewards[f"{name}_{state}"].append(verdict.reward)
            wall, inner, code = bare_run(client, task)
            bare_s.append(wall)
            bare_inner_s.append(inner)
            d["bare_docker_run_s"].append(wall)
            print(
                f"[bench] {i + 1}/{len(tasks)} {pkg}: verify before {statistics.median(d['verify_before_s']):.2f}s "
                f"after {statistics.median(d['verify_after_s']):.2f}s; bare docker run {wall:.2f}s "
                f"(pytest {inner:.2f}s, exit {code})",
                file=sys.stderr,
                flush=True,
            )
        oracle_all = controls(env, after, cached_tasks(packages, args.seed)) if args.oracle_all else None
    finally:
        env.close()
    result = {
        "env": "agentrl/python-repair-v0",
        "backend": args.backend,
        "tasks": len(tasks),
        "repeats": args.repeats,
        "baseline_ref": args.baseline_ref,
        "reward_mean": {k: round(statistics.fmean(v), 3) for k, v in rewards.items()},
        "reset_s": pct(reset_s),
        "verify_before_s": pct(times["before"]),
        "verify_s": pct(times["after"]),
        "verify_after_over_before": round(
            statistics.median(times["after"]) / statistics.median(times["before"]), 3
        ),
        "by_state": {
            s: {
                "verify_before_s": pct(v["before"]),
                "verify_after_s": pct(v["after"]),
                "after_over_before": round(statistics.median(v["after"]) / statistics.median(v["before"]), 3),
            }
            for s, v in by_state.items()
        },
        "bare_docker_run_s": pct(bare_s),
        "bare_pytest_s": pct(bare_inner_s),
        "verify_over_bare_docker_run": round(
            statistics.median(times["after"]) / statistics.median(bare_s), 3
        ),
        "per_package": {
            k: {
                **{kk: pct(vv) for kk, vv in v.items()},
                "after_over_before": round(
                    statistics.median(v["verify_after_s"]) / statistics.median(v["verify_before_s"]), 3
                ),
            }
            for k, v in sorted(per_package.items())
        },
        "docker_server": client.version().get("Version"),
    }
    if oracle_all is not None:
        result["oracle_all"] = oracle_all
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
