"""`interrupt`: a SIGINT handler's KeyboardInterrupt raised from the event loop, outside every task."""

from __future__ import annotations

import signal

import pytest

from agentrl.core.interrupt import interrupt
from tests.interrupted_loop import WHERE, assert_stopped_cleanly, capture, run_episodes


@pytest.fixture
def handler():
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupt())
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("where", WHERE)
def test_ctrl_c_during_a_loop_cancels_every_task_and_raises_out_of_asyncio_run(
    where, handler, caplog
) -> None:
    with capture(caplog) as seen, pytest.raises(KeyboardInterrupt):
        run_episodes(where, seen)
    assert_stopped_cleanly(seen)


def test_without_a_loop_it_raises_at_once(handler) -> None:
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
