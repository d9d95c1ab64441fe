"""The relay between a harness command in the sandbox and its gateway session, on the local backend (the
docker and bwrap runs are in test_command.py): connections carried both ways, the command's output
capped, its exit code, connections bounded, and a stream that is not the relay's frames refused."""

from __future__ import annotations

import socket
import socketserver
import sys
import threading
from pathlib import Path

import pytest

from agentrl.gateway.images import _rewrite_scripts
from agentrl.gateway.relay import MAX_CONNECTIONS, CommandRelay, relay_argv
from agentrl.sandbox.local import LocalSandbox

# Connects to the session URL's port, sends one line per connection, prints the replies.
CLIENT = r"""
import os, socket, sys
from urllib.parse import urlsplit
url = urlsplit(os.environ["OPENAI_BASE_URL"])
print("PATH", url.path, os.environ["OPENAI_API_BASE"] == os.environ["OPENAI_BASE_URL"], os.environ["MINE"])
n = int(sys.argv[1])
held = []
for i in range(n):
    s = socket.create_connection((url.hostname, url.port))
    s.sendall(b"hello %d\n" % i)
    held.append(s)
for i, s in enumerate(held):
    print(s.makefile("rb").readline().decode().strip() or "closed")
print("x" * int(sys.argv[2]), end="")
sys.exit(int(sys.argv[3]))
"""


class _Echo(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        line = self.rfile.readline()
        self.server.seen += 1  # type: ignore[attr-defined]  (before the reply the command waits for)
        self.wfile.write(b"echo " + line)
        self.rfile.read()  # held open until the relay closes it


@pytest.fixture
def echo():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    server.seen = 0  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def sandbox():
    sb = LocalSandbox()
    yield sb
    sb.close()


def _relay(sandbox, echo, argv, *, output_limit=64 * 1024) -> CommandRelay:
    relay = CommandRelay(
        sandbox.attach(relay_argv(sys.executable)),
        connect=lambda: socket.create_connection(echo.server_address),
        output_limit=output_limit,
    )
    relay.start(argv, env={"MINE": "yes"}, cwd=str(sandbox.host_workdir), path="/s/token/v1")
    return relay


def test_connections_go_to_the_gateway_and_back_and_the_exit_code_returns(sandbox, echo):
    relay = _relay(sandbox, echo, [sys.executable, "-c", CLIENT, "3", "100", "7"])
    try:
        assert relay.wait(60) == 7 and relay.broken is None
    finally:
        relay.close()
    lines = relay.output.splitlines()
    assert lines[0] == "PATH /s/token/v1 True yes"
    assert lines[1:4] == ["echo hello 0", "echo hello 1", "echo hello 2"]
    assert relay.connections == 3 and echo.seen == 3


def test_output_is_capped_and_connections_are_bounded(sandbox, echo):
    n = MAX_CONNECTIONS + 6
    relay = _relay(sandbox, echo, [sys.executable, "-c", CLIENT, str(n), "1000000", "0"], output_limit=4096)
    try:
        assert relay.wait(120) == 0
    finally:
        relay.close()
    assert len(relay.output) == 4096  # the first 4 KiB kept, the rest dropped on the host
    assert relay.connections == MAX_CONNECTIONS and echo.seen == MAX_CONNECTIONS


def test_a_stream_that_is_not_frames_breaks_the_link(sandbox, echo):
    """What the attached process writes is the relay's frames or nothing: anything else (the relay
    replaced by something else) ends the link with a reason, and no exit code."""
    relay = CommandRelay(
        sandbox.attach([sys.executable, "-c", "import sys; sys.stdout.write('HTTP/1.1 200 OK' * 100)"]),
        connect=lambda: socket.create_connection(echo.server_address),
    )
    relay.start(["true"], env={}, cwd=str(sandbox.host_workdir), path="/s/t/v1")
    try:
        assert relay.wait(30) is None
    finally:
        relay.close()
    assert "not a frame" in relay.broken and echo.seen == 0


def test_a_command_that_cannot_start_exits_127(sandbox, echo):
    relay = _relay(sandbox, echo, ["/nonexistent/agent"])
    try:
        assert relay.wait(30) == 127
    finally:
        relay.close()
    assert "could not start" in relay.output


def test_console_scripts_run_the_images_python(tmp_path: Path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "mini").write_bytes(b"#!/root/.pyenv/versions/3.11.7/bin/python3.11\nimport sys\n")
    (bin_dir / "data.txt").write_bytes(b"not a script\n")
    _rewrite_scripts(bin_dir)
    assert (bin_dir / "mini").read_bytes() == b"#!/usr/bin/env python3\nimport sys\n"
    assert (bin_dir / "data.txt").read_bytes() == b"not a script\n"


# The command (the agent) goes for the relay's stdout through /proc and writes a forged output frame
# and an exit-0 frame there, then exits 3. It prints what it could reach.
FORGE = r"""
import os, struct, sys
relay = os.getppid()
try:
    print("LIST", sorted(os.listdir(f"/proc/{relay}/fd")), flush=True)
except OSError as exc:
    print("LIST", type(exc).__name__, flush=True)
frames = struct.pack(">BII", 4, 0, 7) + b"forged\n" + struct.pack(">BII", 5, 0, 1) + b"0"
try:
    with open(f"/proc/{relay}/fd/1", "wb") as out:
        out.write(frames)
    print("WROTE", flush=True)
except OSError as exc:
    print("OPEN", type(exc).__name__, flush=True)
sys.exit(3)
"""


def test_a_forged_exit_frame_does_not_count_the_process_s_exit_does(sandbox, echo):
    """On the local backend (the host's root may open any process's descriptors) the command does write
    its frames into the relay's stream; the exit code still comes from the relay's process, which
    exits 3, so the link is broken instead of the command counting as a success."""
    relay = _relay(sandbox, echo, [sys.executable, "-c", FORGE])
    try:
        code = relay.wait(60)
    finally:
        relay.close()
    if "WROTE" in relay.output or "forged" in relay.output:
        assert code is None and relay.broken and "exit" in relay.broken, (code, relay.broken, relay.output)
    else:  # not root here: it could not even open them
        assert code == 3 and relay.broken is None, relay.output


@pytest.mark.docker
@pytest.mark.parametrize("backend", ["docker", "bwrap"])
def test_in_a_sandbox_the_relay_s_stdio_is_out_of_the_agent_s_reach(backend, request):
    """The relay is non-dumpable: the command, as the agent, cannot open its descriptors through /proc
    (on docker not even list them; on bwrap, where the one mapped uid owns every /proc entry, it sees
    their numbers), and its exit status (3) is what the host reads."""
    from agentrl.sandbox.base import open_sandbox

    if backend == "bwrap":
        request.getfixturevalue("bwrap_path")
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sb = open_sandbox(backend, image="agentrl/base:bookworm")
    try:
        relay = CommandRelay(
            sb.attach(relay_argv("python3")), connect=lambda: socket.create_connection(server.server_address)
        )
        relay.start(["python3", "-c", FORGE], env={}, cwd=sb.workdir, path="/s/t/v1")
        try:
            code = relay.wait(120)
        finally:
            relay.close()
    finally:
        sb.close()
        server.shutdown()
        server.server_close()
    assert code == 3 and relay.broken is None, (code, relay.broken, relay.output)
    assert "OPEN PermissionError" in relay.output and "WROTE" not in relay.output, relay.output
    if backend == "docker":
        assert "LIST PermissionError" in relay.output, relay.output
