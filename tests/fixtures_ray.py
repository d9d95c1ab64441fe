"""A throw-away local Ray cluster of two nodes, for tests that place actors by resources.

    def test_x(ray_cluster): ...   # ray_cluster.address, ray_cluster.nodes == ("node_a", "node_b")

Two `ray start --block` processes on this machine: a head with the custom resource `node_a` and a
second node joined to it with `node_b`, so an actor asking for `{"node_b": 1}` can only run on the
second raylet. Each runs in its own session (process group); teardown SIGKILLs both groups and
every process they spawned (Ray's workers leave the group), by pid, never `ray stop` (that would
stop other people's clusters on this shared machine). Session-wide: starting one costs ~15 s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class RayCluster:
    address: str  # 127.0.0.1:PORT, for ray.init(address=...) and cluster.ray_address
    nodes: tuple[str, ...]  # the custom resource that names each node
    root: Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pids: list[int]) -> list[int]:
    """Every live process under `pids` (from /proc), so workers that left the group die too."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    todo = list(pids)
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            found.append(child)
            todo.append(child)
    return found


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    with local_ray_cluster() as cluster:
        yield cluster


@contextlib.contextmanager
def local_ray_cluster(cpus_per_node: int = 2, units: int = 1) -> Iterator[RayCluster]:
    """Start the two-node cluster (also for benchmarks/scale.py); stopped, by pid, on exit.
    `units`: how much of its custom resource each node has (engines that may pin to it at once)."""
    try:
        import ray
    except ImportError as exc:
        pytest.fail(f"ray is not importable ({exc}); run `make setup`", pytrace=False)
    root = Path(tempfile.mkdtemp(prefix="agentrl-ray-", dir="/tmp"))
    port = _free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    common = [
        "--block",
        "--num-cpus",
        "2",
        "--object-store-memory",
        str(150 * 2**20),
        "--disable-usage-stats",
    ]
    procs: list[subprocess.Popen] = []
    logs = []

    def start(name: str, args: list[str]) -> None:
        log = open(root / f"{name}.log", "wb")  # noqa: SIM115 (closed in the finally below)
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [_ray_bin(), "start", *args, *common, "--resources", f'{{"{name}": {units}}}'],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        )

    address = f"127.0.0.1:{port}"
    try:
        start(
            "node_a",
            ["--head", "--port", str(port), "--include-dashboard=false", "--temp-dir", str(root / "t")],
        )
        _wait_nodes(ray, address, 1, procs, root)
        start("node_b", ["--address", address])
        _wait_nodes(ray, address, 2, procs, root)
        yield RayCluster(address, ("node_a", "node_b"), root)
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        doomed = _descendants([p.pid for p in procs])
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in procs:
            p.wait(timeout=30)
        for log in logs:
            log.close()
        subprocess.run(["rm", "-rf", str(root)], check=False)


def _wait_nodes(ray, address: str, n: int, procs: list[subprocess.Popen], root: Path) -> None:
    """Block until `n` nodes are alive (each probe in a subprocess: a driver connects only once)."""
    deadline = time.monotonic() + 90
    probe = (
        "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
        "print(sum(1 for n in ray.nodes() if n['Alive']))"
    )
    while True:
        for p in procs:
            if p.poll() is not None:
                logs = "\n".join(f.read_text()[-1500:] for f in root.glob("*.log"))
                pytest.fail(f"`ray start` exited with {p.returncode}:\n{logs}", pytrace=False)
        out = subprocess.run(
            [sys.executable, "-c", probe, address], capture_output=True, text=True, timeout=60, check=False
        )
        if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(n)]:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the Ray cluster did not reach {n} node(s): {out.stderr[-1500:]}", pytrace=False)
        time.sleep(1)
