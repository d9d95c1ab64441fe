"""A TCP listener on this machine's loopback: the address a sandbox without network must not reach.

Network-isolation tests aim here, never at an outside host: a sandbox that shared this machine's network
would connect (and the listener would count it); an isolated one has a loopback of its own, where nothing
listens. Import the fixture into a test module (`from tests.fixtures_net import loopback_listener`).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest


@dataclass
class Listener:
    port: int
    accepted: list[tuple[str, int]] = field(default_factory=list)
    """The peers of every connection accepted so far."""

    def reachable_from_here(self) -> bool:
        """The control: this process does reach it (so a sandbox that does not is isolated, not misaimed)."""
        before = len(self.accepted)
        socket.create_connection(("127.0.0.1", self.port), timeout=3).close()
        for _ in range(100):
            if len(self.accepted) > before:
                return True
            threading.Event().wait(0.02)
        return False


@pytest.fixture
def loopback_listener() -> Iterator[Listener]:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    listener = Listener(server.getsockname()[1])
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, peer = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            listener.accepted.append(peer)
            conn.close()

    thread = threading.Thread(target=serve, name="loopback-listener", daemon=True)
    thread.start()
    try:
        yield listener
    finally:
        stop.set()
        thread.join(timeout=2)
        server.close()
