"""The root file system a bwrap sandbox runs in: an image exported once from the local Docker engine.

`find_rootfs(image)`: $AGENTRL_BWRAP_ROOTFS, else the cached export of the image (keyed by its id, found by
its tag without Docker), else an export now (`export_rootfs`, a `docker export` streamed into the cache,
marked complete only when whole). `private_paths(rootfs)`: the image's root-only paths, which bwrap masks
in every exec but privileged ones (its one uid cannot be kept out of them by permissions). Used by
`agentrl.sandbox.bwrap`; `python -m agentrl.sandbox.bwrap export IMAGE DEST` exports for a machine
without Docker.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import stat
import tarfile
import tempfile
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from agentrl.sandbox.base import DEFAULT_IMAGE, SandboxError

__all__ = ["ROOTFS_ENV", "cached_rootfs", "export_rootfs", "find_rootfs", "private_paths", "rootfs_cache_dir"]

ROOTFS_ENV = "AGENTRL_BWRAP_ROOTFS"
_COMPLETE_MARK = ".agentrl-rootfs-complete"


def rootfs_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "agentrl" / "rootfs"


def _tag_file(image: str) -> Path:
    return rootfs_cache_dir() / "tags" / re.sub(r"[^A-Za-z0-9_.-]", "_", image)


class _ChunkReader(io.RawIOBase):
    """A file object over the docker SDK's chunk generator, so tarfile can stream it."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._it: Iterator[bytes] = iter(chunks)
        self._buf = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        while not self._buf:
            try:
                self._buf = next(self._it)
            except StopIteration:
                return 0
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


def _rootfs_member(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    # Device nodes cannot be made without root and are never needed (bwrap mounts its own
    # /dev); FIFOs likewise.
    if member.ischr() or member.isblk() or member.isfifo():
        return None
    # The "tar" filter refuses members that would land outside `dest` and clears setuid,
    # setgid and group/other-write bits: a setuid binary is useless under no_new_privs, and
    # stripping it removes the question entirely.
    return tarfile.tar_filter(member, dest)


def export_rootfs(image: str = DEFAULT_IMAGE, dest: Path | None = None) -> Path:
    """Export `image`'s file system from the local Docker engine; return the directory.

    With no `dest`, it goes to the cache keyed by image id and is reused when present.
    Concurrent exports are safe: each extracts to a private directory, the first rename wins.
    """
    try:
        import docker
        import docker.errors

        client = docker.from_env()
        img = client.images.get(image)
    except ImportError as exc:
        raise SandboxError("the docker SDK is not installed: `pip install docker`") from exc
    except Exception as exc:
        if type(exc).__name__ == "ImageNotFound":
            raise SandboxError(
                f"image {image!r} is not in the local Docker engine; build it with `agentrl sandbox build` "
                "(or `make setup`), or set AGENTRL_BWRAP_ROOTFS to an exported root file system"
            ) from exc
        raise SandboxError(
            f"cannot reach Docker to export the bwrap root file system of {image!r} ({exc}); start Docker, "
            f"or set {ROOTFS_ENV}=/path/to/rootfs (export one where Docker runs with "
            f"`python -m agentrl.sandbox.bwrap export {image} DEST`)"
        ) from exc
    image_id = img.id.split(":", 1)[-1]
    final = dest or rootfs_cache_dir() / image_id
    if (final / _COMPLETE_MARK).exists():
        if dest is None:  # only the cache is found by tag; a directory the caller chose is theirs
            _record_tag(image, final)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    work.chmod(0o755)  # it becomes "/" inside: mkdtemp's 0700 would hide it from other users
    container = client.containers.create(img.id, command=["/bin/true"], labels={"agentrl.export": "1"})
    try:
        stream = io.BufferedReader(_ChunkReader(container.export(chunk_size=1 << 20)), 1 << 20)
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            tar.extractall(work, numeric_owner=True, filter=_rootfs_member)
        (work / _COMPLETE_MARK).write_text(json.dumps({"image": image, "id": img.id}) + "\n")
        try:
            os.rename(work, final)
        except OSError:
            if not (final / _COMPLETE_MARK).exists():
                raise
            shutil.rmtree(work, ignore_errors=True)  # another process won the race
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        with contextlib.suppress(Exception):
            container.remove(force=True)
    if dest is None:
        _record_tag(image, final)
    return final


def _record_tag(image: str, path: Path) -> None:
    tag = _tag_file(image)
    with contextlib.suppress(OSError):
        tag.parent.mkdir(parents=True, exist_ok=True)
        tmp = tag.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(str(path) + "\n")
        os.replace(tmp, tag)


def cached_rootfs(image: str = DEFAULT_IMAGE) -> Path | None:
    """The cached export of `image` found by its tag (no Docker needed), or None."""
    tag = _tag_file(image)
    if tag.exists():
        cached = Path(tag.read_text().strip())
        if (cached / _COMPLETE_MARK).exists():
            return cached
    return None


_rootfs_memo: dict[str, Path] = {}
_rootfs_lock = threading.Lock()


def find_rootfs(image: str = DEFAULT_IMAGE) -> Path:
    """The root file system for `image`: $AGENTRL_BWRAP_ROOTFS, else the cache, else a Docker export.

    Memoized per process: an image rebuilt under the same tag is picked up by a new process.
    """
    override = os.environ.get(ROOTFS_ENV)
    if override:
        path = Path(override)
        if not (path / "bin" / "sh").exists() and not (path / "usr" / "bin" / "sh").exists():
            raise SandboxError(
                f"{ROOTFS_ENV}={override!r} is not a root file system (no bin/sh in it); point it at an "
                "exported image, e.g. from `python -m agentrl.sandbox.bwrap export IMAGE DEST`"
            )
        return path
    with _rootfs_lock:
        if image in _rootfs_memo and (_rootfs_memo[image] / _COMPLETE_MARK).exists():
            return _rootfs_memo[image]
        try:
            path = export_rootfs(image)
        except SandboxError:
            # No Docker here: a rootfs exported earlier (or copied in) is found by its tag.
            if (cached := cached_rootfs(image)) is not None:
                _rootfs_memo[image] = cached
                return cached
            raise
        _rootfs_memo[image] = path
        return path


_PRIVATE_SUFFIX = ".private-paths.json"
_private_memo: dict[str, tuple[str, ...]] = {}


def _is_private(mode: int) -> bool:
    """Whether a user who owns nothing in the image could read it: docker's agent and verifier
    are "other" to every file of the image, so the other-bits decide."""
    if stat.S_ISDIR(mode):
        return not mode & stat.S_IXOTH
    if stat.S_ISREG(mode):
        return not mode & stat.S_IROTH
    return False


def private_paths(rootfs: Path) -> tuple[str, ...]:
    """The image's root-only paths (absolute, as seen inside), topmost only: every directory
    other users cannot enter and every regular file they cannot read.

    On docker these are unreadable to the agent and the verifier identity (their permission
    bits do it). bwrap has one uid, which owns every exported file, so the bits protect
    nothing: these paths are masked instead (an empty read-only tmpfs, or /dev/null for a file)
    in every exec but privileged ones. Computed once per root file system (a walk of the
    tree, ~0.1 s) and kept beside it (outside it: nothing of ours shows inside) when its
    parent directory is writable.
    """
    key = str(rootfs)
    if key in _private_memo:
        return _private_memo[key]
    sidecar = rootfs.parent / f"{rootfs.name}{_PRIVATE_SUFFIX}"
    with contextlib.suppress(OSError, ValueError, TypeError):
        found = tuple(json.loads(sidecar.read_text())["private"])
        _private_memo[key] = found
        return found
    out: list[str] = []
    stack = [(rootfs, "")]
    while stack:
        host, inside = stack.pop()
        try:
            entries = list(os.scandir(host))
        except OSError:
            continue
        for e in entries:
            if e.name == _COMPLETE_MARK and not inside:
                continue
            path = f"{inside}/{e.name}"
            if path in ("/proc", "/dev", "/sys"):
                continue  # bwrap mounts its own
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if _is_private(st.st_mode):
                out.append(path)
            elif stat.S_ISDIR(st.st_mode):
                stack.append((Path(e.path), path))
    found = tuple(sorted(out))
    _private_memo[key] = found
    with contextlib.suppress(OSError):
        tmp = sidecar.with_name(f"{sidecar.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"private": list(found)}) + "\n")
        os.replace(tmp, sidecar)
    return found
