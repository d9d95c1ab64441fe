"""Ctrl-C in the middle of an event loop's episodes, for the tests of the SIGINT handlers that must stop
them cleanly (`agentrl.core.interrupt`): four tasks waiting, the signal sent from inside one of them or
from another thread while the loop waits for I/O."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

WHERE = ["inside an episode", "while the loop waits"]


@dataclass
class Interrupted:
    cleaned: list[int] = field(default_factory=list)
    """The episodes whose clean-up (a `finally`) ran."""
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)
    """What asyncio logged at ERROR: an interrupt raised inside a task leaves its exception unretrieved."""


def ctrl_c(where: str) -> None:
    if where == "inside an episode":
        signal.raise_signal(signal.SIGINT)
    else:
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()


@contextlib.contextmanager
def capture(caplog: pytest.LogCaptureFixture) -> Iterator[Interrupted]:
    seen = Interrupted()
    t0 = time.monotonic()
    with caplog.at_level(logging.DEBUG, logger="asyncio"):
        yield seen
        gc.collect()  # an unretrieved task exception is logged when the task is collected
    seen.seconds = time.monotonic() - t0
    seen.errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def run_episodes(where: str, seen: Interrupted) -> None:
    """`asyncio.run` of four episodes sleeping 30 s; episode 0 sends Ctrl-C after 50 ms (`where`)."""

    async def episode(i: int) -> None:
        try:
            if i == 0:
                await asyncio.sleep(0.05)
                ctrl_c(where)
            await asyncio.sleep(30)
        finally:
            seen.cleaned.append(i)

    async def episodes() -> None:
        await asyncio.gather(*(episode(i) for i in range(4)))

    asyncio.run(episodes())


def assert_stopped_cleanly(seen: Interrupted) -> None:
    assert seen.seconds < 10, "Ctrl-C waited for the episodes instead of stopping them"
    assert sorted(seen.cleaned) == [0, 1, 2, 3], "every episode runs its own clean-up"
    assert not seen.errors, seen.errors
