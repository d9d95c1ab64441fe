"""A bwrap sandbox's limits enforced from the host: its cgroups, and the tmpfs holder of its writable space.

Both need privileges this process may not have, so each is probed, never assumed: `Cgroups.create` and
`TmpfsHolder.start` return None with the reason when they cannot, and the sandbox falls back to rlimits
(`agentrl.sandbox.bwrap`, `Enforcement` says which it got).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from agentrl.sandbox.base import AGENT_UID, Limits
from agentrl.sandbox.hostkill import CgroupView, Proc

__all__ = ["Cgroups", "TmpfsHolder"]


class Cgroups:
    """One sandbox's cgroups (v1: memory, pids, cpu dirs; v2: one dir). All execs join them."""

    def __init__(self, dirs: list[Path]) -> None:
        self.dirs = dirs

    @classmethod
    def create(cls, name: str, limits: Limits) -> tuple[Cgroups | None, str]:
        """Make and configure the cgroups, or return (None, why not)."""
        root = Path("/sys/fs/cgroup")
        made: list[Path] = []
        try:
            if (root / "cgroup.controllers").exists():  # cgroup v2
                own = Path(Path("/proc/self/cgroup").read_text().strip().split("::", 1)[-1].lstrip("/"))
                parent = root / own.parent if own.name else root
                d = parent / name
                d.mkdir()
                made.append(d)
                (d / "memory.max").write_text(str(limits.memory_mb << 20))
                (d / "memory.swap.max").write_text("0")
                (d / "pids.max").write_text(str(limits.pids))
                (d / "cpu.max").write_text(f"{int(limits.cpus * 100_000)} 100000")
            else:  # cgroup v1
                for ctl in ("memory", "pids", "cpu"):
                    d = root / ctl / "agentrl" / name
                    d.mkdir(parents=True)
                    made.append(d)
                mem, pids, cpu = made[:3]
                # The freezer is optional: it makes a timeout's kill exact (see `kill_all`); a
                # freezer hierarchy this process may not write costs that, never the limits.
                if (root / "freezer" / "cgroup.procs").exists():
                    with contextlib.suppress(OSError):
                        (root / "freezer" / "agentrl" / name).mkdir(parents=True)
                        made.append(root / "freezer" / "agentrl" / name)
                (mem / "memory.limit_in_bytes").write_text(str(limits.memory_mb << 20))
                if (mem / "memory.memsw.limit_in_bytes").exists():  # no swap either
                    (mem / "memory.memsw.limit_in_bytes").write_text(str(limits.memory_mb << 20))
                (pids / "pids.max").write_text(str(limits.pids))
                (cpu / "cpu.cfs_period_us").write_text("100000")
                (cpu / "cpu.cfs_quota_us").write_text(str(int(limits.cpus * 100_000)))
        except OSError as exc:
            for d in reversed(made):
                with contextlib.suppress(OSError):
                    d.rmdir()
            return None, f"no writable cgroup ({exc.strerror or exc})"
        return cls(made), "cgroup"

    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs:
            with contextlib.suppress(OSError):
                found.update(int(p) for p in (d / "cgroup.procs").read_text().split())
        return found

    def freezer(self) -> CgroupView | None:
        """The cgroup that freezes the sandbox's processes (v2: the one; v1: the freezer's), if any."""
        for d in self.dirs:
            if (d / "cgroup.freeze").exists():
                return CgroupView(d, v2=True)
            if (d / "freezer.state").exists():
                return CgroupView(d, v2=False)
        return None

    def kill(self, select: Callable[[list[Proc]], Iterable[int]], wait_s: float) -> bool:
        """Kill what `select` picks among the sandbox's processes, frozen first so that nothing
        (a fork bomb) forks while they are killed and the dying are not starved of CPU by the
        living in the cgroup's quota; False without a freezer or when it did not finish."""
        view = self.freezer()
        return view is not None and view.kill(select, timeout_s=wait_s)

    def kill_all(self, wait_s: float = 2.0, spare: Callable[[], set[int]] | None = None) -> None:
        """Kill every process of the sandbox's but those `spare()` names (the resident executor
        and its commands), and wait until they have left the cgroups."""

        def pick(procs: list[Proc]) -> list[int]:
            keep = spare() if spare else set()
            return [p.pid for p in procs if p.pid not in keep]

        if self.kill(pick, wait_s):
            return
        deadline = time.monotonic() + wait_s
        while (pids := self.pids() - (spare() if spare else set())) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.002)

    def remove(self) -> None:
        self.kill_all()
        for d in self.dirs:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)  # dying processes leave the cgroup a moment later


class TmpfsHolder:
    """Owns a sandbox's size-capped tmpfs mounts, unprivileged, for as long as the sandbox lives.

    Mounting a tmpfs needs CAP_SYS_ADMIN, which any user has inside a user namespace of their
    own. So one small process per sandbox lives in a user + mount namespace where the host's
    "/" is bound as is and a `--size`d tmpfs covers the workspace and /tmp directories. Every
    exec enters that namespace with `nsenter` (its caps vanish at the next execve, since the
    uid is not 0 there) and runs bwrap from it, so bwrap binds the tmpfs, not the empty host
    directory. The host side reaches the files through /proc/<holder>/root/<dir>.

    The holder blocks reading a pipe whose only writer is this Python process: when we exit
    or die, EOF ends it and the kernel frees the tmpfs. No polling, nothing to reap.
    """

    def __init__(self, proc: subprocess.Popen[bytes], pid: int, nsenter: str) -> None:
        self.proc = proc
        self.pid = pid
        self.nsenter = nsenter

    @classmethod
    def start(cls, bwrap: str, dirs: list[Path], size_mb: int) -> tuple[TmpfsHolder | None, str]:
        nsenter = shutil.which("nsenter")
        if nsenter is None:
            return None, "no nsenter (util-linux) on this host"
        args = [
            bwrap,
            "--unshare-user",
            "--uid",
            str(AGENT_UID),
            "--gid",
            str(AGENT_UID),
            "--dev-bind",
            "/",
            "/",
        ]
        for d in dirs:
            args += ["--size", str(size_mb << 20), "--tmpfs", str(d)]
        args += ["--", "/bin/sh", "-c", 'echo "$$" && read _']
        try:
            proc = subprocess.Popen(
                args,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            return None, f"could not start the tmpfs holder: {exc}"
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline().strip()
        if not line.isdigit():
            holder = cls(proc, 0, nsenter)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            err = proc.stderr.read().decode(errors="replace").strip() if proc.poll() is not None else ""
            holder.stop()
            return None, f"the tmpfs holder did not start ({err or 'no pid'})"
        proc.stdout.close()
        proc.stderr.close()
        return cls(proc, int(line), nsenter), ""

    def path(self, host_dir: Path) -> Path:
        return Path(f"/proc/{self.pid}/root{host_dir}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def enter(self) -> list[str]:
        return [self.nsenter, f"--target={self.pid}", "--user", "--mount", "--preserve-credentials", "--"]

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
