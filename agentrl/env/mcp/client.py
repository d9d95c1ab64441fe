"""Connections to MCP servers for one episode: started, listed, called with deadlines, and closed with it.

The protocol is the MCP Python SDK's (`mcp.Client`: the handshake, the tool listing, calls and their
results as its typed models). What is ours is the transport and the rules around it:

- A stdio server inside the sandbox is `Sandbox.attach(argv)` (a `docker exec` whose stdio stays open,
  or a bwrap whose pipes we hold): newline-delimited JSON-RPC over it, read by a thread of ours that
  caps each message at `max_message_bytes` (a server that sends more has broken: the episode ends),
  and keeps the end of the server's stderr for the error that names why it stopped.
- A host stdio server is a subprocess in a session of its own, killed (its whole group) at close.
- A URL server goes through the SDK's Streamable HTTP client.

The SDK is async; an episode is not. Each connection runs its `Client` on an event loop of its own, on a
daemon thread, and the env's tool threads submit calls to it and wait with the call's deadline. A call
past its deadline is cancelled; if the server then answers a ping it is alive (the call is a timed-out
observation), if not it has hung, and `MCPServerError` ends the episode, as it does when the server
exits or breaks the protocol.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import os
import signal
import subprocess
import threading
import warnings
from collections.abc import Callable
from typing import Any

from agentrl.env.mcp.server import MCPServer
from agentrl.env.tools import ToolServerLost

# A server that answers no ping within this long after a call ran past its deadline has hung.
PING_GRACE_S = 5.0
# How much of a server's stderr is kept for the error that says why it stopped.
_STDERR_KEEP = 4096
# After its stdin closes, how long a host server has to exit before its group is killed.
_HOST_EXIT_GRACE_S = 2.0


class MCPServerError(ToolServerLost):
    """An MCP server failed: it did not start, exited, broke the protocol or stopped answering. Raised from a
    tool call it ends the episode (`env_error`) with this message as the reason."""

    def __init__(self, server: str, why: str):
        super().__init__(f"MCP server '{server}' {why}")
        self.server = server
        self.why = why


class MCPCallTimeout(Exception):
    """A call ran past its deadline, was cancelled, and the server still answers: the model reads a timeout."""


def _sdk() -> Any:
    try:
        import mcp
        import mcp_types
    except ImportError as exc:  # pragma: no cover - the dev and mcp extras install it
        raise ImportError(
            "MCP servers need the MCP Python SDK: pip install 'agentrl[mcp]' (the `mcp` package, 2.x)"
        ) from exc
    return mcp, mcp_types


# --------------------------------------------------------------------------------------
# The stdio transport: our byte stream (sandbox.attach, or a host process's pipes) as the SDK's streams
# --------------------------------------------------------------------------------------


class StdioBridge:
    """An SDK `Transport` over a byte stream with `send`, `read_loop` and `close` (`agentrl.sandbox.executor`'s
    `Transport`): newline-delimited JSON-RPC, each message capped at `max_message_bytes`."""

    def __init__(self, open_stream: Callable[[], Any], *, label: str, max_message_bytes: int):
        self._open_stream = open_stream
        self.label = label
        self.max_message_bytes = max_message_bytes
        self.stream: Any = None
        self.ended: str | None = None
        """Why the server's output ended (it exited, or broke the protocol); None while it runs."""
        self._stderr = bytearray()
        self._line = bytearray()
        self._closing = False
        self._reader: threading.Thread | None = None

    @property
    def stderr_tail(self) -> str:
        return self._stderr.decode(errors="replace").strip()[-800:]

    async def __aenter__(self) -> tuple[Any, Any]:
        import anyio
        from mcp.shared.message import SessionMessage

        mcp_types = _sdk()[1]
        loop = asyncio.get_running_loop()
        self.stream = await asyncio.to_thread(self._open_stream)
        to_session, self._read = anyio.create_memory_object_stream[SessionMessage | Exception](math.inf)
        self._write, from_session = anyio.create_memory_object_stream[SessionMessage](math.inf)

        def deliver(item: Any) -> None:
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                to_session.send_nowait(item)

        def on_line(line: bytes) -> None:
            if not line.strip():
                return
            try:
                item: Any = SessionMessage(
                    mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                )
            except ValueError as exc:
                item = exc
            loop.call_soon_threadsafe(deliver, item)

        def on_out(data: bytes) -> None:
            if self.ended is not None:
                return
            *lines, rest = (bytes(self._line) + data).split(b"\n")
            self._line = bytearray(rest)
            for line in lines:
                if len(line) > self.max_message_bytes:
                    break
                on_line(line)
            else:
                if len(self._line) <= self.max_message_bytes:
                    return
            self.ended = f"sent a message over {self.max_message_bytes} bytes (max_message_bytes)"
            with contextlib.suppress(Exception):
                self.stream.close()

        def on_err(data: bytes) -> None:
            self._stderr += data
            del self._stderr[:-_STDERR_KEEP]

        def read() -> None:
            try:
                self.stream.read_loop(on_out, on_err)
            except Exception as exc:
                if self.ended is None and not self._closing:
                    self.ended = f"could not be read: {type(exc).__name__}: {exc}"
            if self.ended is None and not self._closing:
                tail = self.stderr_tail
                self.ended = "exited" + (f"; its stderr ends: {tail}" if tail else " (no stderr)")
            with contextlib.suppress(RuntimeError):  # the loop is already closed at shutdown
                loop.call_soon_threadsafe(to_session.close)

        async def write() -> None:
            async for message in from_session:
                data = message.message.model_dump_json(by_alias=True, exclude_unset=True).encode() + b"\n"
                try:
                    await asyncio.to_thread(self.stream.send, data)
                except (OSError, ValueError) as exc:
                    if self.ended is None and not self._closing:
                        self.ended = f"stopped reading its input ({exc})"
                    to_session.close()
                    return

        self._reader = threading.Thread(target=read, name=f"mcp-{self.label}", daemon=True)
        self._reader.start()
        self._writer = asyncio.get_running_loop().create_task(write())
        return self._read, self._write

    async def __aexit__(self, *exc: object) -> None:
        self._closing = True
        self._writer.cancel()
        with contextlib.suppress(BaseException):
            await self._writer
        await asyncio.to_thread(self.close_stream)

    def close_stream(self) -> None:
        """End the stream (the server reads EOF; a sandbox's or host's kill does the rest)."""
        self._closing = True
        if self.stream is not None:
            with contextlib.suppress(Exception):
                self.stream.close()


class HostProcess:
    """A host stdio server: a subprocess in its own session, its pipes as a byte stream; `close` ends it
    (stdin closed, then its whole process group killed)."""

    def __init__(self, argv: list[str], *, env: dict[str, str], cwd: str | None):
        from agentrl.sandbox.executor import Pipes

        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, **env},
            cwd=cwd,
            start_new_session=True,
        )
        self._pipes = Pipes(self.proc)

    def send(self, data: bytes) -> None:
        self._pipes.send(data)

    def read_loop(self, on_out: Callable[[bytes], None], on_err: Callable[[bytes], None]) -> None:
        self._pipes.read_loop(on_out, on_err)

    def close(self) -> None:
        self._pipes.close()
        try:
            self.proc.wait(_HOST_EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(_HOST_EXIT_GRACE_S)


def _in_sandbox_argv(spec: MCPServer, workdir: str) -> list[str]:
    """The server's argv as the sandbox runs it: `env -C DIR VAR=... command` when it sets either."""
    assert spec.command is not None
    if not spec.env and spec.cwd in (None, workdir):
        return list(spec.command)
    prefix = ["env"] + (["-C", spec.cwd] if spec.cwd not in (None, workdir) else [])
    return [*prefix, *(f"{k}={v}" for k, v in spec.env.items()), *spec.command]


# --------------------------------------------------------------------------------------
# One connection
# --------------------------------------------------------------------------------------


class MCPConnection:
    """One server, connected for one episode: `tools` (the SDK's `Tool` models it listed), `call`, `close`."""

    def __init__(self, spec: MCPServer, sandbox: Any = None):
        self.spec = spec
        self.label = spec.label
        self.sandbox = sandbox
        self.tools: list[Any] = []
        self.server_name: str | None = None
        self._bridge: StdioBridge | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: Any = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._done = threading.Event()
        self._failure: BaseException | None = None
        self._closed = False
        self._lost: str | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def open(cls, spec: MCPServer, sandbox: Any = None) -> MCPConnection:
        """Start (or reach) the server, hand-shake, list its tools; `MCPServerError` past `startup_timeout_s`
        or when it fails."""
        if spec.in_sandbox and sandbox is None:
            raise MCPServerError(spec.label, "runs in the episode's sandbox, and this episode has none")
        conn = cls(spec, sandbox)
        conn._thread = threading.Thread(target=conn._run, name=f"mcp-loop-{spec.label}", daemon=True)
        conn._thread.start()
        if not conn._ready.wait(spec.startup_timeout_s):
            conn.close()
            raise MCPServerError(
                spec.label,
                f"did not start within {spec.startup_timeout_s:g}s (startup_timeout_s)" + conn._tail(),
            )
        if conn._failure is not None:
            conn.close()
            ended = conn._bridge.ended if conn._bridge is not None else None
            why = ended if ended is not None else f"{_describe(conn._failure)}{conn._tail()}"
            raise MCPServerError(spec.label, f"did not start: {why}")
        return conn

    def _tail(self) -> str:
        if self._bridge is None:
            return ""
        if self._bridge.ended and self._bridge.ended != "exited (no stderr)":
            return f" ({self._bridge.ended})"
        tail = self._bridge.stderr_tail
        return f"; its stderr ends: {tail}" if tail else ""

    def _transport(self) -> Any:
        spec = self.spec
        if spec.url is not None:
            return spec.url
        if spec.where == "sandbox":
            sandbox = self.sandbox

            def open_stream() -> Any:
                return sandbox.attach(_in_sandbox_argv(spec, sandbox.workdir))

        else:

            def open_stream() -> Any:
                assert spec.command is not None
                return HostProcess(list(spec.command), env=spec.env, cwd=spec.cwd)

        self._bridge = StdioBridge(open_stream, label=spec.label, max_message_bytes=spec.max_message_bytes)
        return self._bridge

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # the start failed: `open` reports it
            if not self._ready.is_set():
                self._failure = exc
        finally:
            self._lost = self._lost or "closed"
            self._ready.set()
            self._done.set()

    async def _main(self) -> None:
        mcp, mcp_types = _sdk()
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = self._transport()
        if isinstance(server, str) and self.spec.headers:
            from mcp.client.streamable_http import streamable_http_client

            server = _HTTPWithHeaders(streamable_http_client, server, self.spec.headers)
        # `legacy`: the initialize handshake every released server answers; the discovery probe of the
        # 2026 protocol costs a round trip and a logged error on each of them.
        client = mcp.Client(
            server,
            mode="legacy",
            client_info=mcp_types.Implementation(name="agentrl", version="0.1.0"),
            cache=None,
        )
        async with client:
            self._client = client
            info = client.server_info
            self.server_name = getattr(info, "name", None)
            self.tools = await self._list_tools()
            self._ready.set()
            await self._stop.wait()

    async def _list_tools(self) -> list[Any]:
        tools: list[Any] = []
        cursor = None
        for _ in range(100):  # a server whose cursor never ends cannot hang the start
            page = await self._client.list_tools(cursor=cursor)
            tools += page.tools
            cursor = page.next_cursor
            if not cursor:
                break
        wanted = self.spec.tools
        if wanted is not None:
            missing = sorted(set(wanted) - {t.name for t in tools})
            if missing:
                raise RuntimeError(f"lists no tool {missing} (it lists {sorted(t.name for t in tools)})")
            tools = [t for t in tools if t.name in wanted]
        return tools

    def close(self) -> None:
        """Stop the connection (and a stdio server with it). Safe to call twice, from any thread."""
        if self._closed:
            return
        self._closed = True
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not self._done.is_set():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
            # A shutdown stuck in the SDK: cut the stream (the loop's thread is a daemon).
            if not self._done.wait(10.0) and self._bridge is not None:
                self._bridge.close_stream()
        elif self._bridge is not None:
            self._bridge.close_stream()

    # --- calls ------------------------------------------------------------------------------

    def lost(self) -> str | None:
        """Why the server can no longer be used, or None."""
        if self._bridge is not None and self._bridge.ended is not None:
            return self._bridge.ended
        if self._done.is_set():
            return self._lost or "closed"
        return None

    def call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> Any:
        """`tools/call` within `timeout_s`: the SDK's `CallToolResult`. `MCPCallTimeout` when the call was
        cancelled at its deadline and the server still answers; `MCPServerError` when the server is gone,
        broke, or stopped answering; `ToolError` for an error the server answered with."""
        from mcp.shared.exceptions import MCPError

        from agentrl.env.tools import ToolError

        if (why := self.lost()) is not None:
            raise MCPServerError(self.label, why)
        future = self._submit(self._client.call_tool(name, arguments, read_timeout_seconds=timeout_s + 1.0))
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            if self._answers_ping(PING_GRACE_S):
                raise MCPCallTimeout(f"tools/call {name} ran past its {timeout_s:g}s deadline") from None
            raise MCPServerError(
                self.label,
                f"stopped answering: tools/call {name} ran past its {timeout_s:g}s deadline and a ping got no "
                f"answer within {PING_GRACE_S:g}s",
            ) from None
        except MCPError as exc:
            if (why := self.lost()) is not None:
                raise MCPServerError(self.label, f"{why} (during tools/call {name})") from None
            raise ToolError(
                f"the MCP server answered tools/call {name} with an error: {exc.error.message}"
            ) from None
        except concurrent.futures.CancelledError:
            raise MCPServerError(self.label, self.lost() or "closed during the call") from None
        except Exception as exc:
            if (why := self.lost()) is not None:
                raise MCPServerError(self.label, f"{why} (during tools/call {name})") from None
            raise MCPServerError(self.label, f"failed tools/call {name}: {_describe(exc)}") from None

    def _answers_ping(self, timeout_s: float) -> bool:
        if self.lost() is not None:
            return False
        with warnings.catch_warnings():  # ping is legacy-protocol API, and these connections are legacy
            warnings.simplefilter("ignore")
            future = self._submit(self._client.send_ping())
        try:
            future.result(timeout_s)
            return True
        except Exception:
            future.cancel()
            return False

    def _submit(self, coro: Any) -> concurrent.futures.Future:
        assert self._loop is not None
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError:  # the loop has stopped
            coro.close()
            raise MCPServerError(self.label, self.lost() or "closed") from None


class _HTTPWithHeaders:
    """The SDK's Streamable HTTP transport with headers of ours on every request."""

    def __init__(self, factory: Callable[..., Any], url: str, headers: dict[str, str]):
        import httpx

        self._cm = factory(url, http_client=httpx.AsyncClient(headers=headers, timeout=30.0))

    async def __aenter__(self) -> Any:
        return await self._cm.__aenter__()

    async def __aexit__(self, *exc: Any) -> Any:
        return await self._cm.__aexit__(*exc)


def _describe(exc: BaseException) -> str:
    """An exception as one line, through the exception groups anyio wraps failures in."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"
