"""The Docker engine as the docker backend sees it: one client per engine, bounded calls, a health check.

Three things a long run needs from the engine and the docker SDK does not give:

- **Bounded concurrency of container life-cycle calls.** Under many concurrent creates and
  removes, Docker 20.10 (Debian's) can deadlock in libnetwork: every later start then hangs. A
  process-wide gate per engine lets at most `docker_max_lifecycle_calls` (default 4; `SandboxSettings`)
  create/start/remove calls run at once; the rest queue. Execs are not gated: they touch no
  network state and are the hot path.
- **Timeouts that say what happened.** Every API call has a deadline (`docker_timeout_s`,
  default 60 s, the SDK's own default). When one passes, or the engine refuses the connection, a
  health check (`/_ping`, with a short timeout) decides what to tell the user: the engine stopped
  answering (restart it), or it answers pings but not this call (overloaded or deadlocked). Either
  way the caller gets `EngineUnavailable`, a `SandboxDead`, so the episode ends with `env_error`
  and that reason, never with a raw urllib3 `ReadTimeout`.
- **A fast failure once the engine is known to be down.** After a failed health check, life-cycle
  calls fail at once (no new 60 s wait per episode) until a fresh ping, at most every
  `_PROBE_INTERVAL_S`, finds the engine back.

Clients are keyed by (process, engine address, timeout): a forked child gets its own sockets, and
a sandbox keeps the client of the engine it was created on.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from agentrl.sandbox.base import EngineUnavailable, SandboxError

# The health check must answer fast: a live engine answers /_ping in milliseconds even under load.
_PING_TIMEOUT_S = 5.0
# Once the engine failed a health check, how often a life-cycle call may probe it again.
_PROBE_INTERVAL_S = 2.0
ENGINE_DOWN = "the Docker engine stopped answering: restart it"


def engine_address() -> str:
    """The engine this process talks to by default: `DOCKER_HOST`, else the local socket."""
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def is_engine_failure(exc: BaseException) -> bool:
    """Whether `exc` says the engine did not answer (timeout, refused or reset connection)."""
    import requests

    return isinstance(exc, requests.exceptions.ConnectionError | requests.exceptions.Timeout)


@dataclass(frozen=True)
class GateStats:
    """Counters of one engine's gate, for tests and `agentrl sandbox doctor`."""

    limit: int
    """Life-cycle calls allowed in flight at once."""
    in_flight: int
    """Life-cycle calls running now."""
    max_in_flight: int
    """The most that ever ran at once."""
    calls: int
    """Life-cycle calls run."""
    fast_failures: int
    """Calls refused at once because the engine was known to be down."""


class Engine:
    """One Docker engine: its SDK client, the gate on life-cycle calls, and its health."""

    def __init__(self, address: str, timeout_s: float, limit: int) -> None:
        import docker

        self.address = address
        self.timeout_s = timeout_s
        # from_env, not DockerClient(base_url=...): it also reads DOCKER_TLS_VERIFY / DOCKER_CERT_PATH,
        # which a remote host's own TLS settings (`register_tls`) override for its address only.
        self._environment = engine_environment(address)
        try:
            # Sized for many sandboxes exec'ing at once from rollout threads.
            self.client = docker.from_env(timeout=timeout_s, max_pool_size=32, environment=self._environment)
        except docker.errors.DockerException as exc:
            if "timed out" in str(exc).lower():  # the socket is there, the engine behind it is not
                raise EngineUnavailable(
                    f"{ENGINE_DOWN} (no answer to /version within {timeout_s:g}s; engine {address}). Check it "
                    "with `docker info`; if it hangs, restart it"
                ) from exc
            raise SandboxError(
                f"cannot reach the Docker engine at {address} ({exc}). Start it (`make setup`, or `dockerd &` "
                "as root) or use the daemonless backend: open_sandbox('bwrap')."
            ) from exc
        self.limit = limit
        self._slots = threading.BoundedSemaphore(limit)
        self._lock = threading.Lock()
        self._in_flight = 0
        self._max_in_flight = 0
        self._calls = 0
        self._fast_failures = 0
        self._down_since: float | None = None
        self._down_reason = ""
        self._last_probe = 0.0
        self._ping_client: Any = None

    @property
    def api(self) -> Any:
        return self.client.api

    # --- health ---------------------------------------------------------------------------

    @property
    def ping_timeout_s(self) -> float:
        return min(_PING_TIMEOUT_S, self.timeout_s)

    def ping(self) -> bool:
        """Whether the engine answers `/_ping` within the short health-check timeout."""
        import docker

        try:
            if self._ping_client is None:
                # Its own client: a short timeout, and no connection shared with calls that hang.
                self._ping_client = docker.from_env(
                    version=self.api.api_version, timeout=self.ping_timeout_s, environment=self._environment
                )
            return bool(self._ping_client.api.ping())
        except Exception:
            return False

    def healthy(self) -> bool:
        """False while the engine is known to be down (no engine call is made to say so)."""
        return self._down_since is None

    def check_health(self) -> bool:
        """Ping the engine now and record the answer: a live engine clears an earlier failure."""
        ok = self.ping()
        now = time.monotonic()
        self._last_probe = now
        if ok:
            self._down_since = None
        elif self._down_since is None:
            self._down_since = now
            self._down_reason = f"no answer to a ping within {self.ping_timeout_s:g}s"
        return ok

    def _check_up(self, what: str) -> None:
        """Fail fast while the engine is known to be down; re-probe it at most every few seconds."""
        if self._down_since is None:
            return
        now = time.monotonic()
        if now - self._last_probe < _PROBE_INTERVAL_S:
            with self._lock:
                self._fast_failures += 1
            raise self._unavailable(what, self._down_reason)
        if self.check_health():
            return
        with self._lock:
            self._fast_failures += 1
        raise self._unavailable(what, self._down_reason)

    def _unavailable(self, what: str, reason: str) -> EngineUnavailable:
        since = "" if self._down_since is None else f" for {time.monotonic() - self._down_since:.0f}s"
        return EngineUnavailable(
            f"{ENGINE_DOWN} ({what}: {reason}{since}; engine {self.address}). Check it with `docker info`; "
            "if it hangs, restart it (`systemctl restart docker`, or stop and start `dockerd`)"
        )

    def describe(self, exc: BaseException) -> str:
        import requests

        if isinstance(exc, requests.exceptions.Timeout):
            return f"no answer within {self.timeout_s:g}s"
        return f"connection failed ({type(exc).__name__})"

    def failure(self, what: str, detail: str) -> EngineUnavailable:
        """The error to raise for an engine call that timed out or could not connect (`detail`: how).

        A health check decides the words; the engine is marked down when it fails, so the calls
        that follow fail fast instead of each waiting out its own timeout.
        """
        if self.ping():
            # Alive but this call hung: overloaded, or deadlocked in its network code.
            return EngineUnavailable(
                f"the Docker engine did not complete {what} ({detail}) though it answers pings: it is "
                "overloaded or deadlocked (Docker 20.10 can deadlock in libnetwork under concurrent container "
                f"create/remove). If this repeats, {ENGINE_DOWN.split(': ', 1)[1]} (engine {self.address})"
            )
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
        self._down_reason = f"{detail}, and no answer to a ping within {self.ping_timeout_s:g}s"
        self._last_probe = now
        return self._unavailable(what, self._down_reason)

    # --- the gate -------------------------------------------------------------------------

    @contextlib.contextmanager
    def lifecycle(self, what: str) -> Iterator[None]:
        """Run one container create/start/remove call: bounded in concurrency, failing fast and
        clearly when the engine is down. Engine failures inside become `EngineUnavailable`."""
        self._check_up(what)
        # Waiting for a slot is bounded too: the calls holding them each end by their own timeout.
        wait_s = self.timeout_s + self.ping_timeout_s
        if not self._slots.acquire(timeout=wait_s):
            raise self.failure(
                what, f"none of the {self.limit} engine call slots came free within {wait_s:g}s"
            )
        try:
            with self._lock:
                self._in_flight += 1
                self._calls += 1
                self._max_in_flight = max(self._max_in_flight, self._in_flight)
            try:
                self._check_up(what)  # it may have gone down while this call waited
                yield
            except Exception as exc:
                if is_engine_failure(exc):
                    raise self.failure(what, self.describe(exc)) from exc
                raise
        finally:
            with self._lock:
                self._in_flight -= 1
            self._slots.release()

    def stats(self) -> GateStats:
        with self._lock:
            return GateStats(
                limit=self.limit,
                in_flight=self._in_flight,
                max_in_flight=self._max_in_flight,
                calls=self._calls,
                fast_failures=self._fast_failures,
            )


# Per-address TLS settings of remote engines (`agentrl.sandbox.hosts`): environment overrides
# for docker.from_env, which turns them into the SDK's TLSConfig.
_tls_env: dict[str, dict[str, str]] = {}


def register_tls(address: str, cert_path: str | None, verify: bool = True) -> None:
    """Talk TLS to the engine at `address`: client cert/key and CA from `cert_path` (the docker
    CLI's layout: ca.pem, cert.pem, key.pem), the server's certificate checked when `verify`."""
    env = {"DOCKER_CERT_PATH": cert_path or "", "DOCKER_TLS_VERIFY": "1" if verify else ""}
    _tls_env[address] = env


def engine_environment(address: str) -> dict[str, str]:
    """The environment docker.from_env reads for `address`: this process's, the address as
    DOCKER_HOST, and that address's registered TLS settings."""
    return {**os.environ, "DOCKER_HOST": address, **_tls_env.get(address, {})}


_engines: dict[tuple[int, str, float, int], Engine] = {}
_engines_lock = threading.Lock()


def engine(address: str | None = None) -> Engine:
    """The process-wide `Engine` for `address` (default: `DOCKER_HOST`, else the local socket)."""
    from agentrl.sandbox.settings import current

    s = current()
    key = (os.getpid(), address or engine_address(), s.docker_timeout_s, s.docker_max_lifecycle_calls)
    found = _engines.get(key)
    if found is not None:
        return found
    with _engines_lock:
        if key not in _engines:
            _engines[key] = Engine(key[1], key[2], key[3])
        return _engines[key]
