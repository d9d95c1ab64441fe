"""How a run stops early: the engine-version check, and Ctrl-C during a rollout or an update."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

import pytest

from agentrl.rollout.trajectory import Trajectory
from agentrl.train.stopping import Sigint, check_engine_versions


def traj(version: int, version_max: int | None = None) -> Trajectory:
    return Trajectory(
        task_id="t",
        group_id="g",
        token_ids=[1, 2, 3],
        loss_mask=[0, 1, 1],
        behavior_logprobs=[0.0, -0.1, -0.2],
        prompt_len=1,
        reward=1.0,
        passed=True,
        finish_reason="submitted",
        policy_version=version,
        policy_version_max=version_max,
    )


def test_a_synchronous_batch_must_carry_exactly_the_pushed_version() -> None:
    assert check_engine_versions([traj(4), traj(4)], 4, "sync") is None
    stale = check_engine_versions([traj(4), traj(3)], 4, "sync")
    assert stale is not None and "3..4" in stale and "newest push is version 4" in stale
    # One token of an episode sampled after the push but its first before: still not the pushed policy.
    assert check_engine_versions([traj(3, 4)], 4, "sync") is not None


def test_an_asynchronous_batch_may_be_older_never_newer() -> None:
    assert check_engine_versions([traj(2), traj(3, 4)], 4, "async") is None
    newer = check_engine_versions([traj(4, 5)], 4, "async")
    assert newer is not None and "4..5" in newer


def test_nothing_to_check_before_counting_or_without_trajectories() -> None:
    assert check_engine_versions([traj(7)], -1, "sync") is None
    assert check_engine_versions([], 3, "sync") is None


def _rollout_interrupted(sigint: Sigint, cleaned: list[int], ctrl_c: Callable[[], None]) -> None:
    """Four episodes waiting on I/O; `ctrl_c` sends SIGINT from inside one of them or from another thread."""

    async def episode(i: int) -> None:
        try:
            if i == 0:
                await asyncio.sleep(0.05)
                ctrl_c()
            await asyncio.sleep(30)
        finally:
            cleaned.append(i)

    async def rollout() -> None:
        await asyncio.gather(*(episode(i) for i in range(4)))

    with sigint.rollout_phase():
        asyncio.run(rollout())


@pytest.mark.parametrize("where", ["inside an episode", "while the loop waits"])
def test_ctrl_c_during_a_rollout_cancels_every_episode_and_stops_cleanly(where: str, caplog) -> None:
    def ctrl_c() -> None:
        if where == "inside an episode":
            signal.raise_signal(signal.SIGINT)
        else:
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()

    cleaned: list[int] = []
    t0 = time.monotonic()
    with caplog.at_level(logging.DEBUG, logger="asyncio"), Sigint(listen=True) as sigint:
        with pytest.raises(KeyboardInterrupt):
            _rollout_interrupted(sigint, cleaned, ctrl_c)
        gc.collect()
    assert time.monotonic() - t0 < 10, "Ctrl-C waited for the episodes instead of stopping them"
    assert sorted(cleaned) == [0, 1, 2, 3], "every episode runs its own clean-up"
    # An interrupt raised inside a task leaves its exception unretrieved: asyncio prints a traceback.
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [
        r.getMessage() for r in caplog.records
    ]
    assert sigint.requested == 1 and not sigint.interruptible


def test_ctrl_c_during_an_update_waits_for_the_step_then_stops_before_the_next_rollout() -> None:
    with Sigint(listen=True) as sigint:
        signal.raise_signal(signal.SIGINT)  # during the update: only asks
        assert sigint.requested == 1
        with pytest.raises(KeyboardInterrupt), sigint.rollout_phase():
            pytest.fail("the next rollout must not start")
    assert signal.getsignal(signal.SIGINT) is not sigint._handle
