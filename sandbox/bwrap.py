"""`bwrap`: bubblewrap sandboxes, daemonless, for GPU nodes without Docker.

How an exec runs
----------------
The agent's commands run through the sandbox's *resident executor* (`agentrl.sandbox.executor`,
on unless `SandboxSpec.executor=False`): one long-lived bwrap, started with the sandbox, whose
PID 1 is the executor itself (`--as-pid-1`), over the agent's view of the sandbox. Each command
is its child: a fork and two pipe hops instead of setting up namespaces again (a few ms against
30-40 ms). Being PID 1 of its pid namespace, the executor is out of the agent's reach: the kernel
drops every signal sent to a namespace's init from inside it, and the executor is non-dumpable
(no ptrace, no /proc/1/fd). What an exec leaves behind dies with it, as before: the executor
kills its marked processes and their descendants when it ends, and every process but itself
once no other exec runs (on a timeout too). If the executor itself is ever overdue, the whole
resident bwrap is killed (its pid namespace and everything in it) and the next command starts
a new one. `privileged` and `as_verifier` execs never use it.

Those, and every exec with the executor off, are one fresh `bwrap` invocation each over the
sandbox's persistent workspace and /tmp, so files persist across execs while every process dies
with its exec: a per-exec pid namespace makes "kill the whole tree on timeout" exact (the
namespace dies with its init; setsid, nohup, double forks and scrubbed environments cannot
escape it). Either way a background process (`server &`) does not outlive the exec that started
it (on docker it does).

One long-lived process per sandbox does exist, for the disk cap only: the *tmpfs holder*
(`TmpfsHolder`), a `read` on a pipe inside a user + mount namespace of ours where size-capped
tmpfs mounts cover the workspace and /tmp directories. Any user may mount a tmpfs in a user
namespace of their own, so this works without root. Each exec `nsenter`s that namespace and
runs bwrap from there (the entered capabilities vanish at bwrap's execve, since the uid is
not 0 there). The holder dies when this Python process does (EOF on its pipe), and the
kernel frees the tmpfs with it. Without nsenter or nested user namespaces, the sandbox falls
back to plain directories and a per-file cap (see `sandbox.enforcement.disk`).

The file system
---------------
- "/" is the image's root file system, bound read-only. It is exported once from the local
  Docker image into `$XDG_CACHE_HOME/agentrl/rootfs/<image-id>` (default `~/.cache/...`;
  `docker create` + `export` through the SDK, device nodes skipped, setuid/setgid bits
  stripped), and found again by tag without Docker through `rootfs/tags/`. On a machine
  without Docker, set `AGENTRL_BWRAP_ROOTFS=/path/to/rootfs` (a directory holding an
  exported root file system, e.g. copied from `python -m agentrl.sandbox.bwrap export
  agentrl/base:bookworm DEST` run where Docker is): it is used for every image.
- `workdir` (/workspace) and /tmp: per-sandbox, writable, persistent across execs,
  size-capped tmpfs (`disk_mb` each). The host side reaches them at `sandbox.host_workdir`
  and `sandbox.host_tmp` (under /proc/<holder>/root).
- /verifier (`PROTECTED_DIR`): a per-sandbox tmpfs (capped like the workspace) bound
  READ-ONLY into agent execs; the host reaches it at `sandbox.host_protected`. bwrap
  cannot switch users (inside, the single mapped uid is 1000, which is the user who ran
  bwrap), so the verifier's side is the host: `write_file`/`copy_in` with
  `privileged=True` write it from the host side directly, and `exec(privileged=True)` binds it
  read-write. Files therefore show as owned by `agent` inside; the read-only bind, not
  ownership, is what keeps the agent out.
- The image's root-only paths (`private_paths`: directories other users cannot enter, files
  they cannot read, e.g. a task image's pristine source, /root, /etc/shadow): on docker their
  permission bits hide them from the agent; here the one uid owns every exported file, so
  every exec but a privileged one gets an empty read-only tmpfs (a directory) or /dev/null
  (a file) over each, and the host-side file methods refuse them.
- The verifier identity (`exec(as_verifier=True)`, which runs the agent's code for a
  verifier): the same masks, the workspace and /verifier bound read-only, and a fresh /tmp of
  its own (a directory in the /verifier tmpfs, removed after the exec).

What the sandbox can read about its host: bwrap's own process is PID 1 inside, so its options
(host paths, `--setenv` values) go through a file descriptor (`--args`), never its argv, and
it runs with an empty environment: /proc/1/cmdline shows `bwrap --args N -- prlimit ... --
<command>` and /proc/1/environ nothing of the host. /proc/self/mountinfo still names the
exported root file system's host directory (as docker's shows its overlay directories).
- /proc is a fresh procfs of the exec's pid namespace; /dev is bwrap's minimal /dev (null,
  zero, random, urandom, tty, pts) made read-only, with a 64 MiB tmpfs /dev/shm.

Isolation: `--unshare-all` (user, mount, pid, net, ipc, uts, cgroup namespaces; the
network comes back only with `limits.network` via `--share-net`), `--disable-userns` (no
nested user namespaces), `--die-with-parent` (per-exec bwraps; the resident executor's ends
on EOF from us instead), `--new-session` (no TIOCSTI into our tty),
`--cap-drop ALL`, no_new_privs (bwrap always sets it), `--clearenv`, uid/gid 1000.

Limits: what bwrap enforces
---------------------------
Two paths, chosen per sandbox at start and recorded in `sandbox.enforcement`:
"cgroup" when this process can create cgroups (root on cgroup v1, or a writable cgroup v2
subtree with the controllers delegated), else "rlimit" (any unprivileged user).

=================  ============================================  =============================================
Limits field       cgroup path (root / delegated cgroups)        rlimit path (unprivileged user)
=================  ============================================  =============================================
memory_mb          ENFORCED in aggregate: memory (+memsw) limit  PER PROCESS only: RLIMIT_AS=memory_mb. N
                   of the sandbox's cgroup, tmpfs pages          processes may use N x memory_mb together;
                   included; the OOM killer answers (-9).        allocation fails (MemoryError), no OOM kill.
                                                                 SysV shm of the exec's ipc namespace is
                                                                 outside RLIMIT_AS until the exec ends.
pids               ENFORCED: pids.max of the cgroup, all execs   ENFORCED per bwrap: RLIMIT_NPROC=pids, set
                   together.                                     *inside* the new user namespace (the kernel
                                                                 counts per uid per user namespace: the
                                                                 agent's commands, through the resident
                                                                 executor, count together). The
                                                                 kernel exempts host root from RLIMIT_NPROC:
                                                                 root gets cgroups instead.
cpus               ENFORCED: cfs quota.                          NOT enforced (no rlimit expresses a share).
disk_mb            ENFORCED: size-capped tmpfs on /workspace     ENFORCED (same, unprivileged). Fallback when
                   and /tmp (ENOSPC), /dev/shm 64 MiB.           the holder cannot start: RLIMIT_FSIZE per
                                                                 file only; many files can fill the host disk.
network            ENFORCED: own empty net namespace.            ENFORCED (same).
exec_timeout_s     ENFORCED. Through the executor: the command's ENFORCED (same; without the freezer, a
                   process group stopped and killed, then every  late executor's namespace is killed
                   process a /proc scan finds of it (all but the outright).
                   executor when alone); a late reply: the
                   resident's processes frozen and killed, its
                   namespace with them. Per exec: its processes
                   frozen and killed, then SIGKILL of bwrap.
output_limit_bytes ENFORCED while reading (by the executor       ENFORCED (same).
                   inside, else on the host side).
=================  ============================================  =============================================

RLIMIT_* are set inside the sandbox with the rootfs's `prlimit` (util-linux, in every
Debian/Ubuntu root file system), after the user namespace exists: set outside, RLIMIT_NPROC
would also be charged against every process the host user runs (a training job's threads
included), and forks would fail for reasons outside the sandbox.

Exit codes: bwrap reports a command killed by signal N as 128+N; `exec` turns 129..159
back into -N, as the protocol (and `subprocess`) say.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NoReturn, Unpack

from agentrl.sandbox.base import (
    AGENT_UID,
    AGENT_USER,
    PROTECTED_DIR,
    Capabilities,
    ExecRequest,
    ExecResult,
    Identity,
    SandboxBase,
    SandboxDead,
    SandboxError,
    SandboxSpec,
    SpecFields,
    signal_exit,
)
from agentrl.sandbox.executor import (
    ExecutorLost,
    ExecutorSlot,
    ExecutorUnavailable,
    Pipes,
    ResidentExecutor,
    launch_argv,
)
from agentrl.sandbox.hostfs import HostView, Mount
from agentrl.sandbox.hostkill import Proc
from agentrl.sandbox.hostlimits import Cgroups, TmpfsHolder
from agentrl.sandbox.process import kill_group, run_capped
from agentrl.sandbox.reaper import process_start_ticks
from agentrl.sandbox.rootfs import (
    ROOTFS_ENV,
    export_rootfs,
    find_rootfs,
    private_paths,
)
from agentrl.sandbox.rootfs import cached_rootfs as cached_rootfs  # (importable from here, as before)
from agentrl.sandbox.rootfs import rootfs_cache_dir as rootfs_cache_dir

_PRLIMIT_PATHS = ("usr/bin/prlimit", "bin/prlimit")
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Bound on the frozen kill of a timed-out exec's processes (milliseconds for a full pids limit).
_KILL_EXEC_S = 5.0


# --------------------------------------------------------------------------------------
# bwrap itself (its root file system: agentrl.sandbox.rootfs)
# --------------------------------------------------------------------------------------


def bwrap_binary() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxError(
            "bubblewrap is not installed (no `bwrap` on PATH); install it (`apt-get install bubblewrap`, "
            "`dnf install bubblewrap`) or use another backend; `agentrl sandbox doctor` checks them all"
        )
    return path


def _descendants(procs: list[Proc], pid: int) -> set[int]:
    """`pid` and every process below it, of those among `procs` (by parent pid)."""
    children: dict[int, list[int]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p.pid)
    found = {pid} if any(p.pid == pid for p in procs) else set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


class _Resident:
    """The host's handle on a sandbox's resident executor: the outer bwrap (our child) and the
    executor itself, PID 1 of the sandbox's pid namespace (`pid` on the host; killing it ends
    the namespace and every process in it)."""

    def __init__(self, proc: subprocess.Popen[bytes], pid: int, start_ticks: str) -> None:
        self.proc = proc
        self.pid = pid
        self.start_ticks = start_ticks

    def descendants(self) -> set[int]:
        """The executor and every process under it (its commands), by this host's /proc."""
        procs = []
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    stat_ = Path(f"/proc/{entry.name}/stat").read_bytes()
                    procs.append(Proc(int(entry.name), int(stat_[stat_.rindex(b")") + 2 :].split()[1]), 0, 0))
        return _descendants(procs, self.pid) if self.alive() else set()

    def alive(self) -> bool:
        return bool(self.start_ticks) and process_start_ticks(self.pid) == self.start_ticks

    def kill(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, signal.SIGKILL)
        kill_group(self.proc)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        # Its stdout and stderr are closed by the executor's reader thread, at their EOF.
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()


class _Residents:
    """The resident executor a sandbox has now (restarts replace it), for its finalizer."""

    def __init__(self) -> None:
        self.current: _Resident | None = None

    def kill(self) -> None:
        current, self.current = self.current, None
        if current is not None:
            current.kill()


def _cleanup(
    root: Path, holder: TmpfsHolder | None, cgroups: Cgroups | None, residents: _Residents | None = None
) -> None:
    """Everything a sandbox holds on the host. Runs from close() and, if close() was never
    called, when the sandbox is garbage collected or the interpreter exits."""
    if residents is not None:
        residents.kill()
    if cgroups is not None:
        cgroups.remove()
    if holder is not None:
        holder.stop()
    shutil.rmtree(root, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_stale(tmpdir: str | None = None) -> list[str]:
    """Remove what bwrap sandboxes of dead processes left behind; return their ids.

    close() (or garbage collection, or interpreter exit) cleans up normally; a process that
    was SIGKILLed leaves its directories, its tmpfs mounts (RAM!) and its cgroups. Each
    sandbox's directory records its owner pid in sandbox.json; only sandboxes whose owner is
    gone are touched. Runs once per process when the first bwrap sandbox opens.
    """
    reaped: list[str] = []
    base = Path(tmpdir or tempfile.gettempdir())
    for root in base.glob("agentrl-bwrap-*"):
        try:
            meta = json.loads((root / "sandbox.json").read_text())
            sid, pid = str(meta["id"]), int(meta["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # still being created, or not ours
        if _pid_alive(pid):
            continue
        # Its resident executor ends on EOF when its owner dies; one that was frozen would not.
        executor = meta.get("executor") or []
        if len(executor) == 2 and process_start_ticks(int(executor[0])) == str(executor[1]):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(executor[0]), signal.SIGKILL)
        groups = [Path(d) for d in meta.get("cgroups", []) if Path(d).is_dir()]
        _cleanup(root, None, Cgroups(groups) if groups else None)
        reaped.append(sid)
    return reaped


_reaped_once = False


@dataclass(frozen=True)
class Enforcement:
    """How this sandbox enforces each limit (see the module docstring's table)."""

    memory: str
    pids: str
    cpus: str
    disk: str
    network: str = "namespace"
    timeout: str = "pid namespace killed"


# --------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------


class BwrapSandbox(SandboxBase):
    """A bubblewrap sandbox over persistent dirs: the agent's commands through a resident executor
    (one long-lived bwrap), the others one fresh bwrap (own namespaces) each."""

    backend = "bwrap"
    # One uid, so no separate users, but a verifier identity by mount view; every process of an
    # exec dies with it (see the module docstring).
    capabilities = Capabilities(
        isolated=True,
        network_isolation=True,
        protected_dir=True,
        verifier_identity=True,
        resident_executor=True,
    )

    def __init__(self, spec: SandboxSpec | None = None, **fields: Unpack[SpecFields]) -> None:
        super().__init__(spec, **fields)
        workdir = self.workdir
        self._bwrap = bwrap_binary()
        self.rootfs = find_rootfs(self.image)
        self._private = private_paths(self.rootfs)
        self._prlimit = next((f"/{p}" for p in _PRLIMIT_PATHS if (self.rootfs / p).exists()), None)
        if self._prlimit is None:
            raise SandboxError(
                f"the root file system {self.rootfs} has no prlimit (util-linux), which bwrap sandboxes use to "
                "set per-process limits inside the sandbox; add util-linux to the image"
            )
        if not (self.rootfs / workdir.lstrip("/")).is_dir():
            raise SandboxError(
                f"workdir {workdir!r} does not exist in the root file system {self.rootfs}; bwrap binds the "
                "workspace over an existing directory (the read-only rootfs cannot grow one): create it in the "
                "image, or use the default /workspace"
            )

        global _reaped_once
        if not _reaped_once:
            _reaped_once = True
            reap_stale()
        self._root = Path(tempfile.mkdtemp(prefix=f"agentrl-{self.id}-"))
        self._holder: TmpfsHolder | None = None
        self._cgroups: Cgroups | None = None
        try:
            cg_note, holder_note = self._setup_host_side()
        except BaseException:
            _cleanup(self._root, self._holder, self._cgroups)  # a half-built sandbox leaves nothing
            raise
        self.enforcement = self._enforcement(cg_note, holder_note)
        self._residents = _Residents()
        self._finalizer = weakref.finalize(
            self, _cleanup, self._root, self._holder, self._cgroups, self._residents
        )
        self.files = self._host_view()
        self._running: set[subprocess.Popen[bytes]] = set()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._executor = ExecutorSlot(self._start_executor, enabled=self.spec.executor)
        self._trial_run()

    def _enforcement(self, cg_note: str, holder_note: str) -> Enforcement:
        """How each limit is enforced here (cgroups, a tmpfs holder, or rlimits), said as it is."""
        cg = self._cgroups is not None
        return Enforcement(
            memory="cgroup (aggregate)" if cg else "RLIMIT_AS (per process)",
            pids=(
                "cgroup pids.max"
                if cg
                else "RLIMIT_NPROC (per bwrap: the agent's commands together)"
                if os.geteuid() != 0
                else f"NOT enforced ({cg_note}; root is exempt from RLIMIT_NPROC)"
            ),
            cpus="cgroup cfs quota" if cg else f"NOT enforced ({cg_note})",
            disk=(
                "tmpfs size cap (workspace and /tmp)"
                if self._holder
                else f"RLIMIT_FSIZE (per file only; {holder_note})"
            ),
            network="shared with host (limits.network)" if self.limits.network else "namespace (none)",
        )

    def _host_view(self) -> HostView:
        """The host-side file access: the rootfs read-only, the bound directories, the masked paths."""
        workdir = self.workdir
        return HostView(
            [
                Mount("/", self.rootfs, agent_writable=False, privileged_writable=False),
                Mount(workdir, self.host_workdir, agent_writable=True, privileged_writable=True),
                Mount("/tmp", self.host_tmp, agent_writable=True, privileged_writable=True),
                Mount(PROTECTED_DIR, self.host_protected, agent_writable=False, privileged_writable=True),
                Mount("/proc", None, agent_writable=False, privileged_writable=False),
                Mount("/dev", None, agent_writable=False, privileged_writable=False),
                # Masked in every exec but privileged ones: the host side must not read them either.
                *(Mount(p, None, agent_writable=False, privileged_writable=False) for p in self._private),
            ],
            workdir,
        )

    def _trial_run(self) -> None:
        """One trial run, so a broken setup fails here, with bwrap's own words, not at the first tool
        call; it starts the resident executor (or finds it cannot run here)."""
        try:
            trial = self.exec(["/bin/true"], timeout=30)
        except BaseException:
            self.close()
            raise
        if not trial.ok:
            self.close()
            raise SandboxError(
                f"bwrap could not start a sandbox (exit {trial.exit_code}): {trial.stderr.strip() or trial.stdout.strip()}; "
                "run `agentrl sandbox doctor` to see what this machine allows"
            )

    def _setup_host_side(self) -> tuple[str, str]:
        """Directories, tmpfs holder and cgroups; returns why cgroups / the holder are missing, if so."""
        self._write_meta()  # first thing: a crash from here on is found by reap_stale()
        # The directories bwrap binds (as seen in the holder's mount namespace, if any)...
        self._ws_dir = self._root / "workspace"
        self._tmp_dir = self._root / "tmp"
        self._prot_dir = self._root / "verifier"
        for d in (self._ws_dir, self._tmp_dir, self._prot_dir):
            d.mkdir()
        # /verifier is capped too: a privileged exec binds it read-write and runs agent code.
        self._holder, holder_note = TmpfsHolder.start(
            self._bwrap, [self._ws_dir, self._tmp_dir, self._prot_dir], self.limits.disk_mb
        )
        # ...and where the host side reaches them.
        self.host_workdir = self._holder.path(self._ws_dir) if self._holder else self._ws_dir
        self.host_tmp = self._holder.path(self._tmp_dir) if self._holder else self._tmp_dir
        self.host_protected = self._holder.path(self._prot_dir) if self._holder else self._prot_dir
        self._cgroups, cg_note = Cgroups.create(self.id, self.limits)
        self._write_meta()
        return cg_note, holder_note

    def _write_meta(self) -> None:
        """What reap_stale() needs to clean up after this process if it dies without close()."""
        meta = {
            "id": self.id,
            "pid": os.getpid(),
            "image": self.image,
            "labels": self.labels,
            "cgroups": [str(d) for d in self._cgroups.dirs] if self._cgroups else [],
            "executor": [resident.pid, resident.start_ticks]
            if (resident := getattr(self, "_residents", _Residents()).current) is not None
            else [],
        }
        tmp = self._root / "sandbox.json.tmp"
        tmp.write_text(json.dumps(meta) + "\n")
        os.replace(tmp, self._root / "sandbox.json")

    # -- commands -------------------------------------------------------------------------

    def _options(
        self,
        env: Mapping[str, str],
        identity: Identity,
        scratch: Path | None,
        *,
        resident: bool = False,
    ) -> list[str]:
        """bwrap's options for one exec. They reach bwrap through a file descriptor
        (`--args`), never its argv: bwrap's own process is PID 1 inside the sandbox, and its
        command line (host paths, environment values) is readable at /proc/1/cmdline.

        `resident`: the resident executor's bwrap. It is PID 1 itself (`--as-pid-1`: no signal
        from inside reaches it), and lives past the thread that started it, so no
        `--die-with-parent` (which follows that thread): it ends on EOF from us instead.
        Its descriptors are its channel to us, and the one mapped uid owns every process's /proc
        entries when the host runs bwrap as root, so they would list: empty read-only tmpfs over its
        `fd` and `fdinfo` (and its thread's) leave nothing to list. A relay (`attach`) is not PID 1
        and does not exist yet when bwrap mounts /proc, so it cannot be masked so; it makes itself
        non-dumpable instead, and opening its descriptors takes ptrace access the agent lacks."""
        lim = self.limits
        args = ["--unshare-all", "--unshare-user", "--disable-userns"]
        if lim.network:
            args += ["--share-net", "--ro-bind-try", "/etc/resolv.conf", "/etc/resolv.conf"]
        args += ["--as-pid-1"] if resident else ["--die-with-parent"]
        args += [
            "--new-session",
            "--cap-drop", "ALL",
            "--uid", str(AGENT_UID),
            "--gid", str(AGENT_UID),
            "--hostname", "agentrl",
            "--ro-bind", str(self.rootfs), "/",
        ]  # fmt: skip
        if identity != "privileged":
            # The image's root-only paths (a pristine source, /root, /etc/shadow): on docker
            # their permission bits hide them from the agent and the verifier identity; here
            # the one uid owns them, so they are covered. Only privileged execs see them.
            for path in self._private:
                if (self.rootfs / path.lstrip("/")).is_dir():
                    args += ["--tmpfs", path, "--remount-ro", path]
                else:
                    args += ["--ro-bind", "/dev/null", path]
        args += [
            "--proc", "/proc",
            "--dev", "/dev",
            # bwrap's /dev is a writable tmpfs sized at half the RAM: cap /dev/shm like docker
            # (64 MiB) and make the rest read-only, or it is a memory bomb outside every rlimit.
            "--size", str(min(64, lim.disk_mb) << 20), "--tmpfs", "/dev/shm",
            "--remount-ro", "/dev",
        ]  # fmt: skip
        if resident:
            for sub in ("fd", "fdinfo", "task/1/fd", "task/1/fdinfo"):
                args += ["--tmpfs", f"/proc/1/{sub}", "--remount-ro", f"/proc/1/{sub}"]
        if identity == "verifier":
            # Reads the workspace and /verifier, writes neither: its writable places are a fresh
            # /tmp of its own (not the agent's), inside the capped /verifier tmpfs, and the log
            # folder a verifier prepared for it there (/verifier/logs, where a Harbor test script
            # writes its reward; on docker the verifier uid writes it as well).
            assert scratch is not None
            args += [
                "--ro-bind", str(self._ws_dir), self.workdir,
                "--bind", str(scratch), "/tmp",
                "--ro-bind", str(self._prot_dir), PROTECTED_DIR,
                "--bind-try", str(self._prot_dir / "logs"), f"{PROTECTED_DIR}/logs",
            ]  # fmt: skip
        else:
            args += [
                "--bind", str(self._ws_dir), self.workdir,
                "--bind", str(self._tmp_dir), "/tmp",
                "--bind" if identity == "privileged" else "--ro-bind", str(self._prot_dir), PROTECTED_DIR,
            ]  # fmt: skip
        args += ["--chdir", self.workdir, "--clearenv"]
        for key, value in env.items():
            args += ["--setenv", key, value]
        return args

    def _argv(self, argv: list[str], options_fd: int) -> list[str]:
        """The host command line: only `bwrap --args FD`, then the command (prlimit's limits
        and the agent's own command are all that show inside)."""
        lim = self.limits
        args = [self._bwrap, "--args", str(options_fd)]
        # Limits set inside the new user namespace (see the module docstring for why).
        args += ["--", self._prlimit, f"--nproc={lim.pids}"]
        if self._cgroups is None:
            args += [f"--as={lim.memory_mb << 20}"]
        if self._holder is None:
            # No size-capped tmpfs: a per-file cap is all that stands between a fill and the disk.
            # (With the tmpfs it would only turn a clean ENOSPC into SIGXFSZ at the same size.)
            args += [f"--fsize={lim.disk_mb << 20}"]
        args += ["--", *argv]
        if self._holder is not None:
            args = [*self._holder.enter(), *args]
        if self._cgroups is not None:
            # Join the cgroups before bwrap forks anything, from a host shell that then becomes bwrap.
            joins = " && ".join(f"echo $$ > {shlex.quote(f)}" for f in self._cgroups.procs_files())
            args = ["/bin/sh", "-c", f'{joins} && exec "$@"', "agentrl-cgroup-join", *args]
        return args

    def _base_env(self) -> dict[str, str]:
        return {
            "PATH": _PATH,
            "HOME": self.workdir,
            "USER": AGENT_USER,
            "LOGNAME": AGENT_USER,
            "LANG": "C.UTF-8",
            **self.env,
        }

    # -- the resident executor --------------------------------------------------------------

    def _start_executor(self) -> ResidentExecutor:
        """One long-lived bwrap whose PID 1 is the executor, over the agent's view of the sandbox."""
        try:
            proc = self._spawn_piped(launch_argv(), resident=True)
        except OSError as exc:
            raise ExecutorUnavailable(f"could not start bwrap for it: {exc}") from exc
        executor = ResidentExecutor(Pipes(proc), name=self.id, workdir=self.workdir)
        try:
            executor.start(reap=True)
            pid = int(Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()[0])
        except (ExecutorUnavailable, ExecutorLost, OSError, ValueError, IndexError) as exc:
            executor.close()
            _Resident(proc, 0, "").kill()
            why = exc.why if isinstance(exc, ExecutorLost) else str(exc)
            raise ExecutorUnavailable(why) from exc
        self._residents.kill()  # a retired one, if it still lingers
        self._residents.current = _Resident(proc, pid, process_start_ticks(pid))
        self._write_meta()
        return executor

    def _spawn_piped(self, argv: list[str], *, resident: bool) -> subprocess.Popen[bytes]:
        """A bwrap running `argv` as the agent, its stdin, stdout and stderr ours (`resident`: as PID 1)."""
        options = self._options(self._base_env(), "agent", None, resident=resident)
        options_fd = os.memfd_create("agentrl-bwrap-args", 0)
        try:
            os.write(options_fd, b"\0".join(a.encode() for a in options) + b"\0")
            os.lseek(options_fd, 0, os.SEEK_SET)
            return subprocess.Popen(
                self._argv(argv, options_fd),
                cwd="/",
                env={},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=(options_fd,),
            )
        finally:
            os.close(options_fd)

    def attach(self, argv: Sequence[str]) -> Pipes:
        """`argv` as the agent in a bwrap of its own (its own pid and network namespaces, the
        sandbox's files), its pipes held (`SandboxBase.attach`)."""
        self._check_open()
        try:
            proc = self._spawn_piped(list(argv), resident=False)
        except OSError as exc:
            raise SandboxError(f"bwrap sandbox {self.id}: could not start {argv[0]!r}: {exc}") from exc
        with self._lock:  # killed with the agent's processes, waited for at close
            self._running.add(proc)
        return Pipes(proc)

    def _agent_executor(self) -> ResidentExecutor | None:
        try:
            return self._executor.get()
        except ExecutorLost as exc:
            self._executor_lost(exc)

    def _executor_lost(self, exc: ExecutorLost) -> NoReturn:
        if not self._base_alive():
            raise SandboxDead(f"sandbox {self.id} went away (closed, or its directories were removed)")
        raise SandboxDead(
            f"bwrap sandbox {self.id}: its resident executor is gone: {exc.why}; the agent's commands can no "
            "longer be trusted there, so the sandbox is given up (the episode is not scored)"
        )

    def _retire_executor(self) -> None:
        """Kill the resident executor and every command it runs (the next agent command starts anew)."""
        retired = self._executor.retire()
        if self._cgroups is not None and (resident := self._residents.current) is not None:
            self._cgroups.kill(lambda procs: _descendants(procs, resident.pid), wait_s=_KILL_EXEC_S)
        self._residents.kill()
        if retired is not None:
            retired.close()

    def check_intact(self) -> None:
        self._check_open()
        if (problem := self._executor.problem()) is not None:
            raise SandboxDead(
                f"bwrap sandbox {self.id}: its resident executor is gone: {problem}; the episode is not scored"
            )

    # -- commands -------------------------------------------------------------------------

    def _exec(self, request: ExecRequest) -> ExecResult:
        if request.identity == "agent" and (executor := self._agent_executor()) is not None:
            try:
                # Overdue past its deadline (a starved executor): the whole resident goes, its
                # pid namespace with it; the reply then reads as killed.
                return executor.run(request, uuid.uuid4().hex, lambda _elapsed: self._retire_executor())
            except ExecutorLost as exc:
                self._executor_lost(exc)
        full_env = {**self._base_env(), **request.env}
        scratch = None
        if request.identity == "verifier":
            # Made from the host side (the verifier's exec cannot write /verifier), in the capped tmpfs.
            name = f".verifier-tmp-{uuid.uuid4().hex[:12]}"
            (self.host_protected / name).mkdir(mode=0o700)
            scratch = self._prot_dir / name
        options = self._options(full_env, request.identity, scratch)
        # A memfd, not a pipe: the options can outgrow a pipe's buffer (a large environment).
        options_fd = os.memfd_create("agentrl-bwrap-args", 0)  # close-on-exec unless passed
        try:
            os.write(options_fd, b"\0".join(a.encode() for a in options) + b"\0")
            os.lseek(options_fd, 0, os.SEEK_SET)
            result = self._run(self._argv(list(request.argv), options_fd), request, options_fd)
        finally:
            os.close(options_fd)
            if scratch is not None:
                shutil.rmtree(self.host_protected / scratch.name, ignore_errors=True)
        if not result.timed_out:
            result = replace(result, exit_code=signal_exit(result.exit_code))
        if not self._base_alive():
            raise SandboxDead(
                f"sandbox {self.id} went away during exec (closed, or its directories were removed)"
            )
        return result

    def _run(self, argv: list[str], request: ExecRequest, options_fd: int) -> ExecResult:
        def on_start(proc: subprocess.Popen[bytes]) -> None:
            with self._lock:
                self._running.add(proc)

        with self._lock:  # a drain in progress (below) finishes before a new exec starts
            self._in_flight += 1
        try:
            return run_capped(
                argv,
                # "/", so that the cgroup-joining shell's PWD (it exports one) names no host path.
                cwd="/",
                # Nothing of the host's environment: bwrap's own environment is readable inside
                # at /proc/1/environ. Every program here is called by absolute path.
                env={},
                stdin=request.stdin,
                timeout=request.timeout,
                output_limit=request.output_limit,
                kill_tree=self._kill_exec,
                on_start=on_start,
                pass_fds=(options_fd,),
            )
        finally:
            with self._lock:
                self._in_flight -= 1
                self._running = {p for p in self._running if p.poll() is None}
                if self._in_flight == 0 and self._cgroups is not None:
                    # bwrap is reaped before the kernel has finished tearing down its pid
                    # namespace; until then the dying processes still count against pids.max
                    # and the next exec would fail to start. Wait them out (killing any
                    # straggler) while no exec is in flight: the lock keeps new ones waiting.
                    # The resident executor and its commands share the cgroups: they stay.
                    self._cgroups.kill_all(wait_s=5.0, spare=self._resident_pids)

    def _kill_exec(self, proc: subprocess.Popen[bytes]) -> None:
        """An exec's timeout: its bwrap dies, --die-with-parent takes bwrap's pid 1 along, and the
        kernel then kills every process left in that pid namespace; nothing runs in the sandbox
        for it. With cgroups, every process under that bwrap is first killed frozen: the kernel's
        kill alone leaves them racing the still-living for the CPU quota (a fork bomb's 256
        processes made the dying wait a second and more)."""
        if self._cgroups is not None:
            self._cgroups.kill(lambda procs: _descendants(procs, proc.pid), wait_s=_KILL_EXEC_S)
        kill_group(proc)

    def _resident_pids(self) -> set[int]:
        resident = self._residents.current
        return set() if resident is None else {resident.proc.pid, *resident.descendants()}

    def kill_agent_processes(self) -> None:
        """Kill every process of the agent's, the resident executor with them (the next agent
        command starts a new one). Raises `SandboxDead` afterwards when the executor had been
        replaced or stopped answering: the episode must not be scored."""
        problem = self._executor.problem() if not self._closed else None
        self._retire_executor()
        with self._lock:
            running = list(self._running)
        for proc in running:
            kill_group(proc)
        if self._cgroups is not None:
            self._cgroups.kill_all()
        if problem is not None:
            raise SandboxDead(
                f"bwrap sandbox {self.id}: its resident executor is gone: {problem}; the episode is not scored"
            )

    # -- lifecycle ------------------------------------------------------------------------

    def alive(self) -> bool:
        """Whether the sandbox's directories exist and its resident executor (if any) answers as itself."""
        return self._base_alive() and self._executor.problem() is None

    def _base_alive(self) -> bool:
        return (
            not self._closed
            and (self._holder is None or self._holder.alive())
            and self.host_workdir.is_dir()
            and self.rootfs.is_dir()
        )

    def _close(self) -> None:
        self.kill_agent_processes()
        with self._lock:
            running = list(self._running)
        for proc in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self._finalizer()


def main(argv: list[str] | None = None) -> int:
    """`python -m agentrl.sandbox.bwrap export IMAGE DEST`: make a rootfs for a machine without Docker."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] != "export":
        print("usage: python -m agentrl.sandbox.bwrap export IMAGE DEST", file=sys.stderr)
        return 2
    path = export_rootfs(args[1], Path(args[2]))
    print(f"exported {args[1]} to {path}; on the target machine: export {ROOTFS_ENV}={path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
