"""Host-side reset of a container's writable state, so that the sandbox can serve another episode.

A docker sandbox's root file system is read-only; what an episode can leave behind is in a few
places only: its processes (the agent's, the verifier's, our own privileged commands), the
writable mounts (the workspace, /tmp, `PROTECTED_DIR`, /dev/shm, /dev/mqueue) and the IPC
namespace's System V objects. `reset_mounts` and `drop_sysv_ipc` empty those from the host,
through the container's PID 1 (`/proc/<pid>/root`, `nsenter`), after every process but PID 1 and
the keep-alive is gone (`agentrl.sandbox.hostkill`): nothing inside runs while it happens, and
nothing inside takes part, so no agent process can hide from it or feed it a path.

Paths are walked by file descriptor (`shutil.rmtree` with `dir_fd`, `O_NOFOLLOW`): a symlink the
agent planted is removed, never followed out of the container.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
from dataclasses import dataclass

__all__ = ["MountState", "drop_sysv_ipc", "reset_mounts"]

# User-settable extended attributes live in this namespace (tmpfs keeps them since Linux 6.6).
_USER_XATTR = "user."


@dataclass(frozen=True)
class MountState:
    """A writable mount as a fresh container has it: its path inside, and its root's mode and owner."""

    path: str
    mode: int
    uid: int
    """Owner of the mount's root, as the container sees it (mapped to the host's uid by the caller)."""
    gid: int


def reset_mounts(
    init_pid: int, mounts: list[MountState], host_uids: dict[int, int], host_gids: dict[int, int]
) -> None:
    """Empty each mount and give its root back its fresh mode, owner and no user xattrs.

    init_pid: the container's PID 1 as this host sees it. host_uids, host_gids: the container's ids ->
    this host's (the identity without a user namespace). Raises OSError when a mount cannot be reached or emptied:
    the caller then replaces the sandbox instead of reusing it."""
    for mount in mounts:
        path = f"/proc/{init_pid}/root{mount.path}"
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            for entry in os.scandir(fd):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.name, dir_fd=fd)
                else:
                    os.unlink(entry.name, dir_fd=fd)
            if any(os.scandir(fd)):
                raise OSError(f"{mount.path} is not empty after the reset")
            os.fchown(fd, host_uids[mount.uid], host_gids[mount.gid])
            os.fchmod(fd, mount.mode)
            with contextlib.suppress(OSError):  # a file system without xattrs has none to drop
                for name in os.listxattr(fd):
                    if name.startswith(_USER_XATTR):
                        os.removexattr(fd, name)
            st = os.fstat(fd)
            if stat.S_IMODE(st.st_mode) != mount.mode:
                raise OSError(f"{mount.path} kept mode {stat.S_IMODE(st.st_mode):o}")
        finally:
            os.close(fd)


def drop_sysv_ipc(init_pid: int, *, timeout_s: float = 10.0) -> None:
    """Remove every System V shared memory segment, semaphore set and message queue of the
    container's IPC namespace (`nsenter --ipc ... ipcrm --all`, as this host's root: the container's
    root has no CAP_IPC_OWNER and cannot remove the agent's). Raises OSError when it fails."""
    try:
        done = subprocess.run(
            ["nsenter", f"--target={init_pid}", "--ipc", "--", "ipcrm", "--all"],
            capture_output=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise OSError(f"could not clear the container's System V IPC objects: {exc}") from exc
    if done.returncode != 0:
        raise OSError(
            f"`nsenter ... ipcrm --all` exited {done.returncode}: {done.stderr.decode(errors='replace')[:200]}"
        )
