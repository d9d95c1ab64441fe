"""Docker's exec stream as the docker backend reads it: the hijacked socket of one `docker exec`, its
multiplexed stdout/stderr split and capped while they stream, stdin fed in chunks, and the outcome in bytes.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from agentrl.sandbox.base import CappedOutput

READ_CHUNK = 256 * 1024
STDIN_CHUNK = 64 * 1024


class Demux:
    """Splits docker's multiplexed stream (8-byte frame headers) into stdout and stderr,
    keeping at most `cap` bytes of each and counting the rest, so memory stays bounded."""

    def __init__(self, cap: int) -> None:
        self.out = {1: CappedOutput(cap), 2: CappedOutput(cap)}
        self._header = bytearray()
        self._left = 0  # bytes still to come in the current frame
        self._kind = 1

    def feed(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        i, n = 0, len(view)
        while i < n:
            if self._left == 0:
                take = min(8 - len(self._header), n - i)
                self._header += view[i : i + take]
                i += take
                if len(self._header) < 8:
                    return
                kind, self._left = struct.unpack(">BxxxL", self._header)
                self._header.clear()
                self._kind = 2 if kind == 2 else 1
                continue
            take = min(self._left, n - i)
            self.out[self._kind].feed(view[i : i + take])
            i += take
            self._left -= take


@dataclass(frozen=True)
class Raw:
    """An exec's outcome in bytes, before `ExecResult` decodes it. `exit_code` as docker says it."""

    exit_code: int
    stdout: CappedOutput
    stderr: CappedOutput
    timed_out: bool
    duration_s: float

    def err(self) -> str:
        return self.stderr.data.decode(errors="replace").strip()


def stdin_chunks(stdin: bytes | IO[bytes] | None) -> Iterator[bytes] | None:
    if stdin is None:
        return None
    if isinstance(stdin, bytes | bytearray):
        view = memoryview(stdin)
        return (bytes(view[i : i + STDIN_CHUNK]) for i in range(0, len(view), STDIN_CHUNK))
    return iter(lambda: stdin.read(STDIN_CHUNK), b"")


def buffered_prefix(sio: Any) -> bytes:
    """Bytes http.client already pulled off the socket while reading the 101 response headers.

    The SDK hands back the raw socket, which skips its buffered reader; a fast command's first
    output can sit in that buffer. The socket must already be non-blocking here.
    """
    try:
        fp = sio._response.raw._fp.fp
        peeked = fp.peek()
        return fp.read1(len(peeked)) if peeked else b""
    except (AttributeError, BlockingIOError, ValueError, OSError, TypeError):
        return b""


def close_stream(sio: Any) -> None:
    # The response wraps the same socket through a buffered reader: close it first (it
    # may fail on the hijacked stream), then our handle, then the socket itself, or the
    # file descriptor leaks.
    response = getattr(sio, "_response", None)
    if response is not None:
        with contextlib.suppress(Exception):
            response.close()
    with contextlib.suppress(Exception):
        sio.close()
    with contextlib.suppress(Exception):
        sio._sock.close()


def pump(sock: socket.socket, demux: Demux, stdin: Iterator[bytes] | None, deadline: float) -> bool:
    """Feed stdin and read output until the stream ends (True) or the deadline passes (False).

    Writing and reading are interleaved: a command that prints while it reads a large
    stdin would otherwise deadlock against us.
    """
    poller = select.poll()
    pending = memoryview(b"")
    writing = stdin is not None
    while True:
        if writing and not pending:
            pending = memoryview(next(stdin, b""))  # type: ignore[arg-type]
            if not pending:
                writing = False
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)  # the command sees EOF on stdin
        poller.register(sock, select.POLLIN | (select.POLLOUT if writing else 0))
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        events = poller.poll(left * 1000)
        if not events:
            continue
        mask = events[0][1]
        if writing and mask & select.POLLOUT:
            try:
                pending = pending[sock.send(pending) :]
            except BlockingIOError:
                pass
            except OSError:
                # The command exited or closed stdin without reading it all: not our error.
                writing, pending = False, memoryview(b"")
        if mask & (select.POLLIN | select.POLLHUP | select.POLLERR):
            try:
                data = sock.recv(READ_CHUNK)
            except BlockingIOError:
                continue
            except OSError:
                return True  # connection reset: the exec (or the container) is gone
            if not data:
                return True
            demux.feed(data)
