"""A docker sandbox's files: every write, copy and read runs inside its container, as the user it is for,
through the resident executor or a `docker exec` of `tar -x` or a bounded read script.
"""

from __future__ import annotations

import errno
import io
import posixpath
import tarfile
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, NoReturn, Protocol

from agentrl.sandbox.base import (
    AGENT_UID,
    PROTECTED_DIR,
    Limits,
    NotRegularFileError,
    SandboxError,
    SandboxPathError,
)
from agentrl.sandbox.docker_procs import AGENT_USER, ROOT_USER
from agentrl.sandbox.docker_stream import Raw
from agentrl.sandbox.executor import ExecutorLost, ResidentExecutor

# Bound on file transfers (ours, not the agent's commands).
INTERNAL_TIMEOUT_S = 60.0

# Reads a file for `read_file`, inside the container as the reading user: only a regular file
# (`[ -f ]` follows symlinks, so a link is judged by its target), at most $2 bytes of it, so
# /dev/zero, /dev/urandom, a FIFO or a socket can neither flood nor hang the host. For root,
# only a target that resolves inside PROTECTED_DIR. The file could be swapped for a FIFO
# between the test and `head`: then `head` blocks until the read's timeout, and still nothing
# unbounded reaches the host. Only sh built-ins and `head` (coreutils or busybox): any image.
READ_SCRIPT = f"""
p=$1
if [ ! -e "$p" ]; then echo "agentrl-read: missing" >&2; exit 2; fi
if [ -d "$p" ]; then echo "agentrl-read: directory" >&2; exit 3; fi
if [ ! -f "$p" ]; then echo "agentrl-read: special" >&2; exit 4; fi
if [ "$3" = {ROOT_USER} ]; then
  case $(readlink -f -- "$p") in {PROTECTED_DIR}/*) ;; *) echo "agentrl-read: outside" >&2; exit 5 ;; esac
fi
exec head -c "$2" -- "$p"
"""
READ_TIMEOUT_S = 30.0


class Container(Protocol):
    """What the files need of their sandbox (`agentrl.sandbox.docker.DockerSandbox`)."""

    id: str
    workdir: str
    limits: Limits

    def _agent_executor(self) -> ResidentExecutor | None: ...

    def _executor_lost(self, exc: ExecutorLost) -> NoReturn: ...

    def _run(
        self,
        argv: list[str],
        *,
        user: str,
        env: Mapping[str, str] | None,
        stdin: bytes | IO[bytes] | None,
        timeout: float,
        cap: int,
        kill_on_timeout: bool = True,
    ) -> Raw: ...


class ContainerFiles:
    """The sandbox's `FileAccess`: every file operation runs inside the container, as the user it
    is for (the agent, or root for `privileged`), so the kernel's permission checks apply."""

    def __init__(self, sandbox: Container) -> None:
        self.sandbox = sandbox

    def _path(self, path: str) -> str:
        return posixpath.normpath(posixpath.join(self.sandbox.workdir, str(path)))

    def lost(self) -> str | None:
        return None  # a container that went away says so at the next engine call

    def _executor(self, privileged: bool) -> ResidentExecutor | None:
        return None if privileged else self.sandbox._agent_executor()

    def write(self, path: str, data: bytes, *, mode: int, privileged: bool) -> None:
        target = self._path(path)
        if (executor := self._executor(privileged)) is not None:
            timeout = max(self.sandbox.limits.exec_timeout_s, INTERNAL_TIMEOUT_S)
            try:
                reply = executor.write(target, data, mode, timeout)
            except ExecutorLost as exc:
                self.sandbox._executor_lost(exc)
            if "ok" not in reply:
                message = str(reply.get("message") or reply.get("error"))
                self._raise_write_error(f"{message}: {target}", target, privileged)
            return
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            info = tarfile.TarInfo(target.lstrip("/"))
            info.size, info.mode, info.mtime = len(data), mode, int(time.time())
            info.uid = info.gid = 0 if privileged else AGENT_UID
            tar.addfile(info, io.BytesIO(data))
        self._untar(buf.getvalue(), target, privileged)

    def copy_in(self, host_path: Path, path: str, *, privileged: bool) -> None:
        target = self._path(path)
        uid = 0 if privileged else AGENT_UID

        def owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
            info.uid = info.gid = uid
            info.uname = info.gname = ""
            return info

        # Spooled: small trees stay in memory, a large dataset goes through a temporary file.
        with tempfile.SpooledTemporaryFile(max_size=16 * 1024 * 1024) as spool:
            with tarfile.open(fileobj=spool, mode="w", format=tarfile.PAX_FORMAT) as tar:
                tar.add(host_path, arcname=target.lstrip("/"), recursive=True, filter=owned)
            spool.seek(0)
            self._untar(spool, target, privileged)

    def _untar(self, archive: bytes | IO[bytes], target: str, privileged: bool) -> None:
        """Extract a tar streamed into `tar -x` inside the container.

        `put_archive` (docker cp) writes to the container's root layer and cannot reach tmpfs
        mounts such as the workspace, so the archive goes through an exec's stdin instead.
        """
        limits = self.sandbox.limits
        raw = self.sandbox._run(
            # -p keeps the modes we set; -m skips mtimes (utime fails on dirs we do not own);
            # --no-overwrite-dir leaves existing directories such as the workspace as they are.
            ["tar", "-x", "-p", "-m", "--no-same-owner", "--no-overwrite-dir", "-C", "/", "-f", "-"],
            user=ROOT_USER if privileged else AGENT_USER,
            env=None,
            stdin=archive,
            timeout=max(limits.exec_timeout_s, INTERNAL_TIMEOUT_S),
            cap=limits.output_limit_bytes,
        )
        if raw.timed_out:
            raise SandboxError(f"copying into {target} in sandbox {self.sandbox.id} timed out")
        if raw.exit_code != 0:
            lines = raw.err().splitlines()
            message = "; ".join(ln for ln in lines if "Exiting with failure status" not in ln)
            self._raise_write_error(message or f"tar exited {raw.exit_code}", target, privileged)

    def _raise_write_error(self, message: str, target: str, privileged: bool) -> NoReturn:
        if "No space left" in message or "Disk quota" in message:
            raise OSError(
                errno.ENOSPC,
                f"no space left writing {target} (the workspace and /tmp are capped at "
                f"{self.sandbox.limits.disk_mb} MiB each: raise Limits.disk_mb): {message}",
            )
        if any(
            s in message for s in ("Permission denied", "Read-only file system", "Operation not permitted")
        ):
            who = "root (privileged)" if privileged else "the agent"
            raise PermissionError(
                errno.EACCES,
                f"{who} cannot write {target}: {message}. The agent writes {self.sandbox.workdir} and /tmp; "
                f"privileged=True writes {PROTECTED_DIR}; the rest of the file system is read-only",
            )
        if "File exists" in message:
            # tar replaces an existing file by unlinking it first (never writing through a
            # symlink); that fails on the read-only root and where a directory is in the way.
            raise FileExistsError(
                errno.EEXIST,
                f"cannot replace what is already at {target} (a directory, or a file on the "
                f"read-only root): {message}",
            )
        raise SandboxError(f"could not write {target} in sandbox {self.sandbox.id}: {message}")

    def read(self, path: str, *, limit: int) -> bytes:
        target = self._path(path)
        where = f"sandbox {self.sandbox.id}"
        timeout = min(self.sandbox.limits.exec_timeout_s, READ_TIMEOUT_S)
        message = ""
        # As the agent: it owns the workspace. Root is tried only for paths under
        # PROTECTED_DIR, where the agent cannot plant anything: reading an agent-chosen path
        # (say a symlink to a root-only file) as root would make us a confused deputy.
        users = [AGENT_USER]
        if target.startswith(PROTECTED_DIR + "/"):
            users.append(ROOT_USER)
        if (executor := self._executor(False)) is not None:
            try:
                reply, data = executor.read(target, limit + 1, timeout)
            except ExecutorLost as exc:
                self.sandbox._executor_lost(exc)
            if "ok" in reply:
                return data
            kind = reply.get("error")
            if ROOT_USER not in users or kind not in ("missing", "permission"):
                self._raise_read_error(str(kind), str(reply.get("message")), target, where)
            users = [ROOT_USER]  # the verifier's own path, which the agent may not even see into
        raw = None
        for user in users:
            raw = self.sandbox._run(
                ["/bin/sh", "-c", READ_SCRIPT, "agentrl-read", target, str(limit + 1), user],
                user=user,
                env=None,
                stdin=None,
                timeout=timeout,
                # One byte over the limit tells "exactly at the limit" from "larger": never more.
                cap=limit + 1,
            )
            if raw.exit_code == 0 and not raw.timed_out:
                return bytes(raw.stdout.data)
            message = raw.err()
            # The agent may not even see into PROTECTED_DIR (then the file looks missing to it).
            if "Permission denied" not in message and "agentrl-read: missing" not in message:
                break
        assert raw is not None
        if raw.timed_out:
            message += f" (timed out after {timeout:g}s: was it swapped for a FIFO while being read?)"
        for kind in ("special", "outside", "missing", "directory"):
            if f"agentrl-read: {kind}" in message:
                self._raise_read_error(kind, message, target, where)
        if "No such file" in message or "Not a directory" in message:
            self._raise_read_error("missing", message, target, where)
        if "Is a directory" in message:
            self._raise_read_error("directory", message, target, where)
        if "Permission denied" in message:
            self._raise_read_error("permission", message, target, where)
        self._raise_read_error("other", message, target, where)

    @staticmethod
    def _raise_read_error(kind: str, message: str, target: str, where: str) -> NoReturn:
        """The error a read that failed for reason `kind` raises (the executor's kinds, and the
        read script's)."""
        if kind == "special":
            raise NotRegularFileError(
                f"{target} in {where} is not a regular file (a device, FIFO or socket); refused"
            )
        if kind == "outside":
            raise SandboxPathError(
                f"{target} in {where} resolves outside {PROTECTED_DIR}; refused (it is read as the agent)"
            )
        if kind == "missing":
            raise FileNotFoundError(errno.ENOENT, f"no such file in {where}", target)
        if kind == "directory":
            raise IsADirectoryError(errno.EISDIR, f"is a directory in {where}", target)
        if kind == "permission":
            raise PermissionError(errno.EACCES, f"unreadable in {where}", target)
        raise SandboxError(f"could not read {target} in {where}: {message}")
