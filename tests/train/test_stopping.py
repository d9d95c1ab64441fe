"""The engine-version check that stops a run whose engine is not sampling from the newest push."""

from __future__ import annotations

from agentrl.rollout.trajectory import Trajectory
from agentrl.train.stopping import check_engine_versions


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
