"""A private, throw-away Docker engine for tests that freeze or stop one (never the shared engine).

    def test_x(private_engine): ...   # tests/conftest.py makes the session fixture available everywhere

It runs in its own network namespace (`unshare --net`): with `--bridge none` dockerd deletes the
host's `docker0` interface at start-up, which would break the shared engine's networked
containers. Its data, exec root and socket live in a temporary directory; the base image is
copied over with `docker save | docker load` (a few seconds, once per session). Freezing it
(SIGSTOP) is how a hung engine is played: connections are accepted, nothing answers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class PrivateEngine:
    address: str  # unix:///tmp/.../d.sock
    pid: int  # dockerd's pid (unshare execs it in place)
    root: Path

    def client(self, timeout: float = 30.0):
        import docker

        return docker.DockerClient(base_url=self.address, timeout=timeout)

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        self.freeze()
        try:
            yield
        finally:
            self.thaw()

    def containers(self, label: str) -> list:
        return self.client().containers.list(all=True, filters={"label": label})


def _ping(address: str) -> bool:
    import docker

    try:
        return bool(docker.DockerClient(base_url=address, timeout=2).ping())
    except Exception:
        return False


@pytest.fixture(scope="session")
def private_engine() -> Iterator[PrivateEngine]:
    with running_private_engine() as engine:
        yield engine


@contextlib.contextmanager
def running_private_engine() -> Iterator[PrivateEngine]:
    """Start the private engine (also for benchmarks/scale.py); removed with everything in it on exit."""
    from agentrl.sandbox.base import DEFAULT_IMAGE

    if os.geteuid() != 0 or shutil.which("dockerd") is None or shutil.which("unshare") is None:
        pytest.fail(
            "a private Docker engine needs root, dockerd and unshare (run `make setup` as root)",
            pytrace=False,
        )
    # Short path: a unix socket path must fit in 108 bytes.
    root = Path(tempfile.mkdtemp(prefix="agentrl-dockerd-", dir="/tmp"))
    address = f"unix://{root}/d.sock"
    log = open(root / "dockerd.log", "wb")  # noqa: SIM115 (closed in the finally below)
    proc = subprocess.Popen(
        [
            "unshare", "--net", "dockerd",
            "--host", address,
            "--data-root", str(root / "data"),
            "--exec-root", str(root / "exec"),
            "--pidfile", str(root / "dockerd.pid"),
            "--bridge", "none", "--iptables=false", "--ip6tables=false", "--ip-masq=false",
            "--cgroup-parent", f"agentrl-test-{root.name}",
            "--shutdown-timeout", "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    engine = PrivateEngine(address, proc.pid, root)
    try:
        deadline = time.monotonic() + 60
        while not _ping(address):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"the private dockerd did not start: {(root / 'dockerd.log').read_text()[-2000:]}"
                )
            time.sleep(0.2)
        load = subprocess.run(
            f"docker save {DEFAULT_IMAGE} | DOCKER_HOST={address} docker load",
            shell=True,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if load.returncode != 0:
            pytest.fail(f"could not copy {DEFAULT_IMAGE} into the private engine: {load.stderr[-2000:]}")
        yield engine
    finally:
        with contextlib.suppress(ProcessLookupError):
            engine.thaw()
        with contextlib.suppress(Exception):
            for c in engine.client(timeout=10).containers.list(all=True):
                c.remove(force=True)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
        # dockerd unmounts its overlays on a clean exit; anything left busy is left in /tmp.
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class TcpEngine:
    """The private engine reached over TCP on 127.0.0.1 (a remote sandbox host, as seen from here)."""

    address: str  # tcp://127.0.0.1:PORT
    engine: PrivateEngine

    def client(self, timeout: float = 30.0):
        import docker

        return docker.DockerClient(base_url=self.address, timeout=timeout)

    def containers(self, label: str) -> list:
        return self.client().containers.list(all=True, filters={"label": label})


def _relay(listener, unix_path: str, stop) -> None:
    """Accept TCP connections and pipe each, both ways, to the engine's unix socket.

    The engine lives in its own network namespace (see the module docstring), so its own TCP
    listener would not be reachable from the host's 127.0.0.1; this byte relay is what a TCP
    port in front of it looks like (docker's hijacked exec streams pass through unchanged).
    """
    import socket
    import threading

    def pipe(src, dst) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    listener.settimeout(0.5)  # so `stop` is noticed: closing a socket does not wake accept()
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        except OSError:
            return
        upstream = socket.socket(socket.AF_UNIX)
        try:
            upstream.connect(unix_path)
        except OSError:
            conn.close()
            continue
        for a, b in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=pipe, args=(a, b), daemon=True).start()


@pytest.fixture(scope="session")
def tcp_engine(private_engine: PrivateEngine) -> Iterator[TcpEngine]:
    """The private engine listening on TCP 127.0.0.1 (session-wide; plain TCP, no TLS)."""
    with tcp_front(private_engine) as engine:
        yield engine


@contextlib.contextmanager
def tcp_front(private_engine: PrivateEngine) -> Iterator[TcpEngine]:
    """A TCP port on 127.0.0.1 in front of `private_engine` while the block runs."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    stop = threading.Event()
    unix_path = private_engine.address.removeprefix("unix://")
    thread = threading.Thread(target=_relay, args=(listener, unix_path, stop), daemon=True)
    thread.start()
    address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    if not _ping(address):
        pytest.fail(f"the private engine does not answer on {address}")
    try:
        yield TcpEngine(address, private_engine)
    finally:
        stop.set()
        listener.close()
