"""Sandbox backends and the warm pool: latencies, tool calls with and without the resident executor, capacity.

    .venv/bin/python benchmarks/sandbox.py                 # full run, ~10 minutes on 2 cores
    .venv/bin/python benchmarks/sandbox.py --quick         # smoke run, a few minutes
    .venv/bin/python benchmarks/sandbox.py --sections tool_calls,env_steps --out benchmarks/results/sandbox_executor.json
    .venv/bin/python benchmarks/sandbox.py --sections concurrency --max-concurrent 256

Prints ONE JSON object on stdout (progress goes to stderr; `--out` also writes it to a file).
Latencies are in milliseconds. `--sections` picks what runs (default: all of them).

`tool_calls` and `env_steps` (the resident executor, `agentrl.sandbox.executor`): four ways to
run an agent's command, in the same run, at each of `--concurrency` (default 1 and 64) sandboxes
at once, each sandbox driven by its own thread:
- `docker_exec`: a fresh `docker exec` per call (`SandboxSpec.executor=False`);
- `docker_executor`: through the resident executor (the default);
- `bwrap`: a fresh bwrap per call; `bwrap_executor`: through its resident executor.
`tool_calls` times `exec(["true"])`: latency p50/p99, calls/s, and CPU per call, summed over the
stack that serves it (this process and its children, dockerd and containerd, the containers'
shims and cgroups, the bwrap executors), with the parts and the machine-wide busy time beside
it; the load average before and after each measurement says how busy the box was (dockerd and
the machine-wide figure count other users' work too). `env_steps` runs `agentrl/calc-v0`
episodes' steps (`ToolEnv.step` of a `python` tool call: parse, `python3 -` in the sandbox,
format) and reports steps/s and CPU per step. Where the box is shared, steps/s at high
concurrency is bounded by the CPU the others leave (`machine` minus `stack` says how much they
took); the stack's CPU per step is what a step costs whatever else runs.

For each backend (docker, bwrap, local; one that cannot start is reported with the reason):
- `start_ms`: `open_sandbox()` back to back, nothing else running;
- `close_ms`: `close()` of those;
- `exec_true_ms`, `exec_python_ms`: `exec(["true"])` and a small `python3 -c` on one sandbox;
- `reset_no_pool_ms` / `reset_pool_ms`: an episode loop (reset, one exec, `--episode-s` of
  "agent time", close) where reset is `open_sandbox()` or `SandboxPool.acquire()` from a pool
  warmed before the loop; the pool refills in the background while the episode runs.

Docker only:
- `docker_exec_overhead`: our `DockerSandbox.exec` without the executor (a `docker exec` of
  ours) against a bare docker-SDK `container.exec_run` of the same command on the same
  container, interleaved; ratio of p50s;
- `docker_concurrency` (section `concurrency`): start up to `--max-concurrent` sandboxes (each
  with its resident executor) with small memory limits, check each answers an exec, report how
  many and the memory they use (their cgroups, their containerd-shims' PSS and the engine's
  growth), then close all. `bwrap_concurrency` does the same with bwrap sandboxes.

`turnover` (docker): episodes through a warm pool, back to back and several at once (acquire,
a file, three tool calls, release), with released containers removed and replaced against reset
and reused (`SandboxPool(recycle=...)`): episodes/s and CPU per episode (this process, the engine,
the whole machine), until the pool's background work is done.

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
TARGETS = {
    "pool_reset_p50_ms": 20.0,
    "exec_overhead_ratio_p50": 1.2,
    "concurrent_docker": 64,
    "executor_p50_ms": 5.0,
    "executor_speedup_p50": 10.0,
    "env_steps_speedup": 5.0,
}
SECTIONS = ("backends", "tool_calls", "env_steps", "concurrency", "turnover")
# The four ways an agent's command runs: (backend, through the resident executor?).
MODES = {
    "docker_exec": ("docker", False),
    "docker_executor": ("docker", True),
    "bwrap": ("bwrap", False),
    "bwrap_executor": ("bwrap", True),
}

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


def tracked_open(backend: str, limits: Limits, executor: bool = True) -> Sandbox:
    sandbox = open_sandbox(backend, limits=limits, labels=LABELS, executor=executor)
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
    """Our exec (a docker exec, no executor) vs a bare SDK exec_run of the same argv, same user
    and workdir, interleaved."""
    sandbox = tracked_open("docker", limits, executor=False)
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
    answered, executors = _answering(held)
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
        "answered_through_executor": executors,
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


def _answering(held: list[Sandbox]) -> tuple[int, int]:
    """How many of `held` answer an exec, and how many of those through a resident executor that
    passes its check; all at once (a thread each), as a rollout's sandboxes are used."""

    def one(sandbox: Sandbox) -> tuple[bool, bool]:
        try:
            ok = sandbox.exec(["true"], timeout=60).ok
            executor = getattr(sandbox, "_executor", None)
            through = ok and executor is not None and executor.current is not None
            if through:
                sandbox.check_intact()  # type: ignore[attr-defined]
            return ok, through
        except Exception as exc:
            progress(f"  {sandbox.id}: {type(exc).__name__}: {exc}")
            return False, False

    with ThreadPoolExecutor(max_workers=min(64, max(1, len(held)))) as pool:
        outcomes = list(pool.map(one, held))
    return sum(ok for ok, _ in outcomes), sum(through for _, through in outcomes)


def bench_bwrap_concurrency(max_concurrent: int, memory_mb: int) -> dict:
    """Up to `max_concurrent` bwrap sandboxes at once, each with its resident executor: how many
    start and answer, and the memory of their executors and tmpfs holders (PSS)."""
    limits = Limits(memory_mb=memory_mb, cpus=0.25, pids=64)
    avail_before = _mem_available_mib()
    held: list[Sandbox] = []
    error: str | None = None
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=4) as starter:
        futures = [starter.submit(tracked_open, "bwrap", limits) for _ in range(max_concurrent)]
        for future in futures:
            try:
                held.append(future.result())
            except Exception as exc:
                error = error or f"{type(exc).__name__}: {exc}"
    start_wall_s = time.perf_counter() - t0
    progress(f"  {len(held)} bwrap sandboxes started in {start_wall_s:.1f} s; checking each answers")
    answered, executors = _answering(held)
    time.sleep(1.0)
    pids = []
    for sandbox in held:
        resident = sandbox._residents.current  # type: ignore[attr-defined]
        holder = sandbox._holder  # type: ignore[attr-defined]
        pids += [resident.pid, resident.proc.pid] if resident is not None else []
        pids += [holder.pid, holder.proc.pid] if holder is not None else []
    pss = sum(_pss_mib(pid) for pid in pids)
    avail_after = _mem_available_mib()
    t1 = time.perf_counter()
    for sandbox in held:
        tracked_close(sandbox)
    return {
        "requested": max_concurrent,
        "started": len(held),
        "answered_exec": answered,
        "answered_through_executor": executors,
        "start_wall_s": round(start_wall_s, 2),
        "close_wall_s": round(time.perf_counter() - t1, 2),
        "executor_and_holder_pss_mib_total": round(pss, 1),
        "executor_and_holder_pss_mib_per_sandbox": round(pss / max(1, len(held)), 2),
        "host_mem_available_drop_mib": round(avail_before - avail_after, 1),
        "error": error,
    }


# ---- tool calls and env steps with and without the resident executor --------------------------

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _proc_cpu_s(pid: int) -> float:
    """CPU seconds of `pid` and of its children it has waited for (utime, stime, cutime, cstime)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(b")") + 2 :].split()
    return sum(int(f) for f in fields[11:15]) / CLK_TCK


def _engine_pids() -> list[int]:
    pids = []
    for pid_file in ("/var/run/docker.pid", "/var/run/docker/containerd/containerd.pid"):
        try:
            pids.append(int(Path(pid_file).read_text().strip()))
        except (OSError, ValueError):
            continue
    return pids


def _shim_pids(container_ids: set[str]) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and b"containerd-shim" in argv[0] and b"-id" in argv:
            at = argv.index(b"-id") + 1
            if at < len(argv) and argv[at].decode() in container_ids:
                found.append(int(entry.name))
    return found


def _cpuacct_s(container_id: str) -> float:
    for path in (
        f"/sys/fs/cgroup/cpuacct/docker/{container_id}/cpuacct.usage",
        f"/sys/fs/cgroup/cpu,cpuacct/docker/{container_id}/cpuacct.usage",
        f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope/cpu.stat",
        f"/sys/fs/cgroup/docker/{container_id}/cpu.stat",
    ):
        try:
            text = Path(path).read_text()
        except OSError:
            continue
        if path.endswith("cpu.stat"):
            return int(text.split("usage_usec")[1].split()[0]) / 1e6
        return int(text) / 1e9
    return 0.0


def _machine_busy_s() -> float:
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / CLK_TCK


class CpuMeter:
    """CPU spent serving a set of sandboxes, by part: this process (and the per-call bwraps it
    waited for), the docker engine (dockerd and containerd: shared with anyone else using it),
    the containers' shims (`runc exec` runs under them) and cgroups (what ran inside), the bwrap
    resident executors (with the commands they waited for); and the whole machine's busy time."""

    def __init__(self, sandboxes: list[Sandbox]) -> None:
        self.containers = [s._cid for s in sandboxes if s.backend == "docker"]  # type: ignore[attr-defined]
        self.shims = _shim_pids(set(self.containers))
        self.engine = _engine_pids() if self.containers else []
        self.residents: list[int] = []
        for s in sandboxes:
            resident = getattr(s, "_residents", None)
            if resident is not None and resident.current is not None:
                self.residents += [resident.current.pid, resident.current.proc.pid]

    def snapshot(self) -> dict[str, float]:
        t = os.times()
        return {
            "client": t.user + t.system + t.children_user + t.children_system,
            "engine": sum(_proc_cpu_s(pid) for pid in self.engine),
            "shims": sum(_proc_cpu_s(pid) for pid in self.shims),
            "containers": sum(_cpuacct_s(cid) for cid in self.containers),
            "bwrap_executors": sum(_proc_cpu_s(pid) for pid in self.residents),
            "machine": _machine_busy_s(),
        }

    @staticmethod
    def per_call_ms(before: dict[str, float], after: dict[str, float], calls: int) -> dict[str, float]:
        parts = {k: (after[k] - before[k]) * 1000.0 / max(1, calls) for k in before}
        parts["stack"] = sum(v for k, v in parts.items() if k != "machine")
        return {k: round(v, 3) for k, v in parts.items()}


def bench_turnover(limits: Limits, episodes: int, concurrency: int, calls: int) -> dict:
    """Docker episodes back to back through a warm pool, `concurrency` at a time: acquire, write a
    file, `calls` python tool calls through the executor, release. `replace` closes each released
    container and starts new ones (one container per episode); `recycle` resets it from the host
    and hands it out again. Wall time and CPU run until the pool's background work is done."""
    out: dict = {"episodes": episodes, "concurrency": concurrency, "calls_per_episode": calls}
    for mode, recycle in (("replace", False), ("recycle", True)):
        with SandboxPool(size=4, workers=2, recycle=recycle) as pool:
            pool.prewarm(4, backend="docker", limits=limits, labels=LABELS, timeout_s=300)
            engine = _engine_pids()

            def episode() -> None:
                sandbox = pool.acquire("docker", limits=limits, labels=LABELS)
                sandbox.write_file("task.txt", "1 + 1")
                for _ in range(calls):
                    check_ok(sandbox.exec(PY_CMD), "python3")
                pool.release(sandbox)

            def run(n: int) -> None:
                todo = list(range(n))
                lock = threading.Lock()

                def worker() -> None:
                    while True:
                        with lock:
                            if not todo:
                                return
                            todo.pop()
                        episode()

                threads = [threading.Thread(target=worker) for _ in range(concurrency)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                while (st := pool.stats()).resetting or st.closing or st.starting:
                    time.sleep(0.01)

            run(concurrency)  # warm-up: the pool grows to its working size
            load_before = _load()
            t = os.times()
            before = (t.user + t.system, sum(_proc_cpu_s(p) for p in engine), _machine_busy_s())
            t0 = time.perf_counter()
            run(episodes)
            wall = time.perf_counter() - t0
            t = os.times()
            after = (t.user + t.system, sum(_proc_cpu_s(p) for p in engine), _machine_busy_s())
            stats = pool.stats()
        out[mode] = {
            "episodes_per_s": round(episodes / wall, 2),
            "wall_s": round(wall, 2),
            "cpu_ms_per_episode": {
                "client": round((after[0] - before[0]) * 1000 / episodes, 1),
                "engine": round((after[1] - before[1]) * 1000 / episodes, 1),
                "machine": round((after[2] - before[2]) * 1000 / episodes, 1),
            },
            "containers_started": stats.started,
            "recycled": stats.recycled,
            "load": [load_before, _load()],
        }
        progress(f"turnover {mode}: {out[mode]['episodes_per_s']} episodes/s")
    out["speedup"] = round(out["recycle"]["episodes_per_s"] / out["replace"]["episodes_per_s"], 2)
    out["machine_cpu_ratio"] = round(
        out["replace"]["cpu_ms_per_episode"]["machine"]
        / max(1e-9, out["recycle"]["cpu_ms_per_episode"]["machine"]),
        2,
    )
    return out


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _open_many(backend: str, executor: bool, n: int, limits: Limits) -> list[Sandbox]:
    with ThreadPoolExecutor(max_workers=4) as starter:
        return list(starter.map(lambda _: tracked_open(backend, limits, executor=executor), range(n)))


def _drive(workers: list[Callable[[], float]], calls: int) -> tuple[list[float], float]:
    """Run each worker `calls` times, each in its own thread, all starting together; every
    call's latency (seconds) and the wall time of the whole."""
    barrier = threading.Barrier(len(workers) + 1)
    latencies: list[list[float]] = [[] for _ in workers]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        barrier.wait()
        try:
            for _ in range(calls):
                latencies[i].append(workers[i]())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(workers))]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return [x for per in latencies for x in per], wall


def _timed_exec(sandbox: Sandbox, cmd: list[str]) -> Callable[[], float]:
    def call() -> float:
        t0 = time.perf_counter()
        result = sandbox.exec(cmd)
        dt = time.perf_counter() - t0
        check_ok(result, " ".join(cmd))
        return dt

    return call


def bench_tool_calls(modes: list[str], concurrency: list[int], calls: dict[int, int], limits: Limits) -> dict:
    """`exec(["true"])` in each mode at each concurrency: latency, calls/s, CPU per call."""
    out: dict = {}
    for n in concurrency:
        for mode in modes:
            backend, executor = MODES[mode]
            progress(f"tool calls: {mode}, {n} sandbox(es) x {calls[n]} calls")
            held: list[Sandbox] = []
            try:
                held = _open_many(backend, executor, n, limits)
                if executor and any(s._executor.current is None for s in held):  # type: ignore[attr-defined]
                    raise RuntimeError(f"{mode}: a sandbox started without its resident executor")
                workers = [_timed_exec(s, ["true"]) for s in held]
                _drive(workers, 3)  # warm-up: page cache, the engine's connection pool
                meter = CpuMeter(held)
                load_before = _load()
                before = meter.snapshot()
                latencies, wall = _drive(workers, calls[n])
                after = meter.snapshot()
                out.setdefault(mode, {})[str(n)] = {
                    "latency_ms": summary_ms(latencies),
                    "calls_per_s": round(len(latencies) / wall, 2),
                    "cpu_ms_per_call": CpuMeter.per_call_ms(before, after, len(latencies)),
                    "load_before": load_before,
                    "load_after": _load(),
                }
            except Exception as exc:  # one mode's failure is reported, the others still run
                out.setdefault(mode, {})[str(n)] = {"error": f"{type(exc).__name__}: {exc}"}
                progress(f"  {mode} at {n}: {type(exc).__name__}: {exc}")
            finally:
                for sandbox in held:
                    tracked_close(sandbox)
    return out


ENV_ID = "agentrl/calc-v0"
PYTHON_CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(17 * 23)"}}</tool_call>'


def bench_env_steps(modes: list[str], concurrency: list[int], steps: dict[int, int], limits: Limits) -> dict:
    """`ToolEnv.step` of calc-v0's `python` tool call, `n` environments at once: steps/s."""
    import agentrl

    out: dict = {}
    for n in concurrency:
        for mode in modes:
            backend, executor = MODES[mode]
            progress(f"env steps: {mode}, {n} env(s) x {steps[n]} steps")
            envs = []
            try:
                for _ in range(n):
                    env = agentrl.make(
                        ENV_ID, backend=backend, use_pool=False, max_turns=10**6, limits=limits
                    )
                    # The env's own sandbox, with the executor on or off; started before the clock.
                    env._acquire_sandbox = lambda task, b=backend, e=executor: tracked_open(b, limits, e)
                    envs.append(env)
                with ThreadPoolExecutor(max_workers=4) as starter:
                    list(starter.map(lambda env: env.reset(seed=0), envs))

                def stepper(env, mode: str = mode) -> Callable[[], float]:  # type: ignore[no-untyped-def]
                    def step() -> float:
                        t0 = time.perf_counter()
                        obs, _, _, _, info = env.step(PYTHON_CALL)
                        dt = time.perf_counter() - t0
                        if "391" not in obs[-1]["content"]:
                            raise RuntimeError(
                                f"{mode}: the python tool answered {obs[-1]['content']!r} ({info})"
                            )
                        return dt

                    return step

                workers = [stepper(env) for env in envs]
                _drive(workers, 2)
                meter = CpuMeter([env.sandbox for env in envs])
                load_before = _load()
                before = meter.snapshot()
                latencies, wall = _drive(workers, steps[n])
                after = meter.snapshot()
                out.setdefault(mode, {})[str(n)] = {
                    "step_ms": summary_ms(latencies),
                    "steps_per_s": round(len(latencies) / wall, 2),
                    "cpu_ms_per_step": CpuMeter.per_call_ms(before, after, len(latencies)),
                    "load_before": load_before,
                    "load_after": _load(),
                }
            except Exception as exc:  # one mode's failure is reported, the others still run
                out.setdefault(mode, {})[str(n)] = {"error": f"{type(exc).__name__}: {exc}"}
                progress(f"  {mode} at {n}: {type(exc).__name__}: {exc}")
            finally:
                for env in envs:
                    sandbox = env.sandbox
                    with _open_lock:
                        _open.pop(id(sandbox), None)
                    env.close()
    return out


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


def _target(value: float | None, target: str, met: bool) -> dict:
    return {"value": value, "target": target, "met": met}


def target_report(results: dict) -> dict:
    report = {}
    for name, res in results["backends"].items():
        p50 = res.get("reset_pool_ms", {}).get("p50")
        if p50 is not None:
            report[f"{name}.pool_reset_p50_ms"] = _target(
                p50, f"< {TARGETS['pool_reset_p50_ms']}", p50 < TARGETS["pool_reset_p50_ms"]
            )
    overhead = results.get("docker_exec_overhead") or {}
    if "ratio_p50" in overhead:
        ratio = overhead["ratio_p50"]
        report["docker.exec_overhead_ratio_p50"] = _target(
            ratio, f"< {TARGETS['exec_overhead_ratio_p50']}", ratio < TARGETS["exec_overhead_ratio_p50"]
        )
    concurrency = results.get("docker_concurrency") or {}
    if "answered_exec" in concurrency:
        answered = concurrency["answered_exec"]
        report["docker.concurrent_sandboxes"] = _target(
            answered,
            f">= {TARGETS['concurrent_docker']} (asked for {concurrency['requested']})",
            answered >= TARGETS["concurrent_docker"],
        )
    calls = results.get("tool_calls") or {}
    one = {
        mode: by_n.get("1", {}).get("latency_ms", {}).get("p50")
        for mode, by_n in calls.items()
        if isinstance(by_n, dict)
    }
    if one.get("docker_executor") is not None:
        p50 = one["docker_executor"]
        report["docker.executor_p50_ms"] = _target(
            p50, f"< {TARGETS['executor_p50_ms']} (one sandbox)", p50 < TARGETS["executor_p50_ms"]
        )
    if one.get("docker_executor") and one.get("docker_exec"):
        speedup = round(one["docker_exec"] / one["docker_executor"], 2)
        report["docker.executor_speedup_p50"] = _target(
            speedup,
            f">= {TARGETS['executor_speedup_p50']} (one sandbox)",
            speedup >= TARGETS["executor_speedup_p50"],
        )
    steps = {
        mode: {n: r for n, r in by_n.items() if "steps_per_s" in r}
        for mode, by_n in (results.get("env_steps") or {}).items()
        if isinstance(by_n, dict)
    }
    common = set(steps.get("docker_executor", {})) & set(steps.get("docker_exec", {}))
    if common:
        n = max(common, key=int)
        speedup = round(
            steps["docker_executor"][n]["steps_per_s"] / steps["docker_exec"][n]["steps_per_s"], 2
        )
        report[f"docker.env_steps_speedup_at_{n}"] = _target(
            speedup, f">= {TARGETS['env_steps_speedup']}", speedup >= TARGETS["env_steps_speedup"]
        )
        # The same ratio in CPU per step: what it comes to where the box is not shared.
        cpu_fast = steps["docker_executor"][n].get("cpu_ms_per_step", {}).get("stack")
        cpu_slow = steps["docker_exec"][n].get("cpu_ms_per_step", {}).get("stack")
        if cpu_fast and cpu_slow:
            ratio = round(cpu_slow / cpu_fast, 2)
            report[f"docker.env_step_cpu_ratio_at_{n}"] = _target(
                ratio, f">= {TARGETS['env_steps_speedup']}", ratio >= TARGETS["env_steps_speedup"]
            )
    return report


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}"
    )
    p.add_argument("--backends", default="docker,bwrap,local", help="comma-separated backends to measure")
    p.add_argument("--reps", type=int, default=200, help="exec repetitions (and docker overhead pairs)")
    p.add_argument("--start-reps", type=int, default=20, help="back-to-back starts per backend")
    p.add_argument("--episodes", type=int, default=30, help="episodes per reset loop (with and without pool)")
    p.add_argument("--episode-s", type=float, default=1.0, help="agent time per episode, in seconds")
    p.add_argument("--pool-size", type=int, default=4, help="warm sandboxes the pool keeps")
    p.add_argument("--max-concurrent", type=int, default=64, help="sandboxes to hold at once (concurrency)")
    p.add_argument("--concurrent-memory-mb", type=int, default=64, help="memory limit of each of those, MiB")
    p.add_argument("--modes", default=",".join(MODES), help=f"tool-call modes, of {', '.join(MODES)}")
    p.add_argument("--concurrency", type=_ints, default=[1, 64], help="sandboxes driven at once, e.g. 1,64")
    # 100: a fresh bwrap per call leaves its namespace's init to the host's PID 1 to reap, and an
    # init that reaps late (seconds, on some VMs) lets ~pids of them count against the sandbox's
    # pids limit: a few hundred calls in a row then fail to fork.
    p.add_argument("--calls", type=int, default=100, help="tool calls of the one sandbox")
    p.add_argument("--calls-concurrent", type=int, default=10, help="tool calls of each of many sandboxes")
    p.add_argument("--env-steps", type=int, default=50, help="env steps of the one env")
    p.add_argument("--env-steps-concurrent", type=int, default=5, help="env steps of each of many envs")
    p.add_argument("--turnover-episodes", type=int, default=96, help="docker episodes per turnover mode")
    p.add_argument("--turnover-concurrency", type=int, default=8, help="turnover episodes at once")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--quick", action="store_true", help="tiny budget for a smoke test")
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.start_reps, args.episodes, args.episode_s = 10, 2, 4, 0.3
        args.pool_size, args.max_concurrent = 2, min(args.max_concurrent, 4)
        args.concurrency = [min(n, 4) for n in args.concurrency]
        args.calls, args.calls_concurrent, args.env_steps, args.env_steps_concurrent = 20, 3, 5, 2
        args.turnover_episodes, args.turnover_concurrency = 8, 2
    unknown = sorted(set(args.sections.split(",")) - set(SECTIONS)) + sorted(
        set(args.modes.split(",")) - set(MODES)
    )
    if unknown:
        p.error(
            f"unknown section(s) or mode(s) {unknown}; sections: {', '.join(SECTIONS)}; modes: {', '.join(MODES)}"
        )
    return args


def measure(args: argparse.Namespace, backends: list[str], limits: Limits, results: dict) -> int:
    """Fill `results` section by section; returns the exit code (1 when a measurement failed)."""
    exit_code = 0
    sections = set(args.sections.split(","))
    available: dict[str, bool] = {}
    for backend in backends:
        progress(f"{backend}: probing")
        problem = backend_problem(backend, limits)
        available[backend] = problem is None
        if problem is not None:
            progress(f"{backend}: unavailable ({problem})")
            results["backends"][backend] = {"available": False, "reason": problem}
    for backend in backends if "backends" in sections else []:
        if not available[backend]:
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
    if available.get("docker"):
        results["machine"]["docker_engine"] = docker_client().version().get("Version")
    modes = [m for m in args.modes.split(",") if available.get(MODES[m][0])]
    calls = {n: args.calls if n == 1 else args.calls_concurrent for n in args.concurrency}
    steps = {n: args.env_steps if n == 1 else args.env_steps_concurrent for n in args.concurrency}
    runs: list[tuple[str, Callable[[], object]]] = []
    if "backends" in sections and available.get("docker"):
        runs.append(("docker_exec_overhead", lambda: bench_exec_overhead(limits, args.reps)))
    if "tool_calls" in sections and modes:
        runs.append(("tool_calls", lambda: bench_tool_calls(modes, args.concurrency, calls, limits)))
    if "env_steps" in sections and modes:
        runs.append(("env_steps", lambda: bench_env_steps(modes, args.concurrency, steps, limits)))
    if "concurrency" in sections and available.get("docker"):
        runs.append(
            ("docker_concurrency", lambda: bench_concurrency(args.max_concurrent, args.concurrent_memory_mb))
        )
    if "concurrency" in sections and available.get("bwrap"):
        runs.append(
            (
                "bwrap_concurrency",
                lambda: bench_bwrap_concurrency(args.max_concurrent, args.concurrent_memory_mb),
            )
        )
    if "turnover" in sections and available.get("docker"):
        runs.append(
            (
                "turnover",
                lambda: bench_turnover(limits, args.turnover_episodes, args.turnover_concurrency, 3),
            )
        )
    for name, run in runs:
        progress(f"{name}")
        try:
            results[name] = run()
        except Exception as exc:
            exit_code = 1
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            progress(f"{name}: failed\n{traceback.format_exc()}")
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
            "load_at_start": _load(),
        },
        "config": {
            "image": DEFAULT_IMAGE,
            "limits": limits.model_dump(),
            **{k: getattr(args, k) for k in ("reps", "start_reps", "episodes", "episode_s", "pool_size")},
            "max_concurrent": args.max_concurrent,
            "sections": args.sections.split(","),
            "modes": args.modes.split(","),
            "concurrency": args.concurrency,
            **{
                k: getattr(args, k)
                for k in ("calls", "calls_concurrent", "env_steps", "env_steps_concurrent")
            },
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
    results["machine"]["load_at_end"] = _load()
    results["targets"] = target_report(results)
    text = json.dumps(results, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
