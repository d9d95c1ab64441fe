"""Warm sandbox pool: ready-made sandboxes so that an environment's `reset` costs milliseconds.

Starting a sandbox costs hundreds of milliseconds (a docker container) to tens (bwrap, local).
An environment resets once per episode, so that cost is paid on the rollout's critical path.
The pool pays it ahead of time instead: for each distinct configuration (a `PoolKey`: a backend
and a `SandboxSpec`) it keeps `size` sandboxes started, hands one out on `acquire`, and starts a
replacement in the background on a small thread pool.

    pool = SandboxPool(size=4)
    with pool.acquire("docker", limits=Limits(memory_mb=512)) as sb:   # ~ms when one is warm
        sb.exec("python3 -V")
    pool.close()

What it guarantees:
- A sandbox is handed out to one caller at a time. `acquire` transfers ownership to the caller,
  who ends it after the episode with `release` (or `close`). A released docker sandbox is reset
  and handed out again (`recycle`, on by default): every process of the episode killed and its
  writable mounts and IPC objects emptied, from the host (`DockerSandbox.recycle`), so the next
  episode starts from the image's clean state as a new container would, for ~0.1 s of work
  instead of a container create, start and remove. A sandbox that cannot be reset (its executor
  tampered with, its container dead, an engine on another machine) is closed instead, as are all
  sandboxes of backends that start in milliseconds anyway (bwrap, local).
- A warm sandbox that died while it waited (OOM, daemon restart, a reaper), or whose resident
  executor died or stopped answering, is discarded at hand-out (`alive()` is checked, which pings
  the executor) and replaced.
- A background start that fails is not swallowed: the next `acquire` of that key raises it,
  and background starts of that key back off exponentially instead of retrying in a loop.
- `close()` (also on `with`, and at interpreter exit) destroys every warm sandbox and waits for
  in-flight starts, so a run leaves no container behind.

What it does not do: health-check a sandbox after hand-out (that is the caller's). When nothing
is warm and no start is in flight, `acquire` starts a sandbox in the caller's thread, so those
starts run with the caller's concurrency; the background refills are bounded by `workers`
(default 2, so a 2-core machine is not swamped by refills), and on docker every container
create/start/remove, the caller's included, also passes the engine's process-wide gate
(`agentrl.sandbox.engine`, 4 at once by default).
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Unpack

from agentrl.core.plugins import UnknownPluginError
from agentrl.sandbox.base import BACKENDS, Sandbox, SandboxError, SandboxSpec, SpecFields, open_sandbox

log = logging.getLogger(__name__)

# How many start latencies `stats()` summarises (the most recent ones).
_LATENCY_WINDOW = 1024


class SandboxPoolError(SandboxError):
    """The pool could not provide a sandbox: it is closed, or a background start failed."""


@dataclass(frozen=True)
class PoolKey:
    """Everything that makes two sandboxes interchangeable: a backend and a spec. The pool's dict key."""

    backend: str
    spec: SandboxSpec

    @classmethod
    def make(
        cls, backend: str = "docker", spec: SandboxSpec | None = None, **fields: Unpack[SpecFields]
    ) -> PoolKey:
        """A key from `open_sandbox`'s arguments (a spec, its fields as keywords, or both)."""
        if backend not in BACKENDS:
            raise UnknownPluginError(BACKENDS.unknown(backend))
        return cls(backend, SandboxSpec.of(spec, **fields))

    def open(self) -> Sandbox:
        """Start one fresh sandbox of this configuration (blocking)."""
        return open_sandbox(self.backend, self.spec)

    def describe(self) -> str:
        return f"{self.backend} sandbox (image {self.spec.image!r}, workdir {self.spec.workdir!r})"


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of the pool's counters since it was created. Latencies are in seconds."""

    hits: int
    """Acquires served by a warm sandbox that was already started."""
    misses: int
    """Acquires that found nothing warm: they waited for an in-flight start or started one."""
    waited: int
    """Of the misses, those that waited for a background start already in flight."""
    warm: int
    """Sandboxes started and waiting to be handed out now, over all keys."""
    starting: int
    """Background starts queued or running now."""
    keys: int
    """Distinct configurations the pool keeps warm sandboxes for."""
    started: int
    """Sandboxes started successfully (background and in the caller's thread)."""
    start_failures: int
    """Starts that raised (background and in the caller's thread)."""
    discarded_dead: int
    """Warm sandboxes found dead at hand-out, closed and replaced."""
    evicted: int
    """Warm sandboxes closed because their key was the least recently used beyond `max_keys`."""
    recycled: int
    """Released sandboxes reset and made warm again (each one a start saved)."""
    recycle_refused: int
    """Released sandboxes that could not be reset (tampered with, dead) and were closed instead."""
    resetting: int
    """Released sandboxes being reset now (or queued for it)."""
    closing: int
    """Sandboxes being closed in the background now (or queued for it)."""
    start_latency_p50_s: float | None
    start_latency_p99_s: float | None
    acquire_latency_p50_s: float | None
    acquire_latency_p99_s: float | None


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (`q` in [0, 100]); None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass
class _Warm:
    sandbox: Sandbox
    ready_at: float  # time.monotonic() when its start finished


@dataclass
class _KeyState:
    target: int  # how many warm sandboxes to keep for this key
    ready: deque[_Warm] = field(default_factory=deque)
    queued: int = 0  # background starts submitted, not yet running
    running: int = 0  # background starts running now
    waiting: int = 0  # callers blocked on a running start
    error: Exception | None = None  # a background failure no caller has seen yet
    failures: int = 0  # consecutive failed starts; drives the back-off
    retry_at: float = 0.0  # time.monotonic() before which no background start begins
    # The back-off round (`failures`) whose error a caller has already been given: starts that
    # ran together and failed after it belong to the same round and must not raise twice.
    reported_round: int = 0
    resetting: int = 0  # released sandboxes of this key being reset: warm soon, so not refilled


class SandboxPool:
    """Keeps `size` started sandboxes per configuration and hands each out to one caller at a time.

    Thread-safe: any number of threads may `acquire` at once. From asyncio, use `acquire_async`.
    """

    def __init__(
        self,
        size: int = 4,
        *,
        workers: int = 2,
        max_keys: int = 8,
        check_alive: bool = True,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 60.0,
        recycle: bool = True,
        keep: int = 64,
    ) -> None:
        """
        size: warm sandboxes kept per configuration (`prewarm` can raise it for one key).
        workers: background starts running at once; each start costs the engine CPU.
        max_keys: configurations kept warm at once. A new one beyond this evicts (closes the warm
            sandboxes of) the least recently acquired one, so per-task env or labels cannot make
            the pool hoard sandboxes without bound.
        check_alive: call `alive()` on a warm sandbox before handing it out (one cheap call).
        backoff_initial_s, backoff_max_s: after n consecutive failed starts of a key, its
            background starts pause for min(initial * 2**(n-1), max) seconds.
        recycle: reset released sandboxes that can be (`recycle()`: docker) and hand them out again,
            instead of closing them.
        keep: warm sandboxes of one configuration the pool keeps at most, reset ones included (the
            rest are closed): a run's concurrency worth of containers stays ready between steps.
        """
        if size < 0:
            raise ValueError(f"size must be >= 0 warm sandboxes per configuration, got {size}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1 background start thread, got {workers}")
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1 configuration, got {max_keys}")
        self.size = size
        self.workers = workers
        self.max_keys = max_keys
        self.check_alive = check_alive
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.recycle = recycle
        self.keep = max(keep, size)

        self._cond = threading.Condition(threading.Lock())
        # Ordered by last use: the first entry is the eviction candidate.
        self._keys: OrderedDict[PoolKey, _KeyState] = OrderedDict()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox-pool")
        # Resets on threads of their own: one takes ~0.1 s and must not queue behind starts (~1 s).
        # Twice as many: a reset mostly waits (one `docker exec`, cgroup and file system calls).
        self._resetter = ThreadPoolExecutor(max_workers=2 * workers, thread_name_prefix="sandbox-reset")
        self._closed = False
        # Dead or evicted sandboxes waiting for a worker to close them; close() closes leftovers.
        self._to_close: list[Sandbox] = []
        # atexit handlers survive fork; a child must not destroy its parent's warm sandboxes.
        self._owner_pid = os.getpid()

        self._hits = 0
        self._misses = 0
        self._waited = 0
        self._started = 0
        self._start_failures = 0
        self._discarded_dead = 0
        self._evicted = 0
        self._recycled = 0
        self._recycle_refused = 0
        self._resetting = 0
        self._closing = 0
        # Handed out and not yet released, with their key: `release` returns them to it.
        self._lent: weakref.WeakKeyDictionary[Sandbox, PoolKey] = weakref.WeakKeyDictionary()
        # Released, waiting for a worker to reset them; close() closes those it finds here.
        self._to_recycle: list[Sandbox] = []
        self._start_latencies_s: deque[float] = deque(maxlen=_LATENCY_WINDOW)
        self._acquire_latencies_s: deque[float] = deque(maxlen=_LATENCY_WINDOW)

        # A pool the caller forgot to close still must not leave containers behind.
        atexit.register(self.close)
        # Its sandboxes start on worker threads: the signal handlers that remove them must be
        # installed from the main thread, so do it here when the pool is made there.
        from agentrl.sandbox.reaper import install_signal_handlers

        install_signal_handlers()

    # ---- public API -------------------------------------------------------------------------

    def acquire(
        self, backend: str = "docker", spec: SandboxSpec | None = None, **fields: Unpack[SpecFields]
    ) -> Sandbox:
        """Hand out a started sandbox of this configuration, never used or reset since its last use;
        the caller gives it back with `release` (or closes it).

        The configuration is a `SandboxSpec`, its fields as keywords, or both, as for `open_sandbox`.
        Takes a warm one when there is one (milliseconds). Otherwise waits for a background start
        already in flight, or starts one in this thread. Either way a replacement is started in
        the background. Raises `SandboxPoolError` when a background start of this configuration
        failed since the last acquire (the cause is chained), or when the pool is closed.
        """
        return self.acquire_key(PoolKey.make(backend, spec, **fields))

    async def acquire_async(
        self, backend: str = "docker", spec: SandboxSpec | None = None, **fields: Unpack[SpecFields]
    ) -> Sandbox:
        """`acquire` for asyncio code: runs in a worker thread so the event loop never blocks.

        If the awaiting task is cancelled, the sandbox the thread still produces is closed
        instead of leaking.
        """
        import asyncio
        import functools

        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(None, functools.partial(self.acquire, backend, spec, **fields))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:

            def close_orphan(done: asyncio.Future[Sandbox]) -> None:
                if not done.cancelled() and done.exception() is None:
                    loop.run_in_executor(None, _close_quietly, done.result())

            future.add_done_callback(close_orphan)
            raise

    def acquire_key(self, key: PoolKey) -> Sandbox:
        """`acquire` by a ready-made `PoolKey`."""
        t0 = time.monotonic()
        to_close: list[Sandbox] = []
        try:
            while True:
                warm, must_start = self._take_or_wait(key, to_close)
                if warm is not None:
                    if self._usable(warm.sandbox):
                        with self._cond:
                            self._hits += 1
                            self._acquire_latencies_s.append(time.monotonic() - t0)
                            self._lent[warm.sandbox] = key
                        return warm.sandbox
                    with self._cond:
                        self._discarded_dead += 1
                    log.warning("discarding a warm %s that died while it waited", key.describe())
                    to_close.append(warm.sandbox)
                    continue
                assert must_start
                sandbox = self._start_in_caller(key)
                with self._cond:
                    self._acquire_latencies_s.append(time.monotonic() - t0)
                    self._lent[sandbox] = key
                return sandbox
        finally:
            with self._cond:
                state = self._keys.get(key)
                if state is not None:
                    self._refill_locked(key, state)
            self._close_in_background(to_close)

    def prewarm(
        self,
        n: int | None = None,
        *,
        wait: bool = True,
        timeout_s: float | None = None,
        backend: str = "docker",
        spec: SandboxSpec | None = None,
        **fields: Unpack[SpecFields],
    ) -> int:
        """Keep `n` (default: `size`) warm sandboxes of this configuration from now on.

        With `wait`, blocks until `n` are warm (or `timeout_s` passes) and raises the first
        background failure. Returns how many are warm.
        """
        return self.prewarm_key(PoolKey.make(backend, spec, **fields), n, wait=wait, timeout_s=timeout_s)

    def prewarm_key(
        self, key: PoolKey, n: int | None = None, *, wait: bool = True, timeout_s: float | None = None
    ) -> int:
        """`prewarm` by a ready-made `PoolKey`."""
        target = self.size if n is None else n
        if target < 0:
            raise ValueError(f"n must be >= 0 warm sandboxes, got {target}")
        to_close: list[Sandbox] = []
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            with self._cond:
                self._check_open()
                state = self._state_locked(key, to_close)
                state.target = target
                self._refill_locked(key, state)
                while wait and len(state.ready) < target:
                    if state.error is not None:
                        error, state.error = state.error, None
                        raise self._background_error(key, state, error)
                    if state.queued + state.running == 0:
                        # Nothing in flight and not enough warm: a back-off is holding refills.
                        self._refill_locked(key, state)
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        break
                    self._cond.wait(timeout=0.5 if remaining is None else min(0.5, remaining))
                    self._check_open()
                return len(state.ready)
        finally:
            self._close_in_background(to_close)

    def release(self, sandbox: Sandbox) -> None:
        """End the caller's use of a sandbox this pool handed out (after its episode, verifier
        included). With `recycle`, one whose backend can reset it is reset in the background and
        becomes warm again; any other is closed (off the caller's path). Never raises."""
        with self._cond:
            key = self._lent.pop(sandbox, None)
            reuse = (
                self.recycle
                and key is not None
                and not self._closed
                and callable(getattr(sandbox, "recycle", None))
            )
        if not reuse:
            if key is None:
                _close_quietly(sandbox)  # not one of ours: the caller's close, as before
            else:
                self._close_in_background([sandbox])
            return
        with self._cond:
            self._to_recycle.append(sandbox)
            self._resetting += 1
            if (state := self._keys.get(key)) is not None:
                state.resetting += 1
        try:
            self._resetter.submit(self._recycle, key, sandbox, state)
        except RuntimeError:
            self._recycle_done(state)
            with self._cond:
                self._to_recycle.remove(sandbox)
            _close_quietly(sandbox)  # the pool is shutting down

    def stats(self) -> PoolStats:
        with self._cond:
            starts = list(self._start_latencies_s)
            acquires = list(self._acquire_latencies_s)
            return PoolStats(
                hits=self._hits,
                misses=self._misses,
                waited=self._waited,
                warm=sum(len(s.ready) for s in self._keys.values()),
                starting=sum(s.queued + s.running for s in self._keys.values()),
                keys=len(self._keys),
                started=self._started,
                start_failures=self._start_failures,
                discarded_dead=self._discarded_dead,
                evicted=self._evicted,
                recycled=self._recycled,
                recycle_refused=self._recycle_refused,
                resetting=self._resetting,
                closing=self._closing,
                start_latency_p50_s=percentile(starts, 50),
                start_latency_p99_s=percentile(starts, 99),
                acquire_latency_p50_s=percentile(acquires, 50),
                acquire_latency_p99_s=percentile(acquires, 99),
            )

    def warm_count(self, key: PoolKey | None = None) -> int:
        """Warm sandboxes of `key` (or of all keys) ready to hand out now."""
        with self._cond:
            if key is not None:
                state = self._keys.get(key)
                return 0 if state is None else len(state.ready)
            return sum(len(s.ready) for s in self._keys.values())

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Destroy every warm sandbox and wait for in-flight starts. Safe to call twice.

        Sandboxes already handed out are the callers' and are left alone.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            warm = [w.sandbox for s in self._keys.values() for w in s.ready]
            for state in self._keys.values():
                state.ready.clear()
            self._keys.clear()
            self._cond.notify_all()
        atexit.unregister(self.close)
        if os.getpid() != self._owner_pid:
            return  # a forked child: the sandboxes and the worker threads are the parent's
        # Queued starts are cancelled; a running one finishes, sees `_closed`, and closes what it
        # started, so after this returns no start can add a sandbox any more.
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._resetter.shutdown(wait=True, cancel_futures=True)
        with self._cond:
            leftovers, self._to_close = self._to_close, []
            self._closing -= len(leftovers)
            leftovers += self._to_recycle
            self._to_recycle = []
        _close_all(warm + leftovers)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SandboxPool(size={self.size}, workers={self.workers}, closed={self._closed})"

    # ---- internals --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxPoolError(
                "this SandboxPool is closed; create a new one (or use get_default_pool()) to acquire sandboxes"
            )

    def _state_locked(self, key: PoolKey, to_close: list[Sandbox]) -> _KeyState:
        state = self._keys.get(key)
        if state is None:
            state = self._keys[key] = _KeyState(target=self.size)
            while len(self._keys) > self.max_keys:
                old_key, old = self._keys.popitem(last=False)
                # Its in-flight starts see that their state is detached and close what they start.
                to_close.extend(w.sandbox for w in old.ready)
                self._evicted += len(old.ready)
                old.ready.clear()
                log.info(
                    "evicting warm sandboxes of %s (more than max_keys=%d)", old_key.describe(), self.max_keys
                )
        self._keys.move_to_end(key)
        return state

    def _take_or_wait(self, key: PoolKey, to_close: list[Sandbox]) -> tuple[_Warm | None, bool]:
        """A warm sandbox to hand out, or (None, True): the caller must start one itself."""
        with self._cond:
            self._check_open()
            state = self._state_locked(key, to_close)
            warm = self._ready_locked(key, state)
            if warm is not None:
                return warm, False
            # A start already running, or a released sandbox being reset (~0.1 s), is ready sooner
            # than a new start would be, and costs nothing extra; wait for one unless other callers
            # already wait for every one of them.
            if state.running + state.resetting <= state.waiting:
                self._misses += 1
                return None, True
            self._misses += 1
            self._waited += 1
            state.waiting += 1
            try:
                while not state.ready and state.error is None and state.running + state.resetting > 0:
                    self._cond.wait(timeout=1.0)
                    self._check_open()
                    if self._keys.get(key) is not state:
                        break  # evicted while waiting
            finally:
                state.waiting -= 1
            warm = self._ready_locked(key, state)
            return warm, warm is None

    def _ready_locked(self, key: PoolKey, state: _KeyState) -> _Warm | None:
        """The next warm sandbox of `key`, or None; first raises a background failure no caller has seen."""
        if state.error is not None:
            error, state.error = state.error, None
            state.reported_round = state.failures
            raise self._background_error(key, state, error)
        return state.ready.popleft() if state.ready else None

    def _usable(self, sandbox: Sandbox) -> bool:
        if not self.check_alive:
            return True
        try:
            return bool(sandbox.alive())
        except Exception:
            return False

    def _start_in_caller(self, key: PoolKey) -> Sandbox:
        t0 = time.monotonic()
        try:
            sandbox = key.open()
        except Exception:
            with self._cond:
                self._start_failures += 1
                state = self._keys.get(key)
                if state is not None:
                    # Raised to this caller directly; only hold back the background refills.
                    self._back_off_locked(state)
            raise
        with self._cond:
            self._started += 1
            self._start_latencies_s.append(time.monotonic() - t0)
            closed = self._closed
        if closed:
            _close_all([sandbox])
            self._check_open()
        return sandbox

    def _back_off_locked(self, state: _KeyState) -> float:
        now = time.monotonic()
        if now < state.retry_at:
            # Starts that ran concurrently failed together: one round, not a longer back-off each.
            return state.retry_at - now
        state.failures += 1
        delay_s = min(self.backoff_initial_s * 2 ** (state.failures - 1), self.backoff_max_s)
        state.retry_at = now + delay_s
        return delay_s

    def _refill_locked(self, key: PoolKey, state: _KeyState) -> None:
        if self._closed or time.monotonic() < state.retry_at:
            return
        missing = state.target - len(state.ready) - state.queued - state.running - state.resetting
        for _ in range(missing):
            state.queued += 1
            try:
                self._executor.submit(self._start_in_background, key, state)
            except RuntimeError:
                # The interpreter is shutting down: no new threads; close() follows at exit.
                state.queued -= 1
                return

    def _start_in_background(self, key: PoolKey, state: _KeyState) -> None:
        with self._cond:
            state.queued -= 1
            if self._closed or self._keys.get(key) is not state or time.monotonic() < state.retry_at:
                self._cond.notify_all()
                return
            state.running += 1
        t0 = time.monotonic()
        try:
            sandbox = key.open()
        except Exception as exc:
            with self._cond:
                state.running -= 1
                self._start_failures += 1
                delay_s = self._back_off_locked(state)
                if state.error is None and state.reported_round != state.failures:
                    state.error = exc  # the first failure of a round is the informative one
                self._cond.notify_all()
            log.warning(
                "background start of a %s failed (%s: %s); next background try in %.0f s",
                key.describe(),
                type(exc).__name__,
                exc,
                delay_s,
            )
            return
        orphan = False
        with self._cond:
            state.running -= 1
            state.failures = 0
            state.reported_round = 0
            self._started += 1
            self._start_latencies_s.append(time.monotonic() - t0)
            if self._closed or self._keys.get(key) is not state:
                orphan = True
            else:
                state.ready.append(_Warm(sandbox, time.monotonic()))
            self._cond.notify_all()
        if orphan:
            _close_all([sandbox])

    def _recycle(self, key: PoolKey, sandbox: Sandbox, state: _KeyState | None) -> None:
        try:
            self._reset_and_keep(key, sandbox)
        finally:
            self._recycle_done(state)

    def _recycle_done(self, state: _KeyState | None) -> None:
        with self._cond:
            self._resetting -= 1
            if state is not None:
                state.resetting -= 1
            self._cond.notify_all()  # callers waiting for it: take it, or start their own

    def _reset_and_keep(self, key: PoolKey, sandbox: Sandbox) -> None:
        with self._cond:
            if sandbox not in self._to_recycle:
                return  # close() took it
            self._to_recycle.remove(sandbox)
        try:
            ok = bool(sandbox.recycle())  # type: ignore[attr-defined]
        except Exception as exc:
            log.warning(
                "resetting sandbox %s failed (%s: %s); it is closed", sandbox.id, type(exc).__name__, exc
            )
            ok = False
        with self._cond:
            state = self._keys.get(key)
            keep = ok and not self._closed and state is not None and len(state.ready) < self.keep
            if keep:
                assert state is not None
                # First in line: the most recently used container is the one whose pages are warm.
                state.ready.appendleft(_Warm(sandbox, time.monotonic()))
                self._recycled += 1
                self._cond.notify_all()
            elif not ok:
                self._recycle_refused += 1
        if not keep:
            _close_quietly(sandbox)

    def _background_error(self, key: PoolKey, state: _KeyState, error: Exception) -> SandboxPoolError:
        wait_s = max(0.0, state.retry_at - time.monotonic())
        exc = SandboxPoolError(
            f"starting a warm {key.describe()} in the background failed: {type(error).__name__}: {error}. "
            f"{state.failures} start(s) in a row failed; background starts resume in {wait_s:.1f} s, and the "
            "next acquire() tries a start itself. Fix the cause (image built? engine running? limits "
            "valid?) — `agentrl sandbox doctor` checks the set-up."
        )
        exc.__cause__ = error
        return exc

    def _close_in_background(self, sandboxes: list[Sandbox]) -> None:
        """Close off the caller's path (a docker removal takes ~100 ms); close() catches leftovers."""
        if not sandboxes:
            return
        with self._cond:
            self._to_close.extend(sandboxes)
            self._closing += len(sandboxes)
        try:
            self._executor.submit(self._drain_to_close)
        except RuntimeError:
            self._drain_to_close()  # executor shut down (pool closing or interpreter exiting)

    def _drain_to_close(self) -> None:
        with self._cond:
            batch, self._to_close = self._to_close, []
        try:
            _close_all(batch)
        finally:
            with self._cond:
                self._closing -= len(batch)


def _close_quietly(sandbox: Sandbox) -> None:
    try:
        sandbox.close()
    except Exception as exc:
        log.warning("closing sandbox %s failed: %s", getattr(sandbox, "id", "?"), exc)


def _close_all(sandboxes: list[Sandbox]) -> None:
    """Close sandboxes, a few at a time: a docker removal mostly waits on the engine."""
    if len(sandboxes) <= 1:
        for sandbox in sandboxes:
            _close_quietly(sandbox)
        return
    pending = deque(sandboxes)
    lock = threading.Lock()

    def drain() -> None:
        while True:
            with lock:
                if not pending:
                    return
                sandbox = pending.popleft()
            _close_quietly(sandbox)

    threads = []
    for _ in range(min(8, len(sandboxes))):
        thread = threading.Thread(target=drain, name="sandbox-pool-close", daemon=True)
        try:
            thread.start()
        except RuntimeError:
            break  # no new threads at interpreter shutdown: this thread drains the rest
        threads.append(thread)
    drain()
    for thread in threads:
        thread.join()


_default_pool: SandboxPool | None = None
_default_lock = threading.Lock()


def get_default_pool() -> SandboxPool:
    """The process-wide pool (created on first use, closed at exit).

    Its size, background start threads and reuse are the sandbox settings' `pool_size`,
    `pool_workers` and `pool_recycle` when it is created (`agentrl.sandbox.settings.current()`: default 4 and 2).
    """
    global _default_pool
    with _default_lock:
        if _default_pool is None or _default_pool.closed:
            from agentrl.sandbox.settings import current

            settings = current()
            _default_pool = SandboxPool(
                size=settings.pool_size, workers=settings.pool_workers, recycle=settings.pool_recycle
            )
        return _default_pool


def _forget_default_pool_in_child() -> None:
    # A forked child inherits the parent's pool object but none of its threads, and the warm
    # sandboxes belong to the parent: the child starts its own pool on first use.
    global _default_pool, _default_lock
    _default_pool = None
    _default_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_default_pool_in_child)
