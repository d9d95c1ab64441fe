"""`local`: plain subprocesses in a temporary directory. NO ISOLATION: trusted tests only.

Use it to test environments and verifiers fast, on code you wrote yourself. An agent's
commands run as you, on your machine, with your network, and can read and write anything
you can. Choosing it logs a warning once per process.

What it does:
- `workdir` (default "/workspace") and relative paths map to a fresh temporary directory;
  `PROTECTED_DIR` ("/verifier") and "/tmp" map to sibling temporary directories. Commands run
  with the workspace as their working directory, `HOME` there and `TMPDIR` at the sandbox's
  /tmp, so a command that says "/workspace/x" literally does NOT reach it: use relative
  paths. Other absolute paths are refused by the file methods (there is no file system of
  its own to map them to).
- `image` is accepted and ignored (commands run on the host's own programs).
- Per-exec timeout kills the whole process tree: each exec starts a new session (killpg),
  and every process carries an environment marker, so children that left the session with
  `setsid` are found in /proc and killed too (a process that scrubs its environment escapes:
  that is why this backend is for trusted code).
- stdout/stderr are read as they come and kept up to `limits.output_limit_bytes` each; the
  rest is drained and dropped, `truncated` is set and the stream ends with
  "[agentrl: output truncated, N bytes dropped]" (100 MB of output costs no memory).
- No memory, CPU, pids, disk or network limit is enforced; `privileged` changes nothing but
  which paths `write_file`/`copy_in` accept (there is one user).

The host-side helpers here (`run_capped`, `HostView`) are shared with the `bwrap` backend,
which runs the same way but inside namespaces.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import selectors
import shutil
import signal
import stat
import subprocess
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from agentrl.sandbox.base import (
    DEFAULT_IMAGE,
    DEFAULT_WORKDIR,
    PROTECTED_DIR,
    Command,
    ExecResult,
    FileTooLargeError,
    Limits,
    NotRegularFileError,
    SandboxDead,
    SandboxError,
    SandboxPathError,
    read_limit,
)

log = logging.getLogger(__name__)

# The environment markers every local process inherits: how escaped children are found.
SANDBOX_MARKER = "AGENTRL_SANDBOX_ID"
EXEC_MARKER = "AGENTRL_EXEC_ID"

_warned = False

# Appended to a stream that hit the cap, so a model reading it knows it saw only the start.
# Same text as the docker backend's (a shared home in base.py would be better).
TRUNCATION_NOTE = "\n[agentrl: output truncated, {n} bytes dropped]"


__all__ = ["HostView", "LocalSandbox", "Mount", "SandboxPathError", "kill_marked", "run_capped"]


# --------------------------------------------------------------------------------------
# Running one command with a deadline and capped output (shared with bwrap).
# --------------------------------------------------------------------------------------


def run_capped(
    argv: Sequence[str],
    *,
    cwd: str | None,
    env: Mapping[str, str],
    stdin: str | bytes | None,
    timeout: float,
    output_limit: int,
    kill_tree: Callable[[subprocess.Popen[bytes]], None],
    on_start: Callable[[subprocess.Popen[bytes]], None] | None = None,
    drain_after_exit_s: float = 0.2,
    pass_fds: Sequence[int] = (),
) -> ExecResult:
    """Run `argv` in a new session; return its result with each stream capped at `output_limit`.

    One thread multiplexes stdin, stdout and stderr with a selector, so the child can never
    block on a full pipe and we never hold more than `output_limit` bytes per stream. At the
    deadline `kill_tree(proc)` must kill everything the command started. Once the command
    itself has exited, background children still holding the pipes get `drain_after_exit_s`
    more to flush, then the pipes are closed (they are not killed: a shell does not kill its
    background jobs either). `pass_fds` are inherited by the child (bwrap reads its arguments
    from one).
    """
    start = time.monotonic()
    deadline = start + timeout
    try:
        proc = subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
            pass_fds=tuple(pass_fds),
        )
    except OSError as exc:
        raise SandboxError(f"could not start {argv[0]!r}: {exc}") from exc
    if on_start is not None:
        on_start(proc)

    assert proc.stdout is not None and proc.stderr is not None
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    dropped = dict.fromkeys(buffers, 0)
    timed_out = False
    sel = selectors.DefaultSelector()
    for fd in buffers:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    pending = b""
    in_fd = -1
    if stdin is not None:
        assert proc.stdin is not None
        pending = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
        in_fd = proc.stdin.fileno()
        if pending:
            os.set_blocking(in_fd, False)
            sel.register(in_fd, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
    exited_at: float | None = None
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at >= drain_after_exit_s:
                break
            wait = deadline - now
            if exited_at is not None:
                wait = min(wait, drain_after_exit_s - (now - exited_at))
            else:
                # Wake up now and then: the command may exit while a background child keeps
                # the pipes open, and only poll() notices that.
                wait = min(wait, 0.05)
            for key, _ in sel.select(max(wait, 0.0)):
                fd = key.fd
                if fd == in_fd:
                    try:
                        written = os.write(fd, pending[:65536])
                        pending = pending[written:]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        pending = b""  # the command stopped reading: the rest is dropped
                    if not pending:
                        sel.unregister(fd)
                        assert proc.stdin is not None
                        proc.stdin.close()
                    continue
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    continue
                buf = buffers[fd]
                room = output_limit - len(buf)
                if len(chunk) > room:
                    dropped[fd] += len(chunk) - max(room, 0)
                    chunk = chunk[: max(room, 0)]
                buf += chunk
        if timed_out:
            kill_tree(proc)
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0) + 5.0)
        except subprocess.TimeoutExpired:
            # The command closed its pipes but will not exit: it is over its deadline now.
            timed_out = True
            kill_tree(proc)
            proc.wait(timeout=10)
    finally:
        sel.close()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
    code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
    if timed_out and code >= 0:
        code = -signal.SIGKILL
    texts = {}
    for fd, buf in buffers.items():
        texts[fd] = buf.decode("utf-8", errors="replace")
        if dropped[fd]:
            texts[fd] += TRUNCATION_NOTE.format(n=dropped[fd])
    return ExecResult(
        exit_code=code,
        stdout=texts[out_fd],
        stderr=texts[err_fd],
        timed_out=timed_out,
        duration_s=time.monotonic() - start,
        truncated=any(dropped.values()),
    )


def as_argv(cmd: Command) -> list[str]:
    """An argv list from the protocol's `cmd`: a string runs under `/bin/sh -c`."""
    if isinstance(cmd, str):
        return ["/bin/sh", "-c", cmd]
    argv = list(cmd)
    if not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"cmd must be a non-empty list of strings or a shell string, got {cmd!r}")
    return argv


def kill_marked(marker: str, value: str) -> int:
    """SIGKILL every process whose environment carries `marker=value`; return how many.

    Repeats until a pass finds nothing, so children forked during the sweep are caught too.
    Only processes we may read /proc/<pid>/environ of are seen (ours, or all of them as root).
    """
    needle = f"{marker}={value}".encode()
    me = os.getpid()
    killed = 0
    for _ in range(20):
        found = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) == me:
                continue
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    environ = f.read()
            except OSError:
                continue
            if needle in environ.split(b"\0"):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(entry.name), signal.SIGKILL)
                    found += 1
        killed += found
        if not found:
            break
        time.sleep(0.01)
    return killed


# --------------------------------------------------------------------------------------
# Host-side file access confined to a sandbox's directories (shared with bwrap).
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mount:
    """One sandbox path prefix and the host directory behind it (None: not reachable from the host)."""

    target: str
    host: Path | None
    agent_writable: bool
    privileged_writable: bool


_MAX_SYMLINKS = 40


class HostView:
    """Maps sandbox paths to host paths the way the sandbox itself would see them, safely.

    Symlinks are followed *in the sandbox's namespace* (an absolute link target means the
    sandbox's "/", not the host's), and the final path must land inside one of the mounts.
    Then the file is opened by walking from the mount's host directory one component at a
    time with O_NOFOLLOW, so a symlink swapped in after the check cannot redirect the write
    out of the sandbox. Non-regular files (a FIFO planted where the verifier reads) are
    refused instead of blocking.
    """

    def __init__(self, mounts: Sequence[Mount], workdir: str) -> None:
        # Longest target first: "/workspace" wins over "/".
        self.mounts = sorted(mounts, key=lambda m: len(m.target), reverse=True)
        self.workdir = workdir

    def _mount_of(self, parts: Sequence[str]) -> tuple[Mount, list[str]] | None:
        path = "/" + "/".join(parts)
        for m in self.mounts:
            t = m.target.rstrip("/")
            if path == t or path.startswith(t + "/") or t == "":
                rest = PurePosixPath(path).relative_to(m.target).parts
                return m, list(rest)
        return None

    def _host_of(self, parts: Sequence[str]) -> Path | None:
        found = self._mount_of(parts)
        if found is None or found[0].host is None:
            return None
        mount, rest = found
        return mount.host.joinpath(*rest) if rest else mount.host

    def resolve(self, path: str, *, follow_last: bool = True) -> tuple[Mount, list[str]]:
        """The mount a sandbox path lands in, and the symlink-free components below it."""
        if not isinstance(path, str) or not path or "\0" in path:
            raise SandboxPathError(f"invalid sandbox path {path!r}: expected a non-empty string")
        full = path if path.startswith("/") else f"{self.workdir.rstrip('/')}/{path}"
        pending = [p for p in full.split("/") if p]
        resolved: list[str] = []
        links = 0
        while pending:
            part = pending.pop(0)
            if part == ".":
                continue
            if part == "..":
                if resolved:
                    resolved.pop()
                continue
            candidate = [*resolved, part]
            host = self._host_of(candidate)
            if host is not None and (pending or follow_last) and host.is_symlink():
                links += 1
                if links > _MAX_SYMLINKS:
                    raise SandboxPathError(f"too many levels of symbolic links in {path!r}")
                target = os.readlink(host)
                if target.startswith("/"):
                    resolved = []
                pending = [p for p in target.split("/") if p] + pending
                continue
            resolved = candidate
        found = self._mount_of(resolved)
        where = "/" + "/".join(resolved)
        if found is not None and found[0].host is None and found[0].target in ("/dev", "/proc"):
            raise NotRegularFileError(
                f"{path!r} resolves to {where!r}, under {found[0].target}, which holds devices and process "
                "files, not regular files; only regular files are read or written"
            )
        if found is None or found[0].host is None:
            raise SandboxPathError(
                f"{path!r} resolves to {where!r}, outside every directory this sandbox maps to the "
                f"host ({', '.join(m.target for m in self.mounts if m.host is not None)}); "
                "use a path under the workspace"
            )
        return found

    def _open_dir(self, mount: Mount, parts: Sequence[str], *, create: bool) -> int:
        """An fd of the directory `parts` under the mount, walked without following links."""
        assert mount.host is not None
        fd = os.open(mount.host, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for part in parts:
                try:
                    nfd = os.open(
                        part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
                    )
                except FileNotFoundError:
                    if not create:
                        raise
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                    nfd = os.open(
                        part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
                    )
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise SandboxPathError(
                            f"{'/'.join(parts)!r} changed under us (a symlink or non-directory appeared); refused"
                        ) from exc
                    raise
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _check_writable(self, mount: Mount, path: str, privileged: bool) -> None:
        if mount.agent_writable or (privileged and mount.privileged_writable):
            return
        if mount.privileged_writable:
            raise SandboxPathError(
                f"{path!r} is under {mount.target}, which only the verifier may write: pass privileged=True"
            )
        raise SandboxPathError(f"{path!r} is under {mount.target}, which is read-only in this sandbox")

    def write(self, path: str, data: bytes, *, mode: int, privileged: bool) -> None:
        mount, parts = self.resolve(path)
        self._check_writable(mount, path, privileged)
        if not parts:
            raise SandboxPathError(f"{path!r} is a directory, not a file")
        dfd = self._open_dir(mount, parts[:-1], create=True)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            try:
                fd = os.open(parts[-1], flags, mode & 0o7777, dir_fd=dfd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise SandboxPathError(f"{path!r} became a symlink while being written; refused") from exc
                if exc.errno == errno.ENXIO:  # a FIFO nobody reads: O_NONBLOCK saved us from hanging
                    raise NotRegularFileError(f"{path!r} exists and is not a regular file; refused") from exc
                raise
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise NotRegularFileError(f"{path!r} exists and is not a regular file; refused")
                os.set_blocking(fd, True)
                os.ftruncate(fd, 0)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                # Setuid/setgid bits never come in through the host side.
                os.fchmod(fd, mode & 0o777)
            finally:
                os.close(fd)
        finally:
            os.close(dfd)

    def read(self, path: str, *, limit: int, truncate: bool = False) -> bytes:
        """The bytes of the regular file at sandbox path `path`, at most `limit` of them.

        More than `limit` raises `FileTooLargeError` (with `truncate`, the first `limit` come
        back). Only `limit + 1` bytes are ever read, whatever the file's size claims.
        """
        mount, parts = self.resolve(path)
        if not parts:
            raise IsADirectoryError(f"{path!r} is a directory")
        dfd = self._open_dir(mount, parts[:-1], create=False)
        try:
            try:
                fd = os.open(
                    parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd
                )
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise SandboxPathError(f"{path!r} became a symlink while being read; refused") from exc
                raise
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if stat.S_ISDIR(st.st_mode):
                    raise IsADirectoryError(f"{path!r} is a directory")
                if not stat.S_ISREG(st.st_mode):
                    raise NotRegularFileError(
                        f"{path!r} is not a regular file (a device, FIFO or socket); refused"
                    )
                os.set_blocking(f.fileno(), True)
                data = f.read(limit + 1)
            if len(data) > limit:
                if not truncate:
                    raise FileTooLargeError(path, limit)
                data = data[:limit]
            return data
        finally:
            os.close(dfd)

    def mkdir(self, path: str, *, privileged: bool) -> None:
        mount, parts = self.resolve(path)
        self._check_writable(mount, path, privileged)
        os.close(self._open_dir(mount, parts, create=True))

    def symlink(self, target: str, path: str, *, privileged: bool) -> None:
        mount, parts = self.resolve(path, follow_last=False)
        self._check_writable(mount, path, privileged)
        if not parts:
            raise SandboxPathError(f"{path!r} is a mount point, not a place for a symlink")
        dfd = self._open_dir(mount, parts[:-1], create=True)
        try:
            os.symlink(target, parts[-1], dir_fd=dfd)
        finally:
            os.close(dfd)

    def copy_in(self, host_path: str | Path, path: str, *, privileged: bool) -> None:
        """Copy a trusted host file or tree in; symlinks are copied as symlinks, never followed."""
        src = Path(host_path)
        if src.is_symlink():
            self.symlink(os.readlink(src), path, privileged=privileged)
        elif src.is_dir():
            self.mkdir(path, privileged=privileged)
            for child in sorted(src.iterdir()):
                self.copy_in(child, f"{path.rstrip('/')}/{child.name}", privileged=privileged)
        elif src.is_file():
            self.write(path, src.read_bytes(), mode=src.stat().st_mode & 0o777, privileged=privileged)
        elif not src.exists():
            raise FileNotFoundError(f"copy_in: host path {str(src)!r} does not exist")
        else:
            raise SandboxError(f"copy_in: {str(src)!r} is neither a file, a directory nor a symlink")


# --------------------------------------------------------------------------------------
# The backend.
# --------------------------------------------------------------------------------------


class LocalSandbox:
    """Plain subprocesses in a temporary directory. No isolation whatsoever: trusted tests only."""

    backend = "local"
    # What this backend isolates (see `agentrl.sandbox.bwrap` for the same vocabulary): nothing.
    capabilities: frozenset[str] = frozenset()

    def __init__(
        self,
        *,
        image: str = DEFAULT_IMAGE,
        limits: Limits | None = None,
        workdir: str = DEFAULT_WORKDIR,
        env: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        global _warned
        if not _warned:
            _warned = True
            msg = (
                "agentrl sandbox backend 'local' has NO isolation whatsoever: commands run as you, "
                "on this machine, with its network. Use it for trusted tests only; use 'docker' or "
                "'bwrap' for agents."
            )
            log.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
        if not workdir.startswith("/"):
            raise ValueError(f"workdir must be an absolute sandbox path like '/workspace', got {workdir!r}")
        self.image = image  # recorded, not used: commands run on the host's programs
        self.limits = limits or Limits()
        self.workdir = workdir
        self.env = dict(env or {})
        self.labels = dict(labels or {})
        self.id = f"local-{uuid.uuid4().hex[:12]}"
        self._root = Path(tempfile.mkdtemp(prefix=f"agentrl-{self.id}-"))
        self.host_workdir = self._root / "workspace"
        self.host_protected = self._root / "verifier"
        self.host_tmp = self._root / "tmp"
        for d in (self.host_workdir, self.host_protected, self.host_tmp):
            d.mkdir()
        self._view = HostView(
            [
                Mount(workdir, self.host_workdir, agent_writable=True, privileged_writable=True),
                Mount(PROTECTED_DIR, self.host_protected, agent_writable=False, privileged_writable=True),
                Mount("/tmp", self.host_tmp, agent_writable=True, privileged_writable=True),
            ],
            workdir,
        )
        self._exec_ids = itertools.count()
        self._closed = False

    # -- commands -------------------------------------------------------------------------

    def exec(
        self,
        cmd: Command,
        *,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
        env: Mapping[str, str] | None = None,
        privileged: bool = False,
        as_verifier: bool = False,
        output_limit: int | None = None,
    ) -> ExecResult:
        # One user, no isolation: `privileged` and `as_verifier` change nothing here.
        self._check_open()
        timeout = self.limits.exec_timeout_s if timeout is None else timeout
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        exec_id = f"{self.id}-{next(self._exec_ids)}"
        full_env = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "HOME": str(self.host_workdir),
            "TMPDIR": str(self.host_tmp),
            "LANG": "C.UTF-8",
            **self.env,
            **(env or {}),
            SANDBOX_MARKER: self.id,
            EXEC_MARKER: exec_id,
        }

        def kill_tree(proc: subprocess.Popen[bytes]) -> None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            kill_marked(EXEC_MARKER, exec_id)

        return run_capped(
            as_argv(cmd),
            cwd=str(self.host_workdir),
            env=full_env,
            stdin=stdin,
            timeout=timeout,
            output_limit=self.limits.output_limit_bytes if output_limit is None else output_limit,
            kill_tree=kill_tree,
        )

    def kill_agent_processes(self) -> None:
        kill_marked(SANDBOX_MARKER, self.id)

    # -- files ----------------------------------------------------------------------------

    def write_file(
        self, path: str, data: str | bytes, *, mode: int = 0o644, privileged: bool = False
    ) -> None:
        self._check_open()
        self._view.write(
            path, data.encode() if isinstance(data, str) else bytes(data), mode=mode, privileged=privileged
        )

    def read_file(self, path: str, *, max_bytes: int | None = None, truncate: bool = False) -> bytes:
        self._check_open()
        return self._view.read(path, limit=read_limit(self.limits, max_bytes), truncate=truncate)

    def copy_in(self, host_path: str | Path, path: str, *, privileged: bool = False) -> None:
        self._check_open()
        self._view.copy_in(host_path, path, privileged=privileged)

    # -- lifecycle ------------------------------------------------------------------------

    def alive(self) -> bool:
        return not self._closed and self.host_workdir.is_dir()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.kill_agent_processes()
        shutil.rmtree(self._root, ignore_errors=True)

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxDead(f"sandbox {self.id} is closed; open a new one with open_sandbox('local')")
        if not self.host_workdir.is_dir():
            raise SandboxDead(
                f"sandbox {self.id} lost its workspace {self.host_workdir} (deleted from outside)"
            )

    def __enter__(self) -> LocalSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LocalSandbox(id={self.id!r}, root={str(self._root)!r})"
