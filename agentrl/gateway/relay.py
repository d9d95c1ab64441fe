"""A harness command run inside the sandbox, linked to its gateway session over the sandbox's own channel.

The sandbox keeps no network. One process attached to it (`Sandbox.attach`: a `docker exec` whose stdio
stays open, or a bwrap whose pipes we hold) runs `relay_inside`: it listens on the sandbox's loopback,
starts the command with `OPENAI_BASE_URL` pointing there, and carries each connection over its stdio in
frames. Here, on the host, every connection it opens is connected to the gateway, and to nothing else:
whatever the command sends reaches the gateway's HTTP server, where only its own session's URL answers.

    relay = CommandRelay(sandbox.attach(relay_argv()), connect=gateway.connect)
    relay.start(argv, env=..., cwd="/workspace", path="/s/<token>/v1")
    code = relay.wait(timeout_s)      # the command's exit code; None: it did not finish
    relay.close()

The command runs as the agent, and so may anything it starts; what it could forge is kept from counting.
The relay is non-dumpable (`relay_inside`), so nothing of the agent's can reach its stdio through /proc
to write frames of its own; and the command's exit code is taken from what the host sees of the relay's
process (docker's record of the exec, the bwrap process's exit), checked against the relay's `EXIT`
frame: a frame without a matching exit, or an exit without a frame, is a broken relay (`broken`), an
episode that ends in an error, never one that counts as the command having succeeded.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from agentrl.sandbox.executor import stdin_program_argv

HEADER = struct.Struct(">BII")
OPEN, DATA, CLOSE, OUT, EXIT = 1, 2, 3, 4, 5
# A frame the relay never sends (its reads are 64 KiB): larger means the stream is not the relay's.
MAX_FRAME = 1 << 20
# Connections one command may hold open to the gateway at once (a harness needs one or a few).
MAX_CONNECTIONS = 64
URL_VARS = ("OPENAI_BASE_URL", "OPENAI_API_BASE")
"""Set to the session's URL inside the sandbox (the SDK's name, and the older one litellm also reads)."""


@cache
def _script() -> bytes:
    return (Path(__file__).parent / "relay_inside.py").read_bytes()


def relay_argv(python: str = "python3") -> list[str]:
    """The process to attach: the image's python, reading the relay's source from its stdin."""
    return stdin_program_argv(_script(), "agentrl-relay", python)


class RelayBroken(Exception):
    """The relay's stream ended or carried something that is not a frame (killed or replaced from inside)."""


class CommandRelay:
    """The host end: frames from the sandbox to gateway connections and back, the command's output and exit."""

    def __init__(
        self, transport: Any, *, connect: Callable[[], socket.socket], output_limit: int = 64 * 1024
    ):
        self.transport = transport
        self.connect = connect
        self.output_limit = output_limit
        self.exit_code: int | None = None
        self._frame_code: int | None = None
        self.broken: str | None = None
        """Why the relay's stream ended before the command's exit came (None while it has not)."""
        self.connections = 0
        self._output = bytearray()
        self._stderr = bytearray()
        self._buf = bytearray()
        self._send_lock = threading.Lock()
        self._conns: dict[int, socket.socket] = {}
        self._conns_lock = threading.Lock()
        self._done = threading.Event()
        self._closed = False
        self._reader: threading.Thread | None = None

    # --- lifecycle -------------------------------------------------------------------------------------

    def start(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str,
        path: str,
        url_vars: Sequence[str] = URL_VARS,
    ) -> None:
        """Send the relay's source and the command; returns at once (the command runs until `wait`)."""
        config = json.dumps(
            {"argv": list(argv), "env": dict(env), "cwd": cwd, "path": path, "url_vars": list(url_vars)}
        ).encode()
        self._reader = threading.Thread(target=self._read, name="agentrl-relay", daemon=True)
        self._reader.start()
        self._send(_script() + struct.pack(">I", len(config)) + config)

    def wait(self, timeout_s: float | None = None) -> int | None:
        """The command's exit code once it has exited (negative: killed by that signal); None if it has
        not within `timeout_s`, or if the relay's stream broke first (`broken` says why)."""
        self._done.wait(timeout_s)
        return self.exit_code

    @property
    def output(self) -> str:
        """The command's output (stdout and stderr interleaved), its first `output_limit` bytes."""
        return self._output.decode(errors="replace")

    @property
    def stderr(self) -> str:
        """The relay's own stderr (a python that cannot start it says so here)."""
        return self._stderr.decode(errors="replace")

    def close(self) -> None:
        """End the link: the relay reads EOF and kills the command's group; every connection is closed."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.transport.close()
        with self._conns_lock:
            conns, self._conns = list(self._conns.values()), {}
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.close()
        self._done.set()

    # --- the stream ------------------------------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        with self._send_lock:
            self.transport.send(data)

    def _frame(self, kind: int, conn: int, payload: bytes = b"") -> None:
        with contextlib.suppress(OSError, ValueError):
            self._send(HEADER.pack(kind, conn, len(payload)) + payload)

    def _read(self) -> None:
        try:
            self.transport.read_loop(self._on_out, self._on_err)
        except RelayBroken as exc:
            self.broken = str(exc)
        except Exception as exc:  # the stream failed under us: the episode ends, the run goes on
            self.broken = f"the relay's stream failed: {exc}"
        if self._frame_code is not None and self.broken is None and not self._closed:
            self._settle(self._frame_code)
        if self.exit_code is None and self.broken is None and not self._closed:
            tail = self.stderr.strip()[-300:]
            self.broken = "the relay in the sandbox ended before the command did (killed from inside?)" + (
                f": {tail}" if tail else ""
            )
        self.close()

    def _on_err(self, data: bytes) -> None:
        if len(self._stderr) < self.output_limit:
            self._stderr += data[: self.output_limit - len(self._stderr)]

    def _on_out(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        while len(buf) >= HEADER.size:
            kind, conn, size = HEADER.unpack_from(buf)
            if kind not in (OPEN, DATA, CLOSE, OUT, EXIT) or size > MAX_FRAME:
                raise RelayBroken(
                    f"the relay's stream carried something that is not a frame (kind {kind}, {size} bytes): "
                    "replaced or written to from inside"
                )
            if len(buf) < HEADER.size + size:
                return
            payload = bytes(buf[HEADER.size : HEADER.size + size])
            del buf[: HEADER.size + size]
            self._dispatch(kind, conn, payload)

    def _dispatch(self, kind: int, conn: int, payload: bytes) -> None:
        if kind == OPEN:
            self._open(conn)
        elif kind == DATA:
            with self._conns_lock:
                sock = self._conns.get(conn)
            if sock is not None:
                try:
                    sock.sendall(payload)
                except OSError:
                    self._drop(conn)
                    self._frame(CLOSE, conn)
        elif kind == CLOSE:
            with self._conns_lock:
                sock = self._conns.get(conn)
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)  # the command is done sending; the reply still comes
        elif kind == OUT:
            room = self.output_limit - len(self._output)
            if room > 0:
                self._output += payload[:room]
        elif kind == EXIT:
            if self._frame_code is not None:
                raise RelayBroken("the relay's stream carried a second exit frame: written to from inside")
            try:
                self._frame_code = int(payload.decode())
            except ValueError:
                raise RelayBroken(
                    f"the relay sent an exit code that is not a number: {payload[:40]!r}"
                ) from None
            # Not final until the relay's process has exited as the frame says (`_settle`).

    def _settle(self, frame_code: int) -> None:
        """The command's exit code, once the relay's own process exited with the status the frame
        announced (128 + N for a signal N); otherwise the relay is broken."""
        status = getattr(self.transport, "exit_status", None)
        try:
            seen = status() if callable(status) else None
        except Exception as exc:
            seen, why = None, f"{type(exc).__name__}: {exc}"
        else:
            why = "the transport does not report it" if not callable(status) else "it did not exit"
        expected = 128 - frame_code if frame_code < 0 else frame_code & 0xFF
        if seen is None:
            self.broken = (
                f"the relay's exit status could not be read ({why}): its exit frame alone is not trusted"
            )
        elif seen != expected:
            self.broken = (
                f"the relay's exit frame says the command exited {frame_code}, but the relay's process exited "
                f"{seen}: frames were written into its stream from inside, or it was killed"
            )
        else:
            self.exit_code = frame_code

    def _open(self, conn: int) -> None:
        with self._conns_lock:
            if conn in self._conns or self._closed:
                return
            full = len(self._conns) >= MAX_CONNECTIONS
        if full:  # a command opening connections without end gets no more gateway sockets
            self._frame(CLOSE, conn)
            return
        try:
            sock = self.connect()
        except OSError:
            self._frame(CLOSE, conn)
            return
        with self._conns_lock:
            self._conns[conn] = sock
            self.connections += 1
        threading.Thread(
            target=self._downstream, args=(conn, sock), name="agentrl-relay-conn", daemon=True
        ).start()

    def _downstream(self, conn: int, sock: socket.socket) -> None:
        # The gateway's reply on one connection, to the sandbox.
        try:
            while True:
                data = sock.recv(1 << 16)
                if not data:
                    break
                self._frame(DATA, conn, data)
        except OSError:
            pass
        self._drop(conn)
        self._frame(CLOSE, conn)

    def _drop(self, conn: int) -> None:
        with self._conns_lock:
            sock = self._conns.pop(conn, None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
