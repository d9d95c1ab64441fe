"""The host side of the resident executor (`agentrl.sandbox.executor_inside`): start it, talk to it, notice when it is gone.

Why: a fresh `docker exec` per tool call is a round trip through dockerd, containerd and runc
that starts a process from scratch (tens of milliseconds idle, far more under load); a fresh
bwrap sets up its namespaces every time. One executor per sandbox, started with it, runs each of
the agent's commands as its own child and answers over a channel the backend keeps open: a
command costs a fork and two pipe hops.

What runs through it: the agent's identity only (`exec` by default, the docker file methods).
`privileged` and `as_verifier` never do: they keep a fresh `docker exec` / bwrap each, so the
verifier's run never meets a process the agent could have touched. `kill_agent_processes`
retires the executor (kills it with everything else of the agent's); the next agent command
starts a new one, with a new secret.

What it guards against (the agent runs as the executor's uid, so it can see and signal it):
- the channel carries a per-start secret nonce in every frame, both ways, and replies must
  answer a request that is waiting; the executor is non-dumpable, so the agent can read neither
  the nonce (its memory) nor the channel's pipes (`/proc/<pid>/fd`);
- an executor killed, replaced or frozen is noticed (the channel closes, a frame is forged, a
  reply never comes, a ping answers with another pid): `ExecutorLost` with `tampered=True`,
  which the backends raise as `SandboxDead` (the episode ends `env_error`, with no reward) and
  which `check_intact` reports before a verifier runs;
- output past the cap is dropped inside the sandbox; the host never holds more than the cap.

Framing and the executor's own rules are in `agentrl.sandbox.executor_inside`'s docstring.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
import selectors
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Protocol

from agentrl.sandbox import executor_inside as wire
from agentrl.sandbox.base import KILLED, CappedOutput, ExecRequest, ExecResult, SandboxError, signal_exit

log = logging.getLogger(__name__)

__all__ = [
    "EXEC_MARKER",
    "DockerStream",
    "ExecutorLost",
    "ExecutorSlot",
    "ExecutorUnavailable",
    "Pipes",
    "ResidentExecutor",
    "launch_argv",
]

# Every agent command's processes inherit this variable (a fresh value per command); a timeout's
# killers find the command's whole tree by it, children that left its session included.
EXEC_MARKER = "AGENTRL_EXEC"
# How long past a command's own deadline its reply may take (the executor kills at the deadline
# and answers at once; a loaded box delays it) before the host-side killers step in.
REPLY_GRACE_S = 2.0
# After the host-side killers ran: how long the reply may still take before the executor counts
# as wedged (stopped by the agent, say). Generous: a box under heavy load must not read as tampering.
WEDGED_S = 10.0
# Start-up: the interpreter's start, the handshake.
START_TIMEOUT_S = 30.0
# A ping's answer (health checks: the pool's hand-out, `check_intact`); generous for the same reason.
PING_TIMEOUT_S = 10.0
# The executor's own stderr kept for error messages (a traceback, at most).
_STDERR_KEEP = 8192
# The executor raises the OOM score of every command it starts, so the kernel's OOM killer takes
# a command, not the executor (which would end the episode).
_COMMAND_OOM_ADJ = 500

_BOOTSTRAP = "import sys;exec(compile(sys.stdin.buffer.read({n}),{name!r},'exec'))"


def stdin_program_argv(source: bytes, name: str, python: str = "python3") -> list[str]:
    """A python program that runs `source`, sent first on its stdin: the image's python, isolated
    (`-I`: no user site, no PYTHON* variables; `-S`: no site). What follows the source on stdin is
    the program's own input."""
    return [python, "-I", "-S", "-c", _BOOTSTRAP.format(n=len(source), name=name)]


@cache
def _script() -> bytes:
    return Path(wire.__file__).read_bytes()


def launch_argv(python: str = "python3") -> list[str]:
    """The command that starts an executor, reading its source from its stdin (`stdin_program_argv`)."""
    return stdin_program_argv(_script(), "agentrl-executor", python)


class ExecutorUnavailable(Exception):
    """The executor could not start here (no python3 in the image, no prctl): the backend runs
    commands without it."""


class ExecutorLost(Exception):
    """The executor is gone or cannot be trusted. `tampered`: not our doing (killed, replaced,
    frozen or forged from inside the sandbox); False when we retired it ourselves."""

    def __init__(self, why: str, *, tampered: bool) -> None:
        super().__init__(why)
        self.why = why
        self.tampered = tampered


# --------------------------------------------------------------------------------------
# Transports: the channel as the backend holds it
# --------------------------------------------------------------------------------------


class Transport(Protocol):
    def send(self, data: bytes) -> None: ...

    def read_loop(self, on_out: Callable[[bytes], None], on_err: Callable[[bytes], None]) -> None:
        """Deliver the executor's stdout and stderr until the channel closes."""
        ...

    def close(self) -> None: ...


class DockerStream:
    """The attached stdio of one `docker exec`: the hijacked socket the SDK returns, stdin raw,
    stdout and stderr multiplexed in 8-byte-headed frames."""

    def __init__(self, sio: Any, prefix: bytes = b"", exit_status: Callable[[], int] | None = None) -> None:
        self.sio = sio
        self.sock: socket.socket = sio._sock
        self.sock.setblocking(True)
        self._prefix = prefix
        self._closed = False
        self._exit_status = exit_status

    def exit_status(self) -> int | None:
        """The exec's exit status as docker recorded it (after its stream ended); None if unknown."""
        return self._exit_status() if self._exit_status is not None else None

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read_loop(self, on_out: Callable[[bytes], None], on_err: Callable[[bytes], None]) -> None:
        header = bytearray()
        left, kind = 0, 1
        pending = self._prefix
        self._prefix = b""
        while True:
            data = pending or self.sock.recv(1 << 18)
            pending = b""
            if not data:
                return
            view, i = memoryview(data), 0
            while i < len(view):
                if left == 0:
                    take = min(8 - len(header), len(view) - i)
                    header += view[i : i + take]
                    i += take
                    if len(header) == 8:
                        kind_byte, left = struct.unpack(">BxxxL", header)
                        kind = 2 if kind_byte == 2 else 1
                        header.clear()
                    continue
                take = min(left, len(view) - i)
                (on_err if kind == 2 else on_out)(bytes(view[i : i + take]))
                i += take
                left -= take

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        response = getattr(self.sio, "_response", None)
        if response is not None:
            with contextlib.suppress(Exception):
                response.close()
        for closer in (self.sio.close, self.sock.close):
            with contextlib.suppress(Exception):
                closer()


class Pipes:
    """A host process's stdin, stdout and stderr (bwrap's)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        self.proc = proc
        self._in = proc.stdin.fileno()
        self._lock = threading.Lock()

    def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._in, view) :]

    def read_loop(self, on_out: Callable[[bytes], None], on_err: Callable[[bytes], None]) -> None:
        """Until the replies' stream ends; the reading ends of the pipes are closed here, by the
        thread that reads them (never under a select of its own)."""
        assert self.proc.stdout is not None and self.proc.stderr is not None
        out_fd = self.proc.stdout.fileno()
        sinks = {out_fd: on_out, self.proc.stderr.fileno(): on_err}
        sel = selectors.DefaultSelector()
        for fd in sinks:
            sel.register(fd, selectors.EVENT_READ)
        try:
            while sel.get_map():
                for key, _ in sel.select():
                    try:
                        data = os.read(key.fd, 1 << 18)
                    except OSError:
                        data = b""
                    if not data:
                        sel.unregister(key.fd)
                        if key.fd == out_fd:
                            return  # the replies' stream ended: the executor is gone
                        continue
                    sinks[key.fd](data)
        finally:
            sel.close()
            for f in (self.proc.stdout, self.proc.stderr):
                with contextlib.suppress(OSError):
                    f.close()

    def exit_status(self, timeout: float = 10.0) -> int | None:
        """The process's exit status once it has exited (128 + N for a signal N, as a shell says it);
        None if it has not within `timeout`."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        return 128 - code if code < 0 else code

    def close(self) -> None:
        """Close our end of its stdin: the executor reads EOF and exits (unless it is frozen)."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()


# --------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------


@dataclass
class _Pending:
    event: threading.Event = field(default_factory=threading.Event)
    meta: dict | None = None
    blobs: list[bytes] = field(default_factory=list)


class ResidentExecutor:
    """One started executor: its channel, the requests waiting on it, and whether it can be trusted.

    A reader thread takes every reply off the channel and hands it to the request that waits
    for it, so several commands of one sandbox may run at once.
    """

    def __init__(self, transport: Transport, *, name: str, workdir: str) -> None:
        self.transport = transport
        self.name = name
        self.workdir = workdir
        self.nonce = secrets.token_bytes(wire.NONCE_BYTES)
        self._parser = wire.Parser(self.nonce)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._hello = threading.Event()
        self._hello_line = bytearray()
        self._greeted = False
        self._stderr = bytearray()
        self.lost: str | None = None
        self.tampered = False
        self.retired = False
        self.identity: tuple[int, int] | None = None  # (pid, start ticks) inside the sandbox
        self.python = ""
        self._thread = threading.Thread(target=self._read, name=f"agentrl-executor-{name}", daemon=True)

    # -- start-up -------------------------------------------------------------------------

    def start(self, *, reap: bool, timeout_s: float = START_TIMEOUT_S) -> None:
        """Send the executor's source, wait for its hello, hand it the nonce and its settings.

        Raises `ExecutorUnavailable` when it cannot run here (the process exited or refused
        before the hello), `ExecutorLost` when the channel broke after."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        try:
            self.transport.send(_script())
        except OSError as exc:
            raise ExecutorUnavailable(f"could not send the executor its source: {exc}") from exc
        if not self._hello.wait(max(deadline - time.monotonic(), 0)) or not self._greeted:
            why = self.lost or f"no hello within {timeout_s:g}s"
            detail = self.stderr_tail() or bytes(self._hello_line).decode(errors="replace").strip()
            self.close()
            raise ExecutorUnavailable(f"{why}{f': {detail}' if detail else ''}")
        with self._send_lock:
            self.transport.send(self.nonce)
        meta, _ = self._call({"op": "hello", "reap": reap, "oom_adj": _COMMAND_OOM_ADJ}, (), deadline)
        self.identity = (int(meta["pid"]), int(meta["start"]))
        self.python = str(meta.get("python", ""))

    # -- requests -------------------------------------------------------------------------

    def _submit(
        self, meta: Mapping[str, Any], blobs: tuple[bytes, ...] | list[bytes]
    ) -> tuple[int, _Pending]:
        pending = _Pending()
        with self._lock:
            if self.lost is not None:
                raise ExecutorLost(self.lost, tampered=self.tampered)
            req_id = next(self._ids)
            self._pending[req_id] = pending
        frame = wire.encode(self.nonce, req_id, meta, blobs)
        try:
            with self._send_lock:
                self.transport.send(frame)
        except OSError as exc:
            self._gone(f"its channel broke while a request was sent ({exc})", tampered=not self.retired)
        return req_id, pending

    def _result(self, req_id: int, pending: _Pending) -> tuple[dict, list[bytes]]:
        if pending.meta is None:
            with self._lock:
                self._pending.pop(req_id, None)
            raise ExecutorLost(self.lost or "no reply", tampered=self.tampered)
        return pending.meta, pending.blobs

    def _call(
        self, meta: Mapping[str, Any], blobs: tuple[bytes, ...] | list[bytes], deadline: float
    ) -> tuple[dict, list[bytes]]:
        req_id, pending = self._submit(meta, blobs)
        if not pending.event.wait(max(deadline - time.monotonic(), 0)):
            self._gone("it stopped answering", tampered=not self.retired)
        return self._result(req_id, pending)

    def run(self, request: ExecRequest, marker: str, on_overdue: Callable[[float], None]) -> ExecResult:
        """Run one agent command. `on_overdue(elapsed_s)` is the backend's host-side kill of the
        command's processes, called when the reply is `REPLY_GRACE_S` past the deadline."""
        start = time.monotonic()
        meta = {
            "op": "run",
            "argv": list(request.argv),
            "env": dict(request.env),
            "cwd": self.workdir,
            "timeout": request.timeout,
            "cap": request.output_limit,
            "marker": f"{EXEC_MARKER}={marker}",
        }
        req_id, pending = self._submit(meta, () if request.stdin is None else (request.stdin,))
        overdue = not pending.event.wait(request.timeout + REPLY_GRACE_S)
        if overdue:
            on_overdue(time.monotonic() - start)
            if not pending.event.wait(WEDGED_S):
                self._gone(
                    f"it did not answer within {request.timeout + REPLY_GRACE_S + WEDGED_S:g}s of a "
                    f"{request.timeout:g}s command (stopped from inside?)",
                    tampered=not self.retired,
                )
        if pending.meta is None and self.retired and not self.tampered:
            # Retired while the command ran (kill_agent_processes, or the in-sandbox killers of an
            # overdue timeout): the command was killed with it.
            elapsed = time.monotonic() - start
            return ExecResult.captured(
                KILLED,
                CappedOutput(request.output_limit),
                CappedOutput(request.output_limit),
                timed_out=elapsed >= request.timeout,
                duration_s=elapsed,
            )
        reply, blobs = self._result(req_id, pending)
        if "error" in reply:
            raise SandboxError(
                f"the resident executor of {self.name} could not run a command: {reply.get('message')}"
            )
        out, err = CappedOutput(request.output_limit), CappedOutput(request.output_limit)
        if len(blobs) != 2 or len(blobs[0]) > request.output_limit or len(blobs[1]) > request.output_limit:
            self._gone("a reply broke the output cap", tampered=True)
            raise ExecutorLost(self.lost or "", tampered=True)
        out.data[:], err.data[:] = blobs
        out.dropped, err.dropped = (int(n) for n in reply["dropped"])
        # Overdue, the host-side killers ended the command: a starved executor (a fork bomb holding the
        # sandbox's CPU) then reports a SIGKILL it did not send, but the command timed out all the same.
        timed_out = bool(reply["timed_out"]) or overdue
        code = KILLED if reply["exit"] is None else int(reply["exit"])
        return ExecResult.captured(
            code if timed_out else signal_exit(code),
            out,
            err,
            timed_out=timed_out,
            duration_s=time.monotonic() - start,
        )

    def read(self, path: str, limit: int, timeout_s: float) -> tuple[dict, bytes]:
        """At most `limit` bytes of a regular file, read as the agent: ({"ok": True}, data), or
        ({"error": kind, "message": ...}, b"") where kind is missing, directory, special,
        permission or other."""
        meta, blobs = self._call(
            {"op": "read", "path": path, "limit": limit}, (), time.monotonic() + timeout_s
        )
        if "ok" in meta and (len(blobs) != 1 or len(blobs[0]) > limit):
            self._gone("a reply broke the read limit", tampered=True)
            raise ExecutorLost(self.lost or "", tampered=True)
        return meta, blobs[0] if blobs else b""

    def write(self, path: str, data: bytes, mode: int, timeout_s: float) -> dict:
        """Write a file as the agent: {"ok": True}, or {"error": ..., "errno": n, "message": strerror}."""
        meta, _ = self._call(
            {"op": "write", "path": path, "mode": mode}, (data,), time.monotonic() + timeout_s
        )
        return meta

    def check(self, timeout_s: float = PING_TIMEOUT_S) -> str | None:
        """Why this executor cannot be trusted (gone, not answering, another process), or None."""
        if self.lost is not None:
            return self.lost if self.tampered else None
        try:
            meta, _ = self._call({"op": "ping"}, (), time.monotonic() + timeout_s)
        except ExecutorLost as exc:
            return exc.why if exc.tampered else None
        if (int(meta["pid"]), int(meta["start"])) != self.identity:
            self._gone(f"another process answers for it (pid {meta['pid']})", tampered=True)
            return self.lost
        return None

    # -- the channel ------------------------------------------------------------------------

    def _read(self) -> None:
        why = "its channel closed (the executor exited or was killed)"
        try:
            self.transport.read_loop(self._on_out, self._on_err)
        except wire.FrameError as exc:
            why = f"a forged or corrupt frame came over its channel ({exc})"
        except Exception as exc:  # the reader must always end in _gone
            why = f"its channel failed ({type(exc).__name__}: {exc})"
        self._gone(why, tampered=not self.retired)

    def _on_out(self, data: bytes) -> None:
        if not self._greeted:
            self._hello_line += data
            line, sep, rest = bytes(self._hello_line).partition(b"\n")
            if not sep:
                if len(self._hello_line) > 4096:
                    raise wire.FrameError("no hello line")
                return
            if line + sep != wire.HELLO:
                self.lost = f"it refused to start: {line.decode(errors='replace')}"
                self._hello.set()
                return
            self._greeted = True
            self._hello.set()
            data = rest
            if not data:
                return
        for req_id, meta, blobs in self._parser.feed(data):
            with self._lock:
                pending = self._pending.pop(req_id, None)
            if pending is None:
                raise wire.FrameError(f"a reply to request {req_id}, which nobody waits for")
            pending.meta, pending.blobs = meta, blobs
            pending.event.set()

    def _on_err(self, data: bytes) -> None:
        room = _STDERR_KEEP - len(self._stderr)
        if room > 0:
            self._stderr += data[:room]

    def stderr_tail(self) -> str:
        return bytes(self._stderr).decode(errors="replace").strip()

    def _gone(self, why: str, *, tampered: bool) -> None:
        with self._lock:
            if self.lost is None:
                self.lost = why
                self.tampered = tampered and not self.retired
            waiting, self._pending = list(self._pending.values()), {}
        for pending in waiting:
            pending.event.set()
        self._hello.set()

    # -- the end --------------------------------------------------------------------------

    def retire(self) -> None:
        """From now on its end is ours: the backend is about to kill it."""
        self.retired = True

    def close(self) -> None:
        """Close the channel (the executor sees EOF and exits, unless it is frozen)."""
        self.retired = True
        self.transport.close()
        self._gone("it was closed", tampered=False)


class ExecutorSlot:
    """One sandbox's executor across its restarts: started by `starter`, handed out while it can
    be trusted, started again after we retired it, and never again once tampered with."""

    def __init__(self, starter: Callable[[], ResidentExecutor], *, enabled: bool) -> None:
        self._starter = starter
        self.current: ResidentExecutor | None = None
        self.disabled: str | None = None if enabled else "turned off (SandboxSpec.executor=False)"
        self.tampered: str | None = None
        self._lock = threading.Lock()

    def get(self) -> ResidentExecutor | None:
        """The executor to run agent commands through; None when this sandbox runs without one.

        Raises `ExecutorLost` (tampered) once it was killed, replaced or frozen from inside."""
        if self.disabled is not None:
            return None
        current = self.current
        if current is not None and current.lost is None:
            return current
        with self._lock:
            self._note(self.current)
            if self.tampered is not None:
                raise ExecutorLost(self.tampered, tampered=True)
            if self.current is None or self.current.lost is not None:
                try:
                    self.current = self._starter()
                except ExecutorUnavailable as exc:
                    self.disabled = str(exc)
                    log.warning("agent commands run without a resident executor: %s", exc)
                    return None
            return self.current

    def _note(self, executor: ResidentExecutor | None) -> None:
        if executor is not None and executor.lost is not None and executor.tampered and self.tampered is None:
            self.tampered = executor.lost

    def problem(self) -> str | None:
        """Why the executor cannot be trusted (pinging it when it runs), or None."""
        current = self.current
        if current is not None and self.tampered is None:
            why = current.check()
            if why is not None:
                self.tampered = why
        return self.tampered

    def retire(self) -> ResidentExecutor | None:
        """Mark the running executor as ours to kill; the next `get` starts a new one."""
        with self._lock:
            current = self.current
            if current is not None:
                self._note(current)
                current.retire()
            return current
