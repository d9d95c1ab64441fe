"""Find and remove sandbox containers that a crashed run left behind.

Every docker sandbox carries labels naming the process that owns it: `agentrl.host`,
`agentrl.pid`, `agentrl.pid_start` (the owner's start time in clock ticks since boot) and
`agentrl.boot_id`. A container is an orphan when its owner ran on this host and that exact
process is gone: the pid is dead, the pid was reused by a newer process (start time differs),
or the machine rebooted since (boot id differs). Containers owned by other hosts are never
judged: this machine cannot see their processes (use `reap(include_live=True)` there).

A container's resident executor (`agentrl.sandbox.executor`) goes with it: it also ends by
itself when its owner dies (its channel closes). bwrap sandboxes are reaped by
`agentrl.sandbox.bwrap.reap_stale`, which also kills a resident executor its dead owner left.

Four things call into here:
- `install_signal_handlers()`, from every agentrl entry point that runs on the main thread
  (the CLI, `ToolEnv`, `rollout.collect`, `SandboxPool`, a sandbox opened there): SIGTERM and
  SIGINT handlers that remove the containers this process holds, whichever thread opened them
  (a rollout opens them on worker threads), including creates still in flight, then defer to
  whatever handler was there before (SIGINT still raises KeyboardInterrupt);
- `install_exit_handlers()`, when each process's first docker sandbox opens: the `atexit`
  removal, the signal handlers if on the main thread, and a start-up reap in a background
  thread for runs that died by SIGKILL or OOM, where no handler could run;
- `defer()` / `retry_deferred()`: a container whose removal failed (engine down) is not
  forgotten: it stays owed, is retried, removed at exit, or reaped by the next process;
- `agentrl sandbox reap [--all]`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentrl.core.interrupt import interrupt

log = logging.getLogger(__name__)

LABEL_RUN_ID = "agentrl.run_id"
LABEL_PID = "agentrl.pid"
LABEL_HOST = "agentrl.host"
LABEL_CREATED_AT = "agentrl.created_at"
LABEL_PID_START = "agentrl.pid_start"
LABEL_BOOT_ID = "agentrl.boot_id"
# The engine address the creating process used (DOCKER_HOST or a `sandbox.docker_hosts` entry):
# with several engines, which one holds the container, as seen from its owner.
LABEL_ENGINE = "agentrl.engine"

# Run id per process. Read once from AGENTRL_RUN_ID when the launcher sets one for a whole job
# (several worker processes then share it); otherwise one is made up per process.
_run_ids: dict[int, str] = {}


def run_id() -> str:
    """This process's run id, the value of the `agentrl.run_id` label on its sandboxes."""
    pid = os.getpid()
    if pid not in _run_ids:
        _run_ids[pid] = (
            os.environ.get("AGENTRL_RUN_ID") or f"{socket.gethostname()}-{pid}-{uuid.uuid4().hex[:8]}"
        )
    return _run_ids[pid]


@functools.cache
def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def process_start_ticks(pid: int) -> str:
    """Start time of `pid` in clock ticks since boot ("" where /proc is unavailable).

    Together with the pid this names one process for good: a recycled pid has a later start.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return ""
    # The command name (field 2) may contain spaces and parentheses; fields after it do not.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return fields[19].decode()


def owner_labels() -> dict[str, str]:
    """The labels that tie a container to this process (the reaper's evidence)."""
    pid = os.getpid()
    return {
        LABEL_RUN_ID: run_id(),
        LABEL_HOST: socket.gethostname(),
        LABEL_PID: str(pid),
        LABEL_PID_START: process_start_ticks(pid),
        LABEL_BOOT_ID: boot_id(),
    }


def owner_alive(labels: dict[str, str]) -> bool | None:
    """Whether the process that created a container still runs; None when this host cannot tell."""
    if labels.get(LABEL_HOST) != socket.gethostname():
        return None
    try:
        pid = int(labels.get(LABEL_PID, ""))
    except ValueError:
        return None
    recorded_boot = labels.get(LABEL_BOOT_ID, "")
    if recorded_boot and boot_id() and recorded_boot != boot_id():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by another user
    # A different start time means the pid was recycled by a newer process.
    recorded_start = labels.get(LABEL_PID_START, "")
    now = process_start_ticks(pid)
    return not (recorded_start and now and now != recorded_start)


def _remove(client: Any, container_id: str) -> bool:
    import docker.errors

    try:
        client.api.remove_container(container_id, force=True, v=True)
        return True
    except docker.errors.NotFound:
        return False
    except docker.errors.APIError as exc:
        # Another reaper (or the owner's own exit handler) got there first.
        if exc.status_code == 409 and "already in progress" in str(exc):
            return False
        raise


def _remove_many(client: Any, ids: list[str]) -> list[str]:
    """Remove containers in parallel: one by one, a pool of 64 takes many seconds at exit.

    Plain threads, not concurrent.futures: its executors refuse work once the interpreter
    starts shutting down, which is exactly when `atexit` calls this.
    """
    import requests

    removed: list[str] = []
    errors: list[BaseException] = []
    # One timeout is enough to know the engine is not answering: do not wait one out per container.
    engine_down = threading.Event()

    def worker(batch: list[str]) -> None:
        for cid in batch:
            if engine_down.is_set():
                return
            try:
                if _remove(client, cid):
                    removed.append(cid)
            except Exception as exc:
                errors.append(exc)
                if isinstance(exc, requests.exceptions.ConnectionError | requests.exceptions.Timeout):
                    engine_down.set()

    n_threads = min(8, len(ids))
    batches = [ids[i::n_threads] for i in range(n_threads)]
    threads = [threading.Thread(target=worker, args=(b,), daemon=True) for b in batches[1:]]
    try:
        for t in threads:
            t.start()
    except RuntimeError:  # no new threads at this stage of shutdown: do it all here
        threads, batches = [], [ids]
    if batches:
        worker(batches[0])
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return removed


def _client() -> Any:
    import docker

    from agentrl.sandbox.base import SandboxError

    try:
        return docker.from_env()
    except docker.errors.DockerException as exc:
        raise SandboxError(
            f"cannot reach the Docker engine ({exc}); start it (`make setup`, or `dockerd &` as root)"
        ) from exc


def reap(
    include_live: bool = False, *, client: Any = None, host: str | None = None, run: str | None = None
) -> list[str]:
    """Remove agentrl containers whose owning process is gone; returns their names.

    host: the engine to reap (a `sandbox.docker_hosts` address such as tcp://node3:2376; default
        DOCKER_HOST, else the local socket). A remote engine's containers are judged by the labels
        of their owner, which is the process on *this* machine that created them: run the reap
        where the driver ran, or name the run.
    run: only this run's containers (the `agentrl.run_id` label), all of them, live or not: for a
        run you know is over, from any machine (its owner may have run elsewhere).
    With `include_live=True` every agentrl container goes, live runs (this one included)
    and other hosts' too: for a machine you know is idle.
    """
    if client is None and host is not None:
        from agentrl.sandbox.engine import engine

        client = engine(host).client
    client = client or _client()
    label = LABEL_RUN_ID if run is None else f"{LABEL_RUN_ID}={run}"
    found = client.api.containers(all=True, filters={"label": label})
    doomed: dict[str, str] = {}
    for c in found:
        if include_live or run is not None or owner_alive(c.get("Labels") or {}) is False:
            name = (c.get("Names") or [c["Id"][:12]])[0].lstrip("/")
            doomed[c["Id"]] = name
    removed = _remove_many(client, list(doomed))
    return [doomed[cid] for cid in removed]


# --- this process's own containers -------------------------------------------------------


@dataclass
class _Owned:
    """One container this process created (or is creating) and has not removed yet."""

    pid: int  # the creating process: a forked child inherits the registry, never the containers
    engine: str  # the engine's address (DOCKER_HOST): removals go to the engine that holds it
    creating: bool  # the create call is in flight: it may exist on the engine any moment now
    thread: int  # the creating thread (a signal handler cannot wait for its own thread)
    deferred: bool = False  # a removal failed (engine down): retried, and at exit, and by the reaper
    # The create call itself failed on our side (timeout): the engine may still carry it out once
    # it answers again, so "no such container" is final only after the engine has answered for a
    # while (`_UNCERTAIN_SETTLE_S`): requests it held while hung are done by then.
    uncertain: bool = False
    answered_since: float | None = None


# Keyed by container name, chosen before the create call, so a container whose create is in flight
# (or timed out on our side but completed on the engine's) can still be removed.
_owned: dict[str, _Owned] = {}
_owned_lock = threading.Lock()
# Set while an exit handler removes this process's containers: no new create may start then.
_exiting = False
# How long an exit handler waits for creates in flight to land, so it can remove them too.
_EXIT_WAIT_S = 10.0
# Removals at exit use their own client with this timeout: a dead engine must not hold up the exit.
_EXIT_TIMEOUT_S = 10.0
# How long a create that timed out on our side is watched for once the engine answers again.
_UNCERTAIN_SETTLE_S = 5.0


def register(name: str, engine: str, *, creating: bool = False) -> None:
    """Record a container this process owns (`creating=True` before its create call is sent)."""
    with _owned_lock:
        _owned[name] = _Owned(os.getpid(), engine, creating, threading.get_ident())


def created(name: str) -> None:
    """The create call of `name` returned (whether or not the container exists)."""
    record = _owned.get(name)
    if record is not None:
        record.creating = False


def unregister(name: str) -> None:
    """`name` is removed: forget it."""
    with _owned_lock:
        _owned.pop(name, None)


def defer(name: str) -> None:
    """The removal of `name` failed (engine down or hung): keep it, to be retried by
    `retry_deferred()`, by this process's exit handlers, and after this process, by the start-up
    reap of the next one (its labels name this process)."""
    record = _owned.get(name)
    if record is not None:
        if record.creating:
            record.uncertain = True
        record.creating = False
        record.deferred = True


def exiting() -> bool:
    """Whether an exit handler is removing this process's containers right now."""
    return _exiting


def pending_removals() -> list[str]:
    """Containers of this process whose removal failed and is still owed."""
    pid = os.getpid()
    return [name for name, r in list(_owned.items()) if r.pid == pid and r.deferred]


def retry_deferred() -> list[str]:
    """Try the owed removals again now; returns the names removed. Never raises."""
    pid = os.getpid()
    by_engine: dict[str, list[str]] = {}
    for name, r in list(_owned.items()):
        if r.pid == pid and r.deferred:
            by_engine.setdefault(r.engine, []).append(name)
    from agentrl.sandbox.engine import engine

    done: list[str] = []
    for address, names in by_engine.items():
        try:
            eng = engine(address)
        except Exception:
            continue  # still unreachable: all stay owed
        for name in names:
            try:
                # Through the engine's gate: bounded, and at once refused while it is known down.
                with eng.lifecycle(f"removing container {name} (owed)"):
                    existed = _remove(eng.client, name)
            except Exception:
                continue  # still down: stays owed
            record = _owned.get(name)
            if not existed and record is not None and record.uncertain:
                now = time.monotonic()
                if record.answered_since is None:
                    record.answered_since = now
                if now - record.answered_since < _UNCERTAIN_SETTLE_S:
                    continue  # its timed-out create may still land: keep watching for it
            unregister(name)
            done.append(name)
    return done


def remove_own_containers(*, final: bool = True, wait_s: float = _EXIT_WAIT_S) -> list[str]:
    """Remove every container this process created and has not removed (exit handlers call this).

    Creates in flight on other threads are waited for (up to `wait_s`), then removed too; while
    this runs no new create may start. `final=False` (a handler after which the process may go
    on, such as SIGINT's) lets creates start again afterwards.
    """
    global _exiting
    pid = os.getpid()
    main = threading.main_thread().ident
    me = threading.get_ident()
    deadline = time.monotonic() + wait_s
    removed: list[str] = []
    _exiting = True
    try:
        while True:
            # No lock: this runs inside signal handlers, which may interrupt a thread holding it.
            mine = [(n, r) for n, r in list(_owned.items()) if r.pid == pid]
            # A create on this very thread (the handler interrupted it) will never land while we
            # wait: try it by name now. Others in flight are waited for.
            ready = [(n, r) for n, r in mine if not r.creating or r.thread in (me, main)]
            by_engine: dict[str, list[tuple[str, _Owned]]] = {}
            for name, r in ready:
                _owned.pop(name, None)
                by_engine.setdefault(r.engine, []).append((name, r))
            for address, entries in by_engine.items():
                try:
                    removed += _remove_many(_exit_client(address), [n for n, _ in entries])
                except Exception:
                    # The engine is gone: still owed (if the process goes on), and after it ends
                    # the next start-up reap finds them by their labels.
                    for name, r in entries:
                        r.creating, r.deferred = False, True
                        _owned.setdefault(name, r)
            in_flight = [n for n, r in list(_owned.items()) if r.pid == pid and r.creating]
            if not in_flight or time.monotonic() >= deadline:
                return removed
            time.sleep(0.02)
    finally:
        if not final:
            _exiting = False


def _exit_client(address: str) -> Any:
    import docker

    from agentrl.sandbox.engine import engine_environment

    return docker.from_env(timeout=_EXIT_TIMEOUT_S, environment=engine_environment(address))


_atexit_pid: int | None = None
_signals_pid: int | None = None
_previous: dict[int, Any] = {}
_startup_thread: threading.Thread | None = None
_startup_pid: int | None = None
_warned_thread = False


def _on_signal(signum: int, frame: Any) -> None:
    previous = _previous.get(signum)
    # SIGTERM with no handler of the user's means death right after this: nothing may start
    # a new container any more. Anything else may go on (SIGINT is a catchable exception).
    remove_own_containers(final=not callable(previous))
    if previous is signal.default_int_handler:
        interrupt()  # KeyboardInterrupt, from the event loop when one runs here (not inside a task)
        return
    if callable(previous):
        previous(signum, frame)
        return
    # SIG_DFL (or a handler installed outside Python): die by the same signal, as if we were
    # never here, so the parent sees the real cause.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def install_signal_handlers() -> bool:
    """On the main thread, install (once per process) the SIGTERM/SIGINT handlers that remove this
    process's containers, whichever thread opened them, then defer to the handler that was there
    before (SIGINT still raises KeyboardInterrupt; SIGTERM still kills). Returns whether they are
    installed. Off the main thread it does nothing (Python allows signal handlers only there).

    agentrl calls this at every entry point that runs on the main thread: the CLI, `ToolEnv`,
    `rollout.collect`, `SandboxPool`, and every sandbox opened there. A program that opens
    sandboxes only from its own worker threads calls it once from its main thread.
    """
    global _signals_pid
    pid = os.getpid()
    if _signals_pid == pid:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    _signals_pid = pid
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(signum)
        if previous is signal.SIG_IGN:
            continue  # the process was told to ignore it (nohup): keep ignoring it
        if previous is _on_signal:
            continue  # inherited through fork: already ours, chaining to itself would loop
        _previous[signum] = previous
        signal.signal(signum, _on_signal)
    return True


def install_exit_handlers() -> None:
    """Once per process: the `atexit` removal of this process's containers, the signal handlers
    (when called on the main thread, or already installed from it), and the start-up reap of
    dead runs in a background thread. Every docker sandbox calls this when it opens."""
    global _atexit_pid, _startup_thread, _startup_pid, _warned_thread
    pid = os.getpid()
    if _atexit_pid != pid:
        _atexit_pid = pid
        atexit.register(remove_own_containers)
    if not install_signal_handlers() and not _warned_thread:
        _warned_thread = True
        log.warning(
            "a docker sandbox opened on a worker thread before agentrl's signal handlers were installed: "
            "SIGTERM/SIGINT would leave its container behind until the next start-up reap. Call "
            "agentrl.sandbox.install_exit_handlers() once from the main thread (agentrl's CLI, ToolEnv and "
            "rollout do)"
        )
    if _startup_pid != pid:
        _startup_pid = pid
        _startup_thread = threading.Thread(target=_quiet(reap), name="agentrl-reaper", daemon=True)
        _startup_thread.start()


def wait_startup_reap(timeout: float | None = None) -> None:
    """Block until this process's start-up reap has finished (for tests and tools)."""
    if _startup_thread is not None:
        _startup_thread.join(timeout)


def _quiet(fn: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        # Best effort: a failed start-up reap must never break the run that triggered it.
        with contextlib.suppress(Exception):
            fn()

    return run
