"""The rollout producer's scheduling: synchronous batches are built when asked; asynchronous ones one
ahead at most, in order, with a failure raised in the caller's thread. `batch()` itself (episodes
through vLLM and the environments) is covered end to end by tests/train/test_trainer.py."""

from __future__ import annotations

import time

import pytest

from agentrl.train.config import TrainConfig
from agentrl.train.producer import RolloutProducer


class Counting(RolloutProducer):
    """Numbers its batches instead of playing episodes; records how many were started."""

    def __init__(self, mode: str, fail_at: int | None = None):
        super().__init__(TrainConfig(model="m", asynchronous={"mode": mode}), policy=None)
        self.started = 0
        self.fail_at = fail_at

    def batch(self, curriculum):  # type: ignore[override]
        self.started += 1
        if self.started == self.fail_at:
            raise RuntimeError(f"batch {self.started} failed")
        return Numbered(self.started)


class Numbered(int):
    """A batch that is its number (and has the metrics dict the producer adds its timings to)."""

    def __new__(cls, n: int):
        batch = super().__new__(cls, n)
        batch.metrics = {}
        return batch


def test_sync_builds_each_batch_when_asked():
    producer = Counting("sync")
    assert [producer.next_batch(None), producer.next_batch(None)] == [1, 2]
    assert producer.started == 2


def test_async_is_one_batch_ahead_at_most():
    producer = Counting("async")
    assert producer.next_batch(None) == 1
    deadline = time.monotonic() + 5  # taking batch 1 lets the thread build batch 2...
    while producer.started < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(1.0)  # ...and not batch 3, however long the trainer takes
    assert producer.started == 2
    assert producer.next_batch(None) == 2
    producer.stop(wait=True)  # returns once the thread is done: a batch in flight (3) or none
    assert producer.started in (2, 3) and not producer._worker.is_alive()


def test_async_failure_is_raised_in_the_callers_thread():
    producer = Counting("async", fail_at=2)
    assert producer.next_batch(None) == 1
    with pytest.raises(RuntimeError, match="batch 2 failed"):
        producer.next_batch(None)
    producer.stop(wait=True)


class Scripted(RolloutProducer):
    """Builds real batches from scripted groups (no engine), each taking `rollout_s`."""

    def __init__(self, mode: str, rollout_s: float):
        super().__init__(
            TrainConfig(model="m", asynchronous={"mode": mode}, curriculum={"batch_groups": 2}), None
        )
        self.rollout_s = rollout_s

    def groups(self, draws):  # type: ignore[override]
        from tests.train.test_curriculum import group

        with self._requests.held():  # generation in the engine the whole time
            time.sleep(self.rollout_s)
        return [group(d.task_id, [1.0, 0.0]) for d in draws]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_engine_idle_and_trainer_wait_are_logged_per_batch(mode):
    """The engines' idle time is the time with no generation request in them since the last batch was
    handed on; the trainer's, its wait for the batch."""
    from agentrl.train.curriculum import Curriculum
    from tests.train.test_curriculum import make_task

    producer = Scripted(mode, rollout_s=0.3)
    curriculum = Curriculum(make_task)
    first = producer.next_batch(curriculum)
    assert first.metrics["time/engine_idle_s"] < 0.1 and first.metrics["time/trainer_wait_s"] >= 0.3
    time.sleep(1.2)  # the trainer's update (long against the rollout: a loaded box delays the thread)
    second = producer.next_batch(curriculum)
    if mode == "sync":  # the engine idled through the update, the trainer waits for the whole rollout
        assert second.metrics["time/engine_idle_s"] >= 1.2 and second.metrics["time/trainer_wait_s"] >= 0.3
    else:  # built during the update: the trainer did not wait, and the engine started it at once
        assert second.metrics["time/trainer_wait_s"] < 0.6
        assert second.metrics["time/engine_idle_s"] < 0.6
        assert second.metrics["async/queue_depth"] == 0.0  # one batch ahead at most (max_staleness 1)
    producer.stop(wait=True)


class Versioned(RolloutProducer):
    """Batches of random duration that record the policy version they started under."""

    def __init__(self, k: int, seed: int):
        import random

        super().__init__(TrainConfig(model="m", asynchronous={"mode": "async", "max_staleness": k}), None)
        self.version = 0  # the trainer's: one more after each batch it trains
        self.rng = random.Random(seed)
        self.started = 0

    def batch(self, curriculum):  # type: ignore[override]
        start_version, n = self.version, self.started
        self.started += 1
        time.sleep(self.rng.uniform(0.0, 0.01))  # episodes of random length
        batch = Numbered(n)
        batch.start_version = start_version
        return batch


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_no_batch_is_trained_more_than_max_staleness_versions_after_it_started(k):
    for seed in range(3):
        producer = Versioned(k, seed)
        ages = []
        for n in range(12):
            batch = producer.next_batch(None)
            assert batch == n  # in order
            ages.append(producer.version - batch.start_version)  # trained now, at the current version
            time.sleep(producer.rng.uniform(0.02, 0.05))  # the update, of random length
            producer.version += 1
        producer.stop(wait=True)
        assert max(ages) <= k, ages
        if k == 0:  # the synchronous mode: built when asked, by the caller's thread
            assert ages == [0] * 12 and producer._worker is None
        else:
            assert max(ages) >= 1  # batches run ahead while the trainer works


class Deterministic(RolloutProducer):
    """Scripted groups whose rewards are a function of the task: the same draws give the same batches."""

    def __init__(self, mode: str, k: int = 1):
        cfg = TrainConfig(
            model="m",
            asynchronous={"mode": mode, "max_staleness": k},
            curriculum={"batch_groups": 2, "min_band_tasks": 1},
        )
        super().__init__(cfg, None)

    def groups(self, draws):  # type: ignore[override]
        from tests.train.test_curriculum import group

        time.sleep(0.01)
        return [group(d.task_id, [1.0, 0.0] if d.index % 3 else [1.0, 1.0]) for d in draws]


def test_each_async_batch_carries_the_curriculum_state_right_after_it_as_the_sync_run_has_it():
    """What a checkpoint after batch n records is the state after batch n, however far ahead the
    producer has drawn since: a resume redraws exactly the batches that were not trained."""
    from agentrl.train.curriculum import Curriculum
    from tests.train.test_curriculum import make_task

    sync, ahead = Deterministic("sync"), Deterministic("async", k=3)
    sync_cur, ahead_cur = Curriculum(make_task), Curriculum(make_task)
    for _ in range(4):
        want = sync.next_batch(sync_cur)
        got = ahead.next_batch(ahead_cur)
        time.sleep(0.1)  # the producer runs ahead meanwhile, drawing from its curriculum
        assert got.curriculum_state == want.curriculum_state and got.rollout_calls == want.rollout_calls
        assert [g[0].task_id for g in got.result.groups] == [g[0].task_id for g in want.result.groups]
    assert ahead_cur.state_dict() != sync_cur.state_dict()  # it did draw ahead
    ahead.stop(wait=True)


class Overlapping(RolloutProducer):
    """Scripted groups of random duration on the overlap path; each group records the trainer's version
    when it started, and each call when it ran (to see batches being built at the same time)."""

    def __init__(self, k: int, seed: int, concurrency: int = 64):
        import random
        import threading

        cfg = TrainConfig(
            model="m",
            asynchronous={"mode": "async", "max_staleness": k, "overlap": True},
            curriculum={"batch_groups": 2, "min_band_tasks": 1},
            rollout={"concurrency": concurrency},
        )
        super().__init__(cfg, None)
        self.version = 0  # the trainer's: one more after each batch it trains
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.spans: list[tuple[str, float, float]] = []  # (thread, start, end) of each call

    def groups(self, draws):  # type: ignore[override]
        import threading

        from tests.train.test_curriculum import group

        started, t0 = self.version, time.perf_counter()
        with self.lock:
            pause = self.rng.uniform(0.0, 0.03) * (10 if self.rng.random() < 0.1 else 1)  # a long tail
        time.sleep(pause)
        out = []
        for d in draws:
            g = group(d.task_id, [1.0, 0.0] if d.index % 3 else [1.0, 1.0], group_id=f"{d.task_id}@{t0}")
            for t in g:
                t.policy_version = started
            out.append(g)
        with self.lock:
            self.spans.append((threading.current_thread().name, t0, time.perf_counter()))
        return out


@pytest.mark.parametrize("k", [1, 2, 3])
def test_overlapping_batches_keep_the_staleness_bound_and_come_in_order(k):
    """`asynchronous.overlap`: the batches the admission lets start are built at the same time, on
    threads of their own, and handed on in order; a group started at version v is trained at a version
    at most v + k, whatever the episodes' durations."""
    from agentrl.train.curriculum import Curriculum
    from tests.train.test_curriculum import make_task

    for seed in range(2):
        producer = Overlapping(k, seed)
        curriculum = Curriculum(make_task)
        ages, building = [], []
        for _ in range(10):
            batch = producer.next_batch(curriculum)
            ages += [producer.version - t.policy_version for g in batch.result.groups for t in g]
            building.append(batch.metrics["async/batches_building"])
            time.sleep(producer.rng.uniform(0.0, 0.02))  # the update
            producer.version += 1
        producer.stop(wait=True)
        assert ages and max(ages) <= k, ages
        threads = {name for name, _, _ in producer.spans}
        assert len(threads) >= 10  # a thread per batch
        if k > 1:  # two batches' calls ran at the same time at least once
            spans = sorted(producer.spans, key=lambda s: s[1])
            assert any(a[0] != b[0] and b[1] < a[2] for i, a in enumerate(spans) for b in spans[i + 1 :]), (
                spans
            )
            assert max(building) >= 2
        assert not any(t.is_alive() for t in producer._builders)


def test_overlapping_batches_teach_the_curriculum_in_batch_order_and_only_what_was_handed_on():
    """The state a batch carries holds the evidence of exactly the batches handed on up to it (every
    group they generated, dropped ones included), none of a batch still being built; one stopped
    mid-way teaches nothing."""
    from agentrl.train.curriculum import Curriculum
    from tests.train.test_curriculum import make_task

    producer = Overlapping(3, seed=0)
    curriculum = Curriculum(make_task)
    seen = 0
    for _ in range(6):
        batch = producer.next_batch(curriculum)
        result = batch.result
        seen += sum(len(g) for g in (*result.groups, *result.dropped, *result.surplus))
        time.sleep(0.05)  # the batches behind it are being built meanwhile
        assert sum(t["samples"] for t in batch.curriculum_state["tasks"]) == seen
    producer.stop(wait=True)
    assert sum(s.samples for s in curriculum.tasks.values()) >= seen  # those handed on after the last take


def test_the_engines_idle_time_counts_only_the_time_without_a_request_in_them():
    """Requests from episodes of two overlapping batches: idle is only where none of them is in the
    engine (the episodes' tool calls, waits in the long tail), whichever batch the requests came from."""
    import asyncio

    from agentrl.train.producer import _Counted, _Occupancy

    class Engine:
        version = 3

        async def generate(self, seconds):
            await asyncio.sleep(seconds)
            return seconds

    requests = _Occupancy()
    policy = _Counted(Engine(), requests)
    assert policy.version == 3  # everything but generate reads through
    assert requests.take_idle() == 0.0  # nothing has run yet: no idle time to count

    async def episodes():
        await asyncio.gather(policy.generate(0.2), policy.generate(0.3))  # busy 0.3 s
        await asyncio.sleep(0.4)  # a tool call: the engine idles
        await policy.generate(0.1)

    asyncio.run(episodes())
    idle = requests.take_idle()
    assert 0.35 <= idle < 0.6, idle
    time.sleep(0.2)
    assert 0.15 <= requests.take_idle() < 0.4  # idle since, with nothing in flight
