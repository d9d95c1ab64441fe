"""Host-side file access confined to a sandbox's directories, for backends whose files the host reaches.

`local` and `bwrap` keep a sandbox's workspace, /tmp and `PROTECTED_DIR` in host directories
(bwrap: tmpfs mounts reached through its holder process). `HostView` maps the sandbox's paths to
those directories the way the sandbox itself would see them, and refuses everything else: no
symlink the agent planted can lead a host-side read or write out of the sandbox, and no device
or FIFO can flood or hang it. It is the `FileAccess` of those backends.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from agentrl.sandbox.base import NotRegularFileError, SandboxError, SandboxPathError

__all__ = ["HostView", "Mount"]


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
        # Checked before every call (`lost`): found once.
        self._workspace = next((m.host for m in self.mounts if m.target == workdir), None)

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

    def read(self, path: str, *, limit: int) -> bytes:
        """The first `limit + 1` bytes at most of the regular file at sandbox path `path` (one over
        the limit tells the caller the file is larger), whatever the file's size claims."""
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
                return f.read(limit + 1)
        finally:
            os.close(dfd)

    def lost(self) -> str | None:
        """Why the workspace is unreachable from the host (deleted from outside), or None."""
        if self._workspace is None or not self._workspace.is_dir():
            return f"lost its workspace {self._workspace} (deleted from outside)"
        return None

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
