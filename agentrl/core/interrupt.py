"""Ctrl-C while an event loop runs: `interrupt` raises KeyboardInterrupt outside every task.

A SIGINT handler runs between two bytecodes of the main thread, wherever it is. When that is inside
an asyncio task (an episode's coroutine, in the middle of a log call), a `raise KeyboardInterrupt`
there ends that one task with the exception: nothing retrieves it, asyncio prints its traceback at
exit ("Task exception was never retrieved"), and the loop's other tasks are cancelled only when
`asyncio.run` closes. asyncio's own handler avoids this by cancelling the main task, but it installs
itself only over Python's default handler, and agentrl's handlers (the container reaper, the
trainer's Ctrl-C) stand in front of that.
"""

from __future__ import annotations

import asyncio

_pending: set[int] = set()
"""The loops (by id) whose scheduled interrupt has not run yet."""


def interrupt() -> None:
    """What a SIGINT handler calls instead of `raise KeyboardInterrupt`. Without an event loop running
    on this thread it raises at once. With one, it schedules the raise as the loop's next callback (and
    wakes a loop waiting for I/O): the interrupt leaves `run_until_complete` from the loop itself, no task
    ends with it, and `asyncio.run` then cancels every task and lets each run its own clean-up (an
    episode releases its sandbox) before the KeyboardInterrupt reaches its caller, as before. A second
    Ctrl-C before the loop got to the first (a task stuck in a blocking call) raises at once."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise KeyboardInterrupt from None
    if id(loop) in _pending:
        _pending.discard(id(loop))
        raise KeyboardInterrupt
    _pending.add(id(loop))
    loop.call_soon_threadsafe(_raise, id(loop))


def _raise(loop_id: int) -> None:
    if loop_id in _pending:  # not already raised at once by a second Ctrl-C
        _pending.discard(loop_id)
        raise KeyboardInterrupt
