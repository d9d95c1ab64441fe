"""Find and remove sandbox containers that a crashed run left behind.

Every docker sandbox carries labels naming the process that owns it: `agentrl.host`,
`agentrl.pid`, `agentrl.pid_start` (the owner's start time in clock ticks since boot) and
`agentrl.boot_id`. A container is an orphan when its owner ran on this host and that exact
process is gone: the pid is dead, the pid was reused by a newer process (start time differs),
or the machine rebooted since (boot id differs). Containers owned by other hosts are never
judged: this machine cannot see their processes (use `reap(include_live=True)` there).

Three things call into here:
- `install_exit_handlers()`, once per process when its first docker sandbox opens: `atexit`
  and SIGTERM/SIGINT handlers remove the containers this process still holds, then defer to
  whatever handler was there before (SIGINT still raises KeyboardInterrupt);
- a start-up reap, once per process at the same moment, in a background thread, for runs
  that died by SIGKILL or OOM, where no handler could run;
- `agentrl sandbox reap [--all]`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import signal
import socket
import threading
import uuid
from collections.abc import Callable
from typing import Any

LABEL_RUN_ID = "agentrl.run_id"
LABEL_PID = "agentrl.pid"
LABEL_HOST = "agentrl.host"
LABEL_CREATED_AT = "agentrl.created_at"
LABEL_PID_START = "agentrl.pid_start"
LABEL_BOOT_ID = "agentrl.boot_id"

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
    removed: list[str] = []
    errors: list[BaseException] = []

    def worker(batch: list[str]) -> None:
        for cid in batch:
            try:
                if _remove(client, cid):
                    removed.append(cid)
            except Exception as exc:
                errors.append(exc)

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


def reap(include_live: bool = False, *, client: Any = None) -> list[str]:
    """Remove agentrl containers whose owning process is gone; returns their names.

    With `include_live=True` every agentrl container goes, live runs (this one included)
    and other hosts' too: for a machine you know is idle.
    """
    client = client or _client()
    found = client.api.containers(all=True, filters={"label": LABEL_RUN_ID})
    doomed: dict[str, str] = {}
    for c in found:
        if include_live or owner_alive(c.get("Labels") or {}) is False:
            name = (c.get("Names") or [c["Id"][:12]])[0].lstrip("/")
            doomed[c["Id"]] = name
    removed = _remove_many(client, list(doomed))
    return [doomed[cid] for cid in removed]


# --- this process's own containers -------------------------------------------------------

# Container ids this process created and has not closed yet, with the pid that created them:
# a forked child inherits this dict but must never remove its parent's containers.
_owned: dict[str, int] = {}
_owned_lock = threading.Lock()


def register(container_id: str) -> None:
    with _owned_lock:
        _owned[container_id] = os.getpid()


def unregister(container_id: str) -> None:
    with _owned_lock:
        _owned.pop(container_id, None)


def remove_own_containers() -> list[str]:
    """Remove every container this process created and has not closed (exit handlers call this)."""
    pid = os.getpid()
    # No lock: this runs inside signal handlers, which may interrupt a thread holding it.
    ids = [cid for cid, owner in list(_owned.items()) if owner == pid]
    if not ids:
        return []
    for cid in ids:
        _owned.pop(cid, None)
    try:
        # A fresh client: the handler may have interrupted the shared one mid-request.
        return _remove_many(_client(), ids)
    except Exception:
        return []  # the engine is gone; the next start-up reap finds them


_installed_pid: int | None = None
_previous: dict[int, Any] = {}
_startup_thread: threading.Thread | None = None


def _on_signal(signum: int, frame: Any) -> None:
    remove_own_containers()
    previous = _previous.get(signum)
    if callable(previous):
        previous(signum, frame)  # for SIGINT: default_int_handler raises KeyboardInterrupt
        return
    # SIG_DFL (or a handler installed outside Python): die by the same signal, as if we were
    # never here, so the parent sees the real cause.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def install_exit_handlers() -> None:
    """Install, once per process, the handlers that remove this process's containers on exit,
    and start the once-per-process reap of dead runs.

    Signal handlers can only be set from the main thread; from another thread only `atexit`
    is installed (SIGKILL-style deaths are then still covered by the start-up reap).
    """
    global _installed_pid, _startup_thread
    pid = os.getpid()
    if _installed_pid == pid:
        return
    _installed_pid = pid
    atexit.register(remove_own_containers)
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN:
                continue  # the process was told to ignore it (nohup): keep ignoring it
            if previous is _on_signal:
                continue  # inherited through fork: already ours, chaining to itself would loop
            _previous[signum] = previous
            signal.signal(signum, _on_signal)
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
