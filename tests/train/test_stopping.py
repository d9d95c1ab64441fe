"""How a run stops early: the engine-version check, and Ctrl-C during a rollout or an update."""

from __future__ import annotations

import signal

import pytest

from agentrl.rollout.trajectory import Trajectory
from agentrl.train.stopping import Sigint, check_engine_versions
from tests.interrupted_loop import WHERE, assert_stopped_cleanly, capture, run_episodes


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


@pytest.fixture
def ctrl_c_heard():
    """Python's own SIGINT handler for the test: a suite started in the background by a script inherits
    SIGINT ignored, and `Sigint` then (rightly) keeps ignoring it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("ctrl_c_heard")
@pytest.mark.parametrize("where", WHERE)
def test_ctrl_c_during_a_rollout_stops_every_episode_cleanly(where: str, caplog) -> None:
    sigint = Sigint(listen=True)
    with capture(caplog) as seen, sigint, pytest.raises(KeyboardInterrupt), sigint.rollout_phase():
        run_episodes(where, seen)
    assert_stopped_cleanly(seen)
    assert sigint.requested == 1 and not sigint.interruptible


@pytest.mark.usefixtures("ctrl_c_heard")
def test_ctrl_c_during_an_update_waits_for_the_step_then_stops_before_the_next_rollout() -> None:
    with Sigint(listen=True) as sigint:
        signal.raise_signal(signal.SIGINT)  # during the update: only asks
        assert sigint.requested == 1
        with pytest.raises(KeyboardInterrupt), sigint.rollout_phase():
            pytest.fail("the next rollout must not start")
    assert signal.getsignal(signal.SIGINT) is not sigint._handle
