"""`interrupt`: a SIGINT handler's KeyboardInterrupt raised from the event loop, outside every task."""

from __future__ import annotations

import asyncio
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


def test_a_second_ctrl_c_before_the_loop_gets_to_the_first_raises_at_once(handler) -> None:
    """A task stuck in a blocking call never yields to the loop: the second Ctrl-C must not wait for it."""
    reached: list[str] = []

    async def stuck() -> None:
        signal.raise_signal(signal.SIGINT)  # scheduled: the loop runs it at the next callback
        reached.append("after the first")
        signal.raise_signal(signal.SIGINT)  # still in this callback: raised here
        reached.append("after the second")

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(stuck())
    assert reached == ["after the first"]
    with pytest.raises(KeyboardInterrupt):  # and nothing stays pending for the next loop
        asyncio.run(_one_ctrl_c())


async def _one_ctrl_c() -> None:
    signal.raise_signal(signal.SIGINT)
    await asyncio.sleep(5)
    pytest.fail("the interrupt did not come")
