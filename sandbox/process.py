"""Running one host process for a sandbox: a deadline, capped output, and a kill that reaches its whole tree.

Shared by the backends whose commands are host processes: `local` (the command itself) and
`bwrap` (the `bwrap` that wraps it). Isolation is the caller's business, not this module's: it
starts `argv` with exactly the environment, working directory and file descriptors it is given.

- Each command starts a new session (its own process group), so `kill_group` reaches what it
  forked unless that left the group; `kill_marked` finds those by an environment marker.
- One thread multiplexes stdin, stdout and stderr with a selector, so the child never blocks on
  a full pipe and at most `output_limit` bytes of each stream are held (`CappedOutput`).
- On the deadline the caller's `kill_tree` runs; the result says `timed_out` and exit `KILLED`.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence

from agentrl.sandbox.base import KILLED, CappedOutput, ExecResult, SandboxError

__all__ = ["kill_group", "kill_marked", "run_capped"]


def run_capped(
    argv: Sequence[str],
    *,
    cwd: str | None,
    env: Mapping[str, str],
    stdin: bytes | None,
    timeout: float,
    output_limit: int,
    kill_tree: Callable[[subprocess.Popen[bytes]], None],
    on_start: Callable[[subprocess.Popen[bytes]], None] | None = None,
    drain_after_exit_s: float = 0.2,
    pass_fds: Sequence[int] = (),
) -> ExecResult:
    """Run `argv` in a new session; return its result with each stream capped at `output_limit`.

    At the deadline `kill_tree(proc)` must kill everything the command started. Once the command
    itself has exited, background children still holding the pipes get `drain_after_exit_s`
    more to flush, then the pipes are closed (they are not killed: a shell does not kill its
    background jobs either). `pass_fds` are inherited by the child (bwrap reads its options
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
    pipes = _Pipes(proc, stdin, output_limit)
    try:
        timed_out = pipes.pump(deadline, drain_after_exit_s)
        timed_out = _reap(proc, deadline, kill_tree, timed_out)
    finally:
        pipes.close()
    return ExecResult.captured(
        KILLED if proc.returncode is None else proc.returncode,
        pipes.stdout,
        pipes.stderr,
        timed_out=timed_out,
        duration_s=time.monotonic() - start,
    )


class _Pipes:
    """A command's stdin, stdout and stderr on one selector: `stdin` written as the command reads it, each
    output kept up to its cap, so the command never blocks on a full pipe."""

    def __init__(self, proc: subprocess.Popen[bytes], stdin: bytes | None, output_limit: int) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        self.proc = proc
        self.stdout, self.stderr = CappedOutput(output_limit), CappedOutput(output_limit)
        self.outputs = {proc.stdout.fileno(): self.stdout, proc.stderr.fileno(): self.stderr}
        self.sel = selectors.DefaultSelector()
        for fd in self.outputs:
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ)
        self.pending = b""
        self.in_fd = -1
        if stdin is not None:
            assert proc.stdin is not None
            self.pending = stdin
            self.in_fd = proc.stdin.fileno()
            if stdin:
                os.set_blocking(self.in_fd, False)
                self.sel.register(self.in_fd, selectors.EVENT_WRITE)
            else:
                proc.stdin.close()

    def pump(self, deadline: float, drain_after_exit_s: float) -> bool:
        """Move bytes until the pipes close, or the command has exited `drain_after_exit_s` ago; True
        when the deadline came first."""
        exited_at: float | None = None
        while self.sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                return True
            if exited_at is None and self.proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at >= drain_after_exit_s:
                return False
            wait = deadline - now
            if exited_at is not None:
                wait = min(wait, drain_after_exit_s - (now - exited_at))
            else:
                # Wake up now and then: the command may exit while a background child keeps
                # the pipes open, and only poll() notices that.
                wait = min(wait, 0.05)
            for key, _ in self.sel.select(max(wait, 0.0)):
                if key.fd == self.in_fd:
                    self._write()
                else:
                    self._read(key.fd)
        return False

    def _write(self) -> None:
        try:
            written = os.write(self.in_fd, self.pending[:65536])
            self.pending = self.pending[written:]
        except BlockingIOError:
            return
        except BrokenPipeError:
            self.pending = b""  # the command stopped reading: the rest is dropped
        if not self.pending:
            self.sel.unregister(self.in_fd)
            assert self.proc.stdin is not None
            self.proc.stdin.close()

    def _read(self, fd: int) -> None:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        if not chunk:
            self.sel.unregister(fd)
            return
        self.outputs[fd].feed(chunk)

    def close(self) -> None:
        self.sel.close()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()


def _reap(
    proc: subprocess.Popen[bytes],
    deadline: float,
    kill_tree: Callable[[subprocess.Popen[bytes]], None],
    timed_out: bool,
) -> bool:
    """Wait for the command (killed first when it `timed_out`); returns whether it overran its deadline."""
    if timed_out:
        kill_tree(proc)
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 0) + 5.0)
    except subprocess.TimeoutExpired:
        # The command closed its pipes but will not exit: it is over its deadline now.
        timed_out = True
        kill_tree(proc)
        proc.wait(timeout=10)
    return timed_out


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group `proc` leads (it was started in a new session); gone already is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


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
