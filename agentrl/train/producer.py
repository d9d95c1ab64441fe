"""Rank 0's rollout producer: the vLLM policy and the environments turning curriculum draws into
the next training batch. The producer drives: it asks `DynamicBatch` for tasks, plays their
episodes and hands the groups back; the curriculum never calls into it.

    producer = RolloutProducer(cfg, policy)
    batch = producer.next_batch(curriculum)   # a RolloutBatch: groups, metrics, the state after it
    ...
    producer.stop(wait=True)

Synchronous mode (`asynchronous.mode: sync`) builds the batch when asked. Asynchronous mode builds
batches in a background thread, k = `asynchronous.max_staleness` ahead at most (admission: batch n
starts only once the trainer has taken batch n - k, when the weights are version n - k, and batch n
trains at version n), so no trajectory is more than k policy versions behind when it is trained on
(episodes that straddle a weight push are younger still); k = 0 is the synchronous mode. The
curriculum is only ever touched by the thread building a batch, and each batch carries the
curriculum's state right after it, so a checkpoint taken after training on it records exactly that.

With `asynchronous.overlap`, every batch the same admission lets start is built at once, each on a
thread of its own, its episodes sharing the `rollout.concurrency` permits with the others': a batch's
slowest episodes no longer keep the engines from the next batch's. The batches draw from the curriculum
one at a time (a lock) and it learns from each batch only when the batch is handed on, in batch order,
so the state a batch carries holds the estimates of exactly the batches handed on so far (and the draws
of those still being built, which a resume does not replay).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from agentrl.rollout.trajectory import Trajectory
from agentrl.train.config import TrainConfig
from agentrl.train.curriculum import (
    Curriculum,
    DynamicBatch,
    DynamicBatchResult,
    TaskDraw,
    group_by_id,
    metrics_of,
)


@dataclass
class RolloutBatch:
    """A finished batch of groups and what a checkpoint taken right after it must record."""

    result: DynamicBatchResult
    metrics: dict[str, float]
    curriculum_state: dict[str, Any]
    rollout_calls: int


@dataclass
class RolloutProducer:
    """Rank 0's side of training: the vLLM policy and the environments, turning task draws into groups
    and groups into batches (see the module docstring)."""

    cfg: TrainConfig
    policy: Any
    stats: dict[str, float] = field(default_factory=dict)
    calls: int = 0
    """Rollout calls so far: each seeds its episodes differently. Checkpointed, so a resumed run
    samples what the uninterrupted one would have."""
    on_trajectory: Any = None
    _prefetch: queue.Queue = field(init=False, repr=False)
    _slot: threading.Semaphore = field(init=False, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _worker: threading.Thread | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        # Batches the thread may build ahead of the trainer: each is one version more behind when trained.
        self.ahead = self.cfg.asynchronous.max_staleness if self.cfg.asynchronous.mode == "async" else 0
        self.overlap = self.ahead > 0 and self.cfg.asynchronous.overlap
        # Unbounded: the slots bound the batches built ahead, and a failure must never wait for room.
        self._prefetch = queue.Queue()
        self._slot = threading.Semaphore(max(1, self.ahead))
        self._local = threading.local()  # the stats of the batch this thread is building
        self._calls_lock = threading.Lock()
        # Overlapping batches: the curriculum's lock, the builders, the finished batches waiting for
        # their turn, the episode permits they share.
        self._curriculum_lock = threading.Lock()
        self._emit_lock = threading.Lock()
        self._builders: list[threading.Thread] = []
        self._finished: dict[int, tuple[DynamicBatch, dict[str, float]]] = {}
        self._next_emit = 0
        self._episode_slots = threading.Semaphore(self.cfg.rollout.concurrency)
        self._building = _Occupancy()  # batches being built
        self._requests = _Occupancy()  # generation requests in the engines: none, and the engines idle

    def groups(self, draws: list[TaskDraw]) -> list[list[Trajectory]]:
        from agentrl.rollout.loop import collect_sync

        # A new seed per call: the rollout derives episode k's sampling seed from (seed, k, turn),
        # so reusing one seed every step would replay the same random stream for every batch.
        with self._calls_lock:
            self.calls += 1
            call = self.calls
        stats = getattr(self._local, "stats", self.stats)
        t0 = time.perf_counter()
        trajs = collect_sync(
            self.cfg.env,
            [d.task for d in draws],
            _Counted(self.policy, self._requests),
            self.cfg.rollout,
            seed=self.cfg.seed * 1_000_003 + call,
            env_kwargs=self.cfg.env_kwargs,
            on_trajectory=self.on_trajectory,
            group_sizes=[d.group_size or self.cfg.rollout.group_size for d in draws],
            slots=self._episode_slots if self.overlap else None,
        )
        stats["time/rollout_s"] = stats.get("time/rollout_s", 0.0) + time.perf_counter() - t0
        stats["rollout/drifted"] = stats.get("rollout/drifted", 0.0) + sum(
            1 for t in trajs if t.drift is not None and t.drift.drifted
        )
        stats["rollout/env_errors"] = stats.get("rollout/env_errors", 0.0) + sum(
            1 for t in trajs if t.finish_reason == "env_error"
        )
        stats["rollout/engine_errors"] = stats.get("rollout/engine_errors", 0.0) + sum(
            1 for t in trajs if t.finish_reason == "engine_error"
        )
        stats["rollout/timeouts"] = stats.get("rollout/timeouts", 0.0) + sum(
            1 for t in trajs if t.finish_reason == "timeout" and t.branch == 0
        )
        # Episodes played again because weights were pushed while they ran (`rollout.on_push: restart`).
        stats["rollout/restarts"] = stats.get("rollout/restarts", 0.0) + sum(
            t.restarts for t in trajs if t.branch == 0
        )
        # Harness episodes (agentrl.gateway): extra branches (one episode, several trajectories), the calls
        # that drifted from the sampled tokens (counted once per episode, on its branch 0), agent failures.
        for key, value in (
            ("rollout/branches", sum(1 for t in trajs if t.branch > 0)),
            ("rollout/drifted_calls", sum(t.drifted_calls for t in trajs if t.branch == 0)),
            (
                "rollout/agent_errors",
                sum(1 for t in trajs if t.finish_reason == "agent_error" and t.branch == 0),
            ),
        ):
            stats[key] = stats.get(key, 0.0) + value
        if hasattr(self.policy, "engine_of"):  # several engines: how the groups spread over them
            for t in {t.group_id: t for t in trajs}.values():
                key = f"rollout/engine{self.policy.engine_of(t.group_id)}_groups"
                stats[key] = stats.get(key, 0.0) + 1
        return group_by_id(trajs)

    def batch(self, curriculum: Curriculum) -> RolloutBatch:
        """One dynamic-sampling batch, built now, its metrics, and the state right after it.

        Metrics and state are taken here, in the thread that changed the curriculum, so the
        async producer and the trainer never touch the curriculum at the same time.
        """
        self.stats = self._local.stats = {}
        builder = DynamicBatch(curriculum)
        with self._building.held():
            while not builder.done:
                builder.add(self.groups(builder.request()))
        return self._hand_on(builder, curriculum, self.stats)

    def _hand_on(
        self, builder: DynamicBatch, curriculum: Curriculum, stats: dict[str, float]
    ) -> RolloutBatch:
        """The finished batch as the trainer takes it: loss weights set, its metrics, the state after it."""
        result = builder.result()
        # The sampler's factor on each trained group's advantages (1 but for loss-weighting samplers).
        weigh = getattr(curriculum, "group_weight", None)
        weights = [float(weigh(g)) if weigh is not None else 1.0 for g in result.groups]
        for group, weight in zip(result.groups, weights, strict=True):
            for traj in group:
                traj.loss_weight = weight
        metrics = {**batch_metrics(result, curriculum), **stats}
        if weights:
            metrics["curriculum/loss_weight_mean"] = sum(weights) / len(weights)
        # The engines had no request to serve since the last batch was handed on: the update and push
        # when synchronous, the episodes' tool calls and the long tail's waits in any mode.
        metrics["time/engine_idle_s"] = self._requests.take_idle()
        return RolloutBatch(result, metrics, curriculum.state_dict(), self.calls)

    def next_batch(self, curriculum: Curriculum) -> RolloutBatch:
        """The batch to train on next: built now (sync), or the one the background thread has built
        (async; the thread then starts the following one, with the weights pushed meanwhile). A
        failure in the thread is raised here, in the trainer's thread."""
        t0 = time.perf_counter()
        if self.ahead == 0:  # synchronous, or asynchronous with no staleness allowed: the same thing
            batch = self.batch(curriculum)
            batch.metrics["time/trainer_wait_s"] = time.perf_counter() - t0  # the whole rollout
            return batch
        if self._worker is None:
            self._worker = threading.Thread(
                target=self._produce, args=(curriculum,), daemon=True, name="rollout"
            )
            self._worker.start()
        batch = self._prefetch.get()
        if isinstance(batch, Exception):
            raise batch
        batch.metrics["time/trainer_wait_s"] = time.perf_counter() - t0  # 0 when the batch was ready
        batch.metrics["async/queue_depth"] = float(self._prefetch.qsize())  # built batches still waiting
        self._slot.release()  # the producer may start one more batch, with the weights of the update to come
        return batch

    def stop(self, wait: bool = False) -> None:
        """No further batch; with `wait`, the batches in flight end first: a batch stops asking for
        groups, waits for those it started, and is never handed on (not trained on, never taught to the
        curriculum: a resume generates it again)."""
        self._stop.set()
        if wait and self._worker is not None:
            self._worker.join()
            for builder in list(self._builders):
                builder.join()

    def _produce(self, curriculum: Curriculum) -> None:
        index = 0
        while not self._stop.is_set():
            if not self._slot.acquire(timeout=0.5):
                continue
            if self._stop.is_set():
                break
            if self.overlap:  # start it, and go on to the next one the admission lets start
                thread = threading.Thread(
                    target=self._build, args=(index, curriculum), daemon=True, name=f"rollout-{index}"
                )
                self._builders = [t for t in self._builders if t.is_alive()] + [thread]
                thread.start()
                index += 1
                continue
            try:
                self._prefetch.put(self.batch(curriculum))
            except Exception as exc:  # raised in the trainer's thread, which waits on the queue
                if self._stop.is_set():
                    return  # the run is ending (Ctrl-C, a stop): the engine closed under the batch
                self._prefetch.put(exc)
                return

    def _build(self, index: int, curriculum: Curriculum) -> None:
        """Batch `index`, built beside the others (`asynchronous.overlap`), then handed on in turn."""
        self._local.stats = stats = {}
        self._building.enter()
        try:
            builder = DynamicBatch(_Shared(curriculum, self._curriculum_lock), learn=False)
            while not builder.done and not self._stop.is_set():
                builder.add(self.groups(builder.request()))
            if self._stop.is_set():
                return  # never handed on, never taught: a resume builds it again
            with self._emit_lock:
                self._finished[index] = (builder, stats)
                while self._next_emit in self._finished:
                    done, done_stats = self._finished.pop(self._next_emit)
                    with self._curriculum_lock:
                        for group in done.arrived:  # what it learns from each batch, in batch order
                            curriculum.update(group)
                        batch = self._hand_on(done, curriculum, done_stats)
                    batch.metrics["async/batches_building"] = float(self._building.count)
                    self._prefetch.put(batch)
                    self._next_emit += 1
        except Exception as exc:  # raised in the trainer's thread, which waits on the queue
            if not self._stop.is_set():
                self._stop.set()
                self._prefetch.put(exc)
        finally:
            self._building.leave()


class _Occupancy:
    """How many of something are under way, and the time none was (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self._idle_since: float | None = None  # None: nothing has started yet, no idle time counted
        self._idle_s = 0.0

    def enter(self) -> None:
        with self._lock:
            if self.count == 0 and self._idle_since is not None:
                self._idle_s += time.perf_counter() - self._idle_since
            self.count += 1

    def leave(self) -> None:
        with self._lock:
            self.count -= 1
            if self.count == 0:
                self._idle_since = time.perf_counter()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def take_idle(self) -> float:
        """Seconds with none under way since the last call."""
        with self._lock:
            now = time.perf_counter()
            if self.count == 0 and self._idle_since is not None:
                self._idle_s += now - self._idle_since
                self._idle_since = now
            idle, self._idle_s = self._idle_s, 0.0
        return idle


class _Counted:
    """The policy as the producer's episodes use it: each generation request is counted while in the engine."""

    def __init__(self, policy: Any, requests: _Occupancy):
        self._policy, self._requests = policy, requests

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        with self._requests.held():
            return await self._policy.generate(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policy, name)


class _Shared:
    """The curriculum as overlapping batches share it: one draw at a time; the rest reads through."""

    def __init__(self, curriculum: Curriculum, lock: threading.Lock):
        self._curriculum, self._lock = curriculum, lock

    def sample(self, *args: Any, **kwargs: Any) -> list[TaskDraw]:
        with self._lock:
            return self._curriculum.sample(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._curriculum, name)


def batch_metrics(result: DynamicBatchResult, curriculum: Curriculum) -> dict[str, float]:
    """What one batch says about the policy and the curriculum, for metrics.jsonl."""
    # Rewards over every generated group (dropped zero-variance ones too): what the policy scored.
    trajs = [t for g in (*result.groups, *result.dropped, *result.surplus) for t in g]
    curriculum_metrics = {**metrics_of(curriculum), **result.metrics().as_dict()}
    m = {k: float(v) for k, v in curriculum_metrics.items() if isinstance(v, int | float)}
    pool_state = getattr(curriculum, "pool_state", None)  # the band's family of samplers
    if callable(pool_state):
        m.update(pool_state())
    episodes = [t for t in trajs if t.branch == 0]  # a harness episode's other branches repeat its reward
    if episodes:
        m["charts/reward_mean"] = sum(t.reward for t in episodes) / len(episodes)
        m["charts/episode_turns"] = sum(t.turns for t in episodes) / len(episodes)
    if trajs:
        m["charts/episode_tokens"] = sum(len(t.token_ids) for t in trajs) / len(trajs)
    # `groups` are the ones trained on; the all-pass and all-fail counts are of every group generated
    # for the step (the dropped zero-variance ones), so they compare with `generated_groups`.
    m["batch/groups"] = float(len(result.groups))
    m["batch/generated_groups"] = float(result.generated_groups)
    m["batch/all_pass_groups"] = float(result.all_pass_groups)
    m["batch/all_fail_groups"] = float(result.all_fail_groups)
    # all-pass + all-fail + mixed + empty = generated
    m["batch/mixed_groups"] = float(result.mixed_groups)
    m["batch/empty_groups"] = float(result.empty_groups)
    m["batch/untrainable_trajectories"] = float(result.untrainable_trajectories)
    return m
