"""Killing a sandbox's processes from the host, through its cgroup: nothing is started inside it.

Why: a killer that runs *inside* the sandbox (a `docker exec` of a script) needs a new process
there, and a fork bomb holds every pid the sandbox's pids limit allows: the exec waits for a free
slot (seconds, tens of seconds) or fails, and the timeout it serves stretches with it. From the
host, the cgroup lists every process of the sandbox, its freezer stops them all at once (so the
bomb cannot fork faster than the killer kills), and `kill(2)` from the host needs no pid of the
sandbox's.

What it needs: the sandbox's processes visible in this host's /proc (the docker engine runs on
this machine, not a remote one), a cgroup freezer (v1 `freezer.state`, or v2 `cgroup.freeze`)
this process may write, and permission to signal them (root, or their owner).
`CgroupView.of_process` returns None when the first two are missing, and `CgroupView.kill`
False when a process cannot be signalled; callers then fall back to their in-sandbox killers.

Frozen processes and SIGKILL: on cgroup v2 a frozen process dies of SIGKILL at once; on v1 the
signal stays pending until the thaw, and the process dies then, before it runs another
instruction of its own (a fork in flight is abandoned when a fatal signal is pending). Either
way, nothing the frozen processes do can outrun one freeze-kill-thaw round.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CLK_TCK", "CgroupView", "Proc", "host_gid", "host_uid", "uptime_ticks"]

# How long one freeze may take to settle before the round goes on without it (a task in an
# uninterruptible sleep, e.g. on a slow disk, freezes late; its SIGKILL still lands).
_FREEZE_SETTLE_S = 1.0
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class Proc:
    """One live process of the cgroup, as this host's /proc shows it."""

    pid: int
    ppid: int
    uid: int
    """Real uid, in this host's user namespace."""
    start_ticks: int
    """Start time in clock ticks after boot (`/proc/<pid>/stat` field 22)."""
    _environ: list[bytes] | None = field(default=None, repr=False)

    def environ(self) -> list[bytes]:
        """Its environment entries (`KEY=value`); empty when unreadable (gone, or not ours to read).

        Read through any of its threads: a leader thread that exited has no memory left to
        read it from, while the process runs on in its other threads."""
        if self._environ is None:
            data = _read_bytes(f"/proc/{self.pid}/environ")
            if not data:
                with contextlib.suppress(OSError):
                    for tid in os.listdir(f"/proc/{self.pid}/task"):
                        if data := _read_bytes(f"/proc/{self.pid}/task/{tid}/environ"):
                            break
            self._environ = data.split(b"\0") if data else []
        return self._environ


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _read_proc(pid: int) -> Proc | None:
    """`pid`'s entry, or None when it is gone or already dead (a zombie, or exiting).

    A leader thread that exited shows as a zombie while its other threads run on (and fork):
    such a process is alive."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
    except OSError:
        return None
    try:
        # The command name may hold spaces and parentheses: the fields start after the last ")".
        rest = stat[stat.rindex(b")") + 2 :].split()
        fields = {k: v.split() for k, _, v in (line.partition(b":") for line in status.splitlines())}
        if rest[0] in (b"Z", b"X", b"x") and int(fields[b"Threads"][0]) <= 1:
            return None
        uid = int(fields[b"Uid"][0])
        return Proc(pid=pid, ppid=int(rest[1]), uid=uid, start_ticks=int(rest[19]))
    except (ValueError, IndexError, KeyError):
        return None


def _tgid(tid: int) -> int:
    """The process of thread `tid` (itself when gone: then it is dropped later, unreadable)."""
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return tid


def uptime_ticks() -> float:
    """Now, in the clock ticks of `Proc.start_ticks`."""
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) * CLK_TCK


def host_uid(pid: int, uid: int) -> int | None:
    """The host's uid of `uid` inside the user namespace of process `pid` (docker's userns-remap
    shifts them), or None when that namespace does not map it."""
    return _host_id(pid, uid, "uid_map")


def host_gid(pid: int, gid: int) -> int | None:
    """`host_uid` for a group id."""
    return _host_id(pid, gid, "gid_map")


def _host_id(pid: int, value: int, table: str) -> int | None:
    try:
        lines = Path(f"/proc/{pid}/{table}").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            inside, outside, count = (int(x) for x in line.split())
        except ValueError:
            continue
        if inside <= value < inside + count:
            return outside + value - inside
    return None


@dataclass(frozen=True)
class _Hierarchy:
    """One mounted cgroup hierarchy: where it is mounted and which cgroup is its mount's root."""

    mountpoint: Path
    root: str
    v2: bool
    controllers: frozenset[str]

    def dir_of(self, path: str) -> Path | None:
        """The directory of the cgroup at `path` (as /proc/<pid>/cgroup names it), if mounted here."""
        root = self.root.rstrip("/")
        if path != root and not path.startswith(root + "/"):
            return None
        return self.mountpoint / path[len(root) :].lstrip("/")


def _unescape(field_: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as three octal digits.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field_)


@functools.cache
def _hierarchies() -> tuple[_Hierarchy, ...]:
    found: list[_Hierarchy] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            left, sep, right = line.partition(" - ")
            if not sep:
                continue
            fields, after = left.split(), right.split()
            if len(fields) < 5 or len(after) < 3 or after[0] not in ("cgroup", "cgroup2"):
                continue
            v2 = after[0] == "cgroup2"
            options = frozenset(after[2].split(","))
            found.append(_Hierarchy(Path(_unescape(fields[4])), _unescape(fields[3]), v2, options))
    return tuple(found)


class CgroupView:
    """One sandbox's cgroup as the host sees it: list, freeze, kill. Thread-safe enough for one
    sandbox's calls (each freeze is undone before the call returns)."""

    def __init__(self, directory: Path, *, v2: bool, init_pid: int = 0) -> None:
        self.dir = directory
        self.v2 = v2
        self.init_pid = init_pid
        """The sandbox's PID 1 as the host sees it (docker-init), never killed here; 0: none."""

    @classmethod
    def of_process(cls, pid: int, *, expect: str) -> CgroupView | None:
        """The freezer cgroup of host process `pid` when its path names `expect` (the container's
        id: a pid that means another process here, as in an engine behind a remote socket, does
        not pass) and this process may freeze it; otherwise None."""
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            return None
        v1: Path | None = None
        v2: Path | None = None
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if expect not in path:
                continue
            for h in _hierarchies():
                if h.v2 and controllers == "" and (d := h.dir_of(path)) is not None:
                    v2 = d
                elif not h.v2 and "freezer" in controllers.split(",") and "freezer" in h.controllers:
                    v1 = h.dir_of(path)
        # A v1 freezer, where there is one, is what holds the container (on a hybrid host the
        # v2 hierarchy has no controllers and docker leaves its processes at the root there).
        for directory, is_v2 in ((v1, False), (v2, True)):
            if directory is None:
                continue
            control = directory / ("cgroup.freeze" if is_v2 else "freezer.state")
            listing = directory / ("cgroup.threads" if is_v2 else "tasks")
            if os.access(control, os.W_OK) and os.access(listing, os.R_OK):
                return cls(directory, v2=is_v2, init_pid=pid)
        return None

    # -- looking ---------------------------------------------------------------------------

    def pids(self) -> set[int]:
        """Every process with a thread in the cgroup or the cgroups below it (none can be made
        from inside, but a sub-cgroup must not hide a process).

        Threads are listed (v1 `tasks`, v2 `cgroup.threads`), then mapped to their process:
        `cgroup.procs` leaves out a process whose leader thread exited while its other threads
        run on, and such a process forks as well as any."""
        listing = "cgroup.threads" if self.v2 else "tasks"
        found: set[int] = set()
        for dirpath, _, files in os.walk(self.dir):
            if listing in files:
                with contextlib.suppress(OSError, ValueError):
                    for tid in Path(dirpath, listing).read_text().split():
                        found.add(_tgid(int(tid)))
        return found

    def procs(self) -> list[Proc]:
        """The cgroup's live processes, its PID 1 left out."""
        out = []
        for pid in self.pids():
            if pid != self.init_pid and (proc := _read_proc(pid)) is not None:
                out.append(proc)
        return out

    # -- freezing --------------------------------------------------------------------------

    def _write(self, name: str, value: str) -> bool:
        try:
            (self.dir / name).write_text(value)
            return True
        except OSError:
            return False

    def _frozen_now(self) -> bool:
        try:
            if self.v2:
                return "frozen 1" in (self.dir / "cgroup.events").read_text().splitlines()
            return (self.dir / "freezer.state").read_text().strip() == "FROZEN"
        except OSError:
            return False

    @contextlib.contextmanager
    def frozen(self) -> Iterator[bool]:
        """Freeze every process of the cgroup for the block; yields whether the freeze settled.
        Always thawed on the way out, whatever the block raised."""
        ok = self._write("cgroup.freeze", "1") if self.v2 else self._write("freezer.state", "FROZEN")
        settled = False
        try:  # from the write on: whatever happens while it settles, the thaw below runs
            if ok:
                deadline = time.monotonic() + _FREEZE_SETTLE_S
                while not (settled := self._frozen_now()) and time.monotonic() < deadline:
                    time.sleep(0.001)
            yield settled
        finally:
            if ok:
                if self.v2:
                    self._write("cgroup.freeze", "0")
                else:
                    self._write("freezer.state", "THAWED")

    # -- killing ---------------------------------------------------------------------------

    def kill(self, select: Callable[[list[Proc]], Iterable[int]], *, timeout_s: float = 5.0) -> bool:
        """SIGKILL what `select` picks from the cgroup's live processes, frozen, round after round
        until a round picks nothing, then wait (within `timeout_s`) until their pids are free.
        True then; False when `timeout_s` ran out first or a pick could not be signalled (not
        ours: the caller falls back to another killer)."""
        deadline = time.monotonic() + timeout_s
        killed: set[int] = set()
        while True:
            with self.frozen():
                picked = set(select(self.procs()))
                for pid in picked:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    except PermissionError:
                        return False
            if not picked:
                break
            killed |= picked
            if time.monotonic() > deadline:
                return False
            # Thawed: on cgroup v1 the killed die now; give them a moment before the next look.
            time.sleep(0.002)
        # Killed is not yet gone: the cgroup lists a process until its exit is through (on v1,
        # after the thaw), and only then can its parent reap it and free its pid for the pids
        # limit. The caller's next command needs those pids.
        while killed & self.pids() and time.monotonic() < deadline:
            time.sleep(0.002)
        return True
