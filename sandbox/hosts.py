"""Several Docker engines as one sandbox supply: a warm pool per host, least-loaded placement.

    hosts = HostPool(["unix:///var/run/docker.sock", "tcp://node2:2376",
                      {"url": "tcp://node3:2376", "cert_path": "/etc/agentrl/tls/node3"}], size=4)
    sb = hosts.acquire(image="agentrl/base:bookworm")   # on whichever engine holds fewest now
    ...; sb.close()
    hosts.close()

What a user of one machine's `SandboxPool` gets, per engine: each host has its own `SandboxPool`
(warm sandboxes, background refills, back-off), so a slow or dead engine only holds up its own
refills. `acquire` places each sandbox on the host with the fewest sandboxes out (handed out and
not closed, plus acquires in flight), ties going to the host used least so far; a host whose
acquire fails is skipped for that call and the next one is tried, so one engine going down does
not stop the run while another answers.

Every container carries the reaper's owner labels (run id, the driver's host name, pid, boot id)
plus `agentrl.engine`, the address it was created through. The driver's exit handlers remove
each container through the engine that holds it; after a SIGKILL, the next `HostPool` made on
the driver's machine reaps every host in the background, and `agentrl sandbox reap --host URL`
(or `--run RUN_ID` from any machine) does it by hand.

TLS: a host given as a mapping with `cert_path` (the docker CLI's layout: ca.pem, cert.pem,
key.pem) is reached over TLS with the server's certificate checked (`tls_verify: false` skips the
check); the docker SDK builds its TLSConfig from them. A bare `tcp://` address uses
DOCKER_TLS_VERIFY / DOCKER_CERT_PATH from the environment, as the docker CLI does. `ssh://`
addresses go through the SDK's ssh transport (needs paramiko or the ssh client).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Unpack

from agentrl.sandbox.base import Sandbox, SandboxError, SandboxSpec, SpecFields
from agentrl.sandbox.pool import PoolKey, SandboxPool
from agentrl.sandbox.settings import DockerHost, current


@dataclass(frozen=True)
class HostPoolKey(PoolKey):
    """A `PoolKey` bound to one engine: its sandboxes start there."""

    docker_host: str = ""

    def open(self) -> Sandbox:
        from agentrl.sandbox.docker import DockerSandbox

        return DockerSandbox(self.spec, docker_host=self.docker_host)

    def describe(self) -> str:
        return f"{super().describe()} on {self.docker_host}"


class HostPool:
    """Docker sandboxes spread over several engines; thread-safe, like `SandboxPool`."""

    def __init__(
        self,
        hosts: Iterable[str | Mapping[str, Any] | DockerHost],
        *,
        size: int = 4,
        workers: int = 2,
        recycle: bool = True,
        reap_on_start: bool = True,
    ) -> None:
        """
        hosts: the engines (at least one; duplicates are an error).
        size, workers, recycle: each host's `SandboxPool` settings (warm sandboxes per
            configuration, background starts at once, reuse of released sandboxes).
        reap_on_start: reap every host in the background now, for runs of this machine that
            died by SIGKILL (the start-up reap of one engine, done for each).
        """
        from agentrl.sandbox.engine import register_tls

        self.hosts = [DockerHost.parse(h) for h in hosts]
        if not self.hosts:
            raise ValueError(
                "sandbox.docker_hosts is empty; name at least one engine, e.g. unix:///var/run/docker.sock"
            )
        urls = [h.url for h in self.hosts]
        if len(set(urls)) != len(urls):
            raise ValueError(f"sandbox.docker_hosts names an engine twice: {urls}")
        for h in self.hosts:
            if h.cert_path is not None:
                register_tls(h.url, h.cert_path, h.tls_verify)
        self._pools = {h.url: SandboxPool(size=size, workers=workers, recycle=recycle) for h in self.hosts}
        self._lock = threading.Lock()
        self._out: dict[str, weakref.WeakSet[Sandbox]] = {h.url: weakref.WeakSet() for h in self.hosts}
        self._pending = dict.fromkeys(urls, 0)
        self._placed = dict.fromkeys(urls, 0)
        if reap_on_start:
            from agentrl.sandbox.reaper import reap

            for url in urls:

                def run(url: str = url) -> None:
                    with contextlib.suppress(Exception):  # best effort, like the one-engine start-up reap
                        reap(host=url)

                threading.Thread(target=run, name="agentrl-host-reaper", daemon=True).start()

    # --- placement -------------------------------------------------------------------------

    def load(self) -> dict[str, int]:
        """Sandboxes out per host now: handed out and not closed, plus acquires in flight."""
        with self._lock:
            return {url: self._load_locked(url) for url in self._pools}

    def placed(self) -> dict[str, int]:
        """Sandboxes handed out per host since the pool was made."""
        with self._lock:
            return dict(self._placed)

    def _load_locked(self, url: str) -> int:
        return self._pending[url] + sum(1 for sb in list(self._out[url]) if not getattr(sb, "_closed", False))

    def _order_locked(self) -> list[str]:
        # Fewest out first; ties to the host used least so far, then config order.
        index = {url: i for i, url in enumerate(self._pools)}
        return sorted(self._pools, key=lambda u: (self._load_locked(u), self._placed[u], index[u]))

    def acquire(self, spec: SandboxSpec | None = None, **fields: Unpack[SpecFields]) -> Sandbox:
        """A started docker sandbox on the least-loaded host; the caller releases (or closes) it.

        A host whose acquire raises is skipped and the next is tried; when all fail, the last
        error is raised with every host's reason in its message.
        """
        spec = SandboxSpec.of(spec, **fields)
        with self._lock:
            order = self._order_locked()
            first = order[0]
            self._pending[first] += 1
        errors: list[str] = []
        last: BaseException | None = None
        for i, url in enumerate(order):
            if i > 0:
                with self._lock:
                    self._pending[url] += 1
            try:
                sandbox = self._pools[url].acquire_key(HostPoolKey("docker", spec, docker_host=url))
            except SandboxError as exc:
                errors.append(f"{url}: {exc}")
                last = exc
                continue
            finally:
                with self._lock:
                    self._pending[url] -= 1
            with self._lock:
                self._out[url].add(sandbox)
                self._placed[url] += 1
            return sandbox
        raise SandboxError(
            f"no docker host could start a sandbox ({'; '.join(errors)}); check each with "
            "`DOCKER_HOST=URL docker info`"
        ) from last

    def release(self, sandbox: Sandbox) -> None:
        """`SandboxPool.release` on the host the sandbox came from (reset and kept warm there, or closed)."""
        with self._lock:
            url = next((u for u, out in self._out.items() if sandbox in out), None)
            if url is not None:
                self._out[url].discard(sandbox)
        if url is None:
            sandbox.close()
        else:
            self._pools[url].release(sandbox)

    def prewarm(
        self,
        n: int | None = None,
        *,
        wait: bool = True,
        timeout_s: float | None = None,
        spec: SandboxSpec | None = None,
        **fields: Unpack[SpecFields],
    ) -> dict[str, int]:
        """Keep `n` warm sandboxes of this configuration on every host (all start at once);
        returns how many are warm per host."""
        spec = SandboxSpec.of(spec, **fields)
        keys = {url: HostPoolKey("docker", spec, docker_host=url) for url in self._pools}
        for url, pool in self._pools.items():
            pool.prewarm_key(keys[url], n, wait=False)
        return {
            url: pool.prewarm_key(keys[url], n, wait=wait, timeout_s=timeout_s)
            for url, pool in self._pools.items()
        }

    def stats(self) -> dict[str, Any]:
        """Per host: its `SandboxPool.stats()`, sandboxes out now and placed so far."""
        load, placed = self.load(), self.placed()
        return {
            url: {"out": load[url], "placed": placed[url], "pool": pool.stats()}
            for url, pool in self._pools.items()
        }

    def close(self) -> None:
        """Destroy every warm sandbox on every host (handed-out ones are their callers')."""
        for pool in self._pools.values():
            pool.close()

    @property
    def closed(self) -> bool:
        return all(p.closed for p in self._pools.values())

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- the process-wide host pool (what ToolEnv uses when hosts are configured) -----------------

_default: HostPool | None = None
_default_hosts: tuple[DockerHost, ...] = ()
_default_lock = threading.Lock()


def default_host_pool() -> HostPool | None:
    """The process-wide `HostPool` of the sandbox settings' `docker_hosts`, or None when they name
    none (one engine: the plain pool). The settings are `agentrl.sandbox.settings.current()`: what
    `agentrl train` configured from its `sandbox:` section, else AGENTRL_DOCKER_HOSTS. When the
    hosts change, the old pool's warm sandboxes are closed."""
    global _default, _default_hosts
    settings = current()
    hosts = tuple(DockerHost.parse(h) for h in settings.docker_hosts)
    with _default_lock:
        if hosts != _default_hosts and _default is not None:
            _default.close()
            _default = None
        _default_hosts = hosts
        if not hosts:
            return None
        if _default is None or _default.closed:
            _default = HostPool(
                hosts, size=settings.pool_size, workers=settings.pool_workers, recycle=settings.pool_recycle
            )
        return _default
