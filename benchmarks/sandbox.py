"""Sandbox backends and the warm pool: latencies, docker exec overhead, concurrent capacity.

    .venv/bin/python benchmarks/sandbox.py                 # full run, ~3-5 minutes on 2 cores
    .venv/bin/python benchmarks/sandbox.py --quick         # smoke run, well under a minute
    .venv/bin/python benchmarks/sandbox.py --backends local,bwrap --reps 100

Prints ONE JSON object on stdout (progress goes to stderr). Latencies are in milliseconds.

For each backend (docker, bwrap, local; one that cannot start is reported with the reason):
- `start_ms`: `open_sandbox()` back to back, nothing else running;
- `close_ms`: `close()` of those;
- `exec_true_ms`, `exec_python_ms`: `exec(["true"])` and a small `python3 -c` on one sandbox;
- `reset_no_pool_ms` / `reset_pool_ms`: an episode loop (reset, one exec, `--episode-s` of
  "agent time", close) where reset is `open_sandbox()` or `SandboxPool.acquire()` from a pool
  warmed before the loop; the pool refills in the background while the episode runs.

Docker only:
- `docker_exec_overhead`: our `DockerSandbox.exec` against a bare docker-SDK
  `container.exec_run` of the same command on the same container, interleaved; ratio of p50s;
- `docker_concurrency`: start up to `--max-concurrent` sandboxes with small memory limits,
  check each answers an exec, report how many and the memory they use (their cgroups, their
  containerd-shims' PSS and the engine's growth), then close all.

Every sandbox carries a label unique to this run; on exit (normal, exception, Ctrl-C or
SIGTERM) every container with that label is removed, so nothing is left behind.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from agentrl.sandbox import DEFAULT_IMAGE, Limits, Sandbox, open_sandbox
from agentrl.sandbox.base import AGENT_UID
from agentrl.sandbox.pool import SandboxPool, percentile

BENCH_LABEL = "agentrl.bench"
RUN_TAG = uuid.uuid4().hex[:12]
LABELS = {BENCH_LABEL: RUN_TAG}
PY_CMD = ["python3", "-c", "print(sum(range(1000)))"]
TARGETS = {"pool_reset_p50_ms": 20.0, "exec_overhead_ratio_p50": 1.2, "concurrent_docker": 64}

# Every sandbox this process opened and has not closed: the Ctrl-C safety net closes them.
_open: dict[int, Sandbox] = {}
_open_lock = threading.Lock()


def progress(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def summary_ms(samples_s: list[float]) -> dict:
    """p50/p99/mean/min/max of latencies given in seconds, reported in milliseconds."""
    if not samples_s:
        return {"n": 0}
    ms = [s * 1000.0 for s in samples_s]
    return {
        "n": len(ms),
        "p50": round(percentile(ms, 50), 3),
        "p99": round(percentile(ms, 99), 3),
        "mean": round(statistics.fmean(ms), 3),
        "min": round(min(ms), 3),
        "max": round(max(ms), 3),
    }


def tracked_open(backend: str, limits: Limits) -> Sandbox:
    sandbox = open_sandbox(backend, limits=limits, labels=LABELS)
    with _open_lock:
        _open[id(sandbox)] = sandbox
    return sandbox


def tracked_close(sandbox: Sandbox) -> None:
    with _open_lock:
        _open.pop(id(sandbox), None)
    sandbox.close()


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


def check_ok(result: object, what: str) -> None:
    if not getattr(result, "ok", False):
        raise RuntimeError(f"{what} failed inside the sandbox: {result!r}")


# ---- per-backend measurements ---------------------------------------------------------------


def bench_start_close(backend: str, limits: Limits, reps: int) -> dict:
    starts, closes = [], []
    for _ in range(reps):
        dt, sandbox = timed(lambda: tracked_open(backend, limits))
        starts.append(dt)
        check_ok(sandbox.exec(["true"]), "true")  # type: ignore[attr-defined]
        closes.append(timed(lambda s=sandbox: tracked_close(s))[0])
    return {"start_ms": summary_ms(starts), "close_ms": summary_ms(closes)}


def bench_exec(backend: str, limits: Limits, reps: int) -> dict:
    sandbox = tracked_open(backend, limits)
    try:
        for _ in range(3):  # warm-up: first exec pays page-cache and interpreter loading
            sandbox.exec(["true"])
            sandbox.exec(PY_CMD)
        true_s, py_s = [], []
        for _ in range(reps):
            dt, result = timed(lambda: sandbox.exec(["true"]))
            check_ok(result, "true")
            true_s.append(dt)
            dt, result = timed(lambda: sandbox.exec(PY_CMD))
            check_ok(result, "python3 -c")
            py_s.append(dt)
        return {"exec_true_ms": summary_ms(true_s), "exec_python_ms": summary_ms(py_s)}
    finally:
        tracked_close(sandbox)


def bench_reset(backend: str, limits: Limits, episodes: int, episode_s: float, pool_size: int) -> dict:
    """Episodes of: reset, one exec, `episode_s` of agent time, close. Without and with a pool."""
    cold = []
    for _ in range(episodes):
        dt, sandbox = timed(lambda: tracked_open(backend, limits))
        cold.append(dt)
        check_ok(sandbox.exec(["true"]), "true")  # type: ignore[attr-defined]
        time.sleep(episode_s)
        tracked_close(sandbox)  # type: ignore[arg-type]

    pooled, warm_at_acquire = [], []
    with SandboxPool(size=pool_size, workers=2) as pool:
        t0 = time.perf_counter()
        pool.prewarm(pool_size, backend=backend, limits=limits, labels=LABELS, timeout_s=300)
        prewarm_s = time.perf_counter() - t0
        for _ in range(episodes):
            warm_at_acquire.append(pool.warm_count())
            dt, sandbox = timed(lambda: pool.acquire(backend, limits=limits, labels=LABELS))
            with _open_lock:
                _open[id(sandbox)] = sandbox  # type: ignore[index]
            pooled.append(dt)
            check_ok(sandbox.exec(["true"]), "true")  # type: ignore[attr-defined]
            time.sleep(episode_s)
            tracked_close(sandbox)  # type: ignore[arg-type]
        stats = pool.stats()
    return {
        "reset_no_pool_ms": summary_ms(cold),
        "reset_pool_ms": summary_ms(pooled),
        "pool": {
            "size": pool_size,
            "episode_s": episode_s,
            "prewarm_s": round(prewarm_s, 3),
            "hits": stats.hits,
            "misses": stats.misses,
            "hit_rate": round(stats.hits / max(1, stats.hits + stats.misses), 3),
            "min_warm_at_acquire": min(warm_at_acquire, default=0),
            "background_start_p50_ms": round((stats.start_latency_p50_s or 0) * 1000, 3),
            "discarded_dead": stats.discarded_dead,
            "start_failures": stats.start_failures,
        },
    }


# ---- docker only ------------------------------------------------------------------------------


def docker_client():  # the docker SDK is imported only when docker is measured
    import docker

    return docker.from_env()


def bench_exec_overhead(limits: Limits, reps: int) -> dict:
    """Our exec vs a bare SDK exec_run of the same argv, same user and workdir, interleaved."""
    sandbox = tracked_open("docker", limits)
    try:
        container = docker_client().containers.get(sandbox.id)
        user = f"{AGENT_UID}:{AGENT_UID}"  # the agent, whom our exec runs as by default

        def ours() -> None:
            check_ok(sandbox.exec(["true"]), "true")

        def bare() -> None:
            exit_code, _ = container.exec_run(["true"], user=user, workdir=sandbox.workdir, demux=True)
            if exit_code != 0:
                raise RuntimeError(f"bare exec_run of `true` exited {exit_code}")

        for _ in range(5):
            ours()
            bare()
        ours_s, bare_s, pair_ratios = [], [], []
        for i in range(reps):
            # Alternate the order so neither side always runs right after the other's I/O.
            first, second = (ours, bare) if i % 2 == 0 else (bare, ours)
            a = timed(first)[0]
            b = timed(second)[0]
            o, r = (a, b) if i % 2 == 0 else (b, a)
            ours_s.append(o)
            bare_s.append(r)
            pair_ratios.append(o / r)
        ratio = statistics.median(ours_s) / statistics.median(bare_s)
        return {
            "command": ["true"],
            "reps": reps,
            "ours_ms": summary_ms(ours_s),
            "bare_exec_run_ms": summary_ms(bare_s),
            "ratio_p50": round(ratio, 3),
            "paired_ratio_median": round(statistics.median(pair_ratios), 3),
        }
    finally:
        tracked_close(sandbox)


def _mem_available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def _container_memory_mib(container_id: str) -> float | None:
    """The container's cgroup memory usage, for cgroup v1 (cgroupfs or systemd) and v2."""
    candidates = [
        f"/sys/fs/cgroup/memory/docker/{container_id}/memory.usage_in_bytes",
        f"/sys/fs/cgroup/memory/system.slice/docker-{container_id}.scope/memory.usage_in_bytes",
        f"/sys/fs/cgroup/docker/{container_id}/memory.current",
        f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope/memory.current",
    ]
    for path in candidates:
        try:
            return int(Path(path).read_text()) / (1024.0 * 1024.0)
        except (OSError, ValueError):
            continue
    return None


def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def _engine_rss_mib() -> float:
    """Resident memory of dockerd and its containerd: what the engine pays per container."""
    total = 0.0
    for pid_file in ("/var/run/docker.pid", "/var/run/docker/containerd/containerd.pid"):
        try:
            total += _rss_mib(int(Path(pid_file).read_text().strip()))
        except (OSError, ValueError):
            continue
    return total


def _pss_mib(pid: int) -> float:
    """Proportional set size: shared pages (the shim binary, libc) split among their users,
    so summing it over many processes does not count the same page many times, as RSS would."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return _rss_mib(pid)


def _shim_pss_mib(container_ids: set[str]) -> float:
    """Memory of the per-container `containerd-shim` processes of these containers (PSS)."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not argv or b"containerd-shim" not in argv[0] or b"-id" not in argv:
            continue
        cid = argv[argv.index(b"-id") + 1].decode() if argv.index(b"-id") + 1 < len(argv) else ""
        if cid in container_ids:
            total += _pss_mib(int(entry.name))
    return total


def bench_concurrency(max_concurrent: int, memory_mb: int) -> dict:
    limits = Limits(memory_mb=memory_mb, cpus=0.25, pids=64)
    client = docker_client()
    avail_before = _mem_available_mib()
    engine_before = _engine_rss_mib()
    held: list[Sandbox] = []
    error: str | None = None
    t0 = time.perf_counter()
    # A few starts at once: the engine does most of the work, and 2 cores are all there is.
    starter = ThreadPoolExecutor(max_workers=4)
    try:
        futures = [starter.submit(tracked_open, "docker", limits) for _ in range(max_concurrent)]
        for future in futures:
            try:
                held.append(future.result())
            except Exception as exc:
                error = error or f"{type(exc).__name__}: {exc}"
    finally:
        # On Ctrl-C: queued starts never begin; running ones finish and are closed on the way out.
        starter.shutdown(wait=True, cancel_futures=True)
    start_wall_s = time.perf_counter() - t0
    progress(f"  {len(held)} docker sandboxes started in {start_wall_s:.1f} s; checking each answers")
    answered = 0
    for sandbox in held:
        try:
            if sandbox.exec(["true"], timeout=30).ok:
                answered += 1
        except Exception as exc:
            error = error or f"{type(exc).__name__}: {exc}"
    time.sleep(1.0)  # let the page cache and shims settle before reading memory
    avail_after = _mem_available_mib()
    engine_growth = _engine_rss_mib() - engine_before
    full_ids = {client.containers.get(sandbox.id).id for sandbox in held}
    per_container = [mib for cid in full_ids if (mib := _container_memory_mib(cid)) is not None]
    shims = _shim_pss_mib(full_ids)
    cgroups = sum(per_container)
    t1 = time.perf_counter()
    for sandbox in held:
        tracked_close(sandbox)
    close_wall_s = time.perf_counter() - t1
    return {
        "requested": max_concurrent,
        "started": len(held),
        "answered_exec": answered,
        "memory_limit_mb_each": memory_mb,
        "start_wall_s": round(start_wall_s, 2),
        "close_wall_s": round(close_wall_s, 2),
        # What the sandboxes cost: their cgroups (the processes inside, page cache included),
        # one containerd-shim each, and the engine's own growth.
        "mem_used_mib": round(cgroups + shims + engine_growth, 1),
        "mem_used_mib_per_sandbox": round((cgroups + shims + engine_growth) / max(1, len(held)), 2),
        "cgroup_mem_mib_total": round(cgroups, 1),
        "shim_pss_mib_total": round(shims, 1),
        "engine_rss_growth_mib": round(engine_growth, 1),
        # Machine-wide, so other work on a shared machine shows up in it too.
        "host_mem_available_drop_mib": round(avail_before - avail_after, 1),
        "host_mem_available_mib_after": round(avail_after, 1),
        "error": error,
    }


# ---- driver -----------------------------------------------------------------------------------


def remove_labelled_containers() -> int:
    """Remove every container this run labelled; the last line of defence against leaks."""
    try:
        client = docker_client()
        containers = client.containers.list(all=True, filters={"label": f"{BENCH_LABEL}={RUN_TAG}"})
    except Exception:
        return 0
    for container in containers:
        try:
            container.remove(force=True)
        except Exception as exc:
            progress(f"could not remove container {container.name}: {exc}")
    return len(containers)


@contextmanager
def nothing_left_behind() -> Iterator[None]:
    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        with _open_lock:
            leftovers = list(_open.values())
            _open.clear()
        for sandbox in leftovers:
            try:
                sandbox.close()
            except Exception as exc:
                progress(f"closing {sandbox.id} failed: {exc}")
        removed = remove_labelled_containers()
        if removed:
            progress(f"removed {removed} leftover container(s) labelled {BENCH_LABEL}={RUN_TAG}")


def backend_problem(backend: str, limits: Limits) -> str | None:
    """Why `backend` cannot run here (None when a sandbox opens and answers an exec)."""
    try:
        sandbox = tracked_open(backend, limits)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    try:
        result = sandbox.exec(["true"])
        return None if result.ok else f"`true` failed inside a fresh sandbox: {result!r}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        tracked_close(sandbox)


def target_report(results: dict) -> dict:
    report = {}
    for name, res in results["backends"].items():
        p50 = res.get("reset_pool_ms", {}).get("p50")
        if p50 is not None:
            report[f"{name}.pool_reset_p50_ms"] = {
                "value": p50,
                "target": f"< {TARGETS['pool_reset_p50_ms']}",
                "met": p50 < TARGETS["pool_reset_p50_ms"],
            }
    overhead = results.get("docker_exec_overhead") or {}
    if "ratio_p50" in overhead:
        report["docker.exec_overhead_ratio_p50"] = {
            "value": overhead["ratio_p50"],
            "target": f"< {TARGETS['exec_overhead_ratio_p50']}",
            "met": overhead["ratio_p50"] < TARGETS["exec_overhead_ratio_p50"],
        }
    concurrency = results.get("docker_concurrency") or {}
    if "answered_exec" in concurrency:
        report["docker.concurrent_sandboxes"] = {
            "value": concurrency["answered_exec"],
            "target": f">= {TARGETS['concurrent_docker']} (asked for {concurrency['requested']})",
            "met": concurrency["answered_exec"] >= TARGETS["concurrent_docker"],
        }
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="docker,bwrap,local", help="comma-separated backends to measure")
    p.add_argument("--reps", type=int, default=200, help="exec repetitions (and docker overhead pairs)")
    p.add_argument("--start-reps", type=int, default=20, help="back-to-back starts per backend")
    p.add_argument("--episodes", type=int, default=30, help="episodes per reset loop (with and without pool)")
    p.add_argument("--episode-s", type=float, default=1.0, help="agent time per episode, in seconds")
    p.add_argument("--pool-size", type=int, default=4, help="warm sandboxes the pool keeps")
    p.add_argument("--max-concurrent", type=int, default=64, help="docker sandboxes to hold at once")
    p.add_argument("--concurrent-memory-mb", type=int, default=64, help="memory limit of each of those, MiB")
    p.add_argument("--quick", action="store_true", help="tiny budget for a smoke test")
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.start_reps, args.episodes, args.episode_s = 10, 2, 4, 0.3
        args.pool_size, args.max_concurrent = 2, min(args.max_concurrent, 4)
    return args


def measure(args: argparse.Namespace, backends: list[str], limits: Limits, results: dict) -> int:
    """Fill `results` backend by backend; returns the exit code (1 when a measurement failed)."""
    exit_code = 0
    for backend in backends:
        progress(f"{backend}: probing")
        problem = backend_problem(backend, limits)
        if problem is not None:
            progress(f"{backend}: unavailable ({problem})")
            results["backends"][backend] = {"available": False, "reason": problem}
            continue
        res: dict = {"available": True}
        try:
            progress(f"{backend}: {args.start_reps} starts")
            res.update(bench_start_close(backend, limits, args.start_reps))
            progress(f"{backend}: {args.reps} execs of each command")
            res.update(bench_exec(backend, limits, args.reps))
            progress(f"{backend}: {args.episodes} episodes without and with the pool")
            res.update(bench_reset(backend, limits, args.episodes, args.episode_s, args.pool_size))
        except Exception as exc:
            exit_code = 1
            res["error"] = f"{type(exc).__name__}: {exc}"
            progress(f"{backend}: failed\n{traceback.format_exc()}")
        results["backends"][backend] = res
    if results["backends"].get("docker", {}).get("available"):
        results["machine"]["docker_engine"] = docker_client().version().get("Version")
        try:
            progress(f"docker: exec overhead, {args.reps} interleaved pairs")
            results["docker_exec_overhead"] = bench_exec_overhead(limits, args.reps)
            progress(f"docker: up to {args.max_concurrent} concurrent sandboxes")
            results["docker_concurrency"] = bench_concurrency(args.max_concurrent, args.concurrent_memory_mb)
        except Exception as exc:
            exit_code = 1
            results["docker_error"] = f"{type(exc).__name__}: {exc}"
            progress(f"docker: failed\n{traceback.format_exc()}")
    return exit_code


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    limits = Limits(memory_mb=512, cpus=1.0, pids=128)
    results: dict = {
        "benchmark": "sandbox",
        "run_tag": RUN_TAG,
        "machine": {
            "cpus": os.cpu_count(),
            "mem_total_mib": round(
                int(Path("/proc/meminfo").read_text().split()[1]) / 1024.0,
                1,
            ),
            "python": platform.python_version(),
            "kernel": platform.release(),
        },
        "config": {
            "image": DEFAULT_IMAGE,
            "limits": limits.model_dump(),
            **{k: getattr(args, k) for k in ("reps", "start_reps", "episodes", "episode_s", "pool_size")},
            "max_concurrent": args.max_concurrent,
            "quick": args.quick,
        },
        "backends": {},
    }
    try:
        with nothing_left_behind():
            exit_code = measure(args, backends, limits, results)
    except KeyboardInterrupt:
        # Ctrl-C (or SIGTERM): the sandboxes are gone by now; print what was measured so far.
        progress("interrupted; every sandbox of this run was closed")
        results["interrupted"] = True
        exit_code = 130
    results["targets"] = target_report(results)
    print(json.dumps(results, indent=2))
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
