"""The rollout engine: many multi-turn episodes at once, each a loop of generate -> step -> append.

    trajectories = collect_sync("agentrl/calc-v0", tasks, policy, RolloutConfig(group_size=4), seed=0)

- `group_size` episodes per task (same task, different samples) share a `group_id`.
- Up to `concurrency` episodes are in flight; their generations batch inside the policy's engine
  (continuous batching), and every environment call (`make`, `reset`, `step`, `end_episode`) runs
  on a worker thread (a pool that grows when all are busy), so a slow or hung tool never stalls the
  event loop or the other episodes.
- Limits: turns (the environment's `max_turns`), tokens per turn (`max_tokens_per_turn`), tokens
  per trajectory (`max_total_tokens`: the episode ends `max_tokens` rather than overflow), and
  wall time per episode (`episode_timeout_s`: it ends `timeout`).
- Token ids are the truth (see `agentrl.rollout.masker`): the sampled ids are appended as they came, the
  observations as a template delta tokenized once; nothing is re-tokenized from text.
- An environment that raises (in `make`, `reset` or `step`) or a sandbox that dies ends only its own
  episode, with `finish_reason="env_error"` and the reason in `error`; an environment instance that
  raised or timed out is closed and never reused. Such episodes are kept and not `trainable`.
  A rollout engine that dies mid-request (`agentrl.rollout.ray_policy`) ends its episodes `engine_error`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from agentrl.core.task import Task
from agentrl.core.types import FinishReason, Split
from agentrl.env.protocols import AgentEnv
from agentrl.rollout.assemble import build_trajectory
from agentrl.rollout.cluster import episode_group
from agentrl.rollout.config import RolloutConfig, turn_seed
from agentrl.rollout.driver import DrivenEnv, EpisodeContext, EpisodeDriver, EpisodePolicyFactory, is_driven
from agentrl.rollout.masker import ChatMasker, MaskedSequence
from agentrl.rollout.policy import Generation, Policy, SamplingConfig
from agentrl.rollout.trajectory import UNTRAINABLE_FINISH_REASONS, Timings, Trajectory

if TYPE_CHECKING:
    from agentrl.verifiers import Verdict

log = logging.getLogger(__name__)


EnvFactory = Callable[[], AgentEnv]


@dataclass
class _EpisodeSpec:
    index: int
    task: Task | int
    group_id: str
    seed: int | None
    """The call's base seed: this episode samples with seeds derived from (seed, index, turn)."""
    env_seed: int | None


class _EnvPool:
    """One environment per in-flight episode; healthy ones are reused, broken ones closed."""

    def __init__(self, factory: EnvFactory):
        self.factory = factory
        self.free: list[Any] = []
        self.all: list[Any] = []

    async def acquire(self) -> Any:
        if self.free:
            return self.free.pop()
        env = await _in_thread(self.factory)
        self.all.append(env)
        return env

    def release(self, env: Any, healthy: bool) -> None:
        if healthy:
            self.free.append(env)
        else:
            # It may still be inside a hung step on another thread: close it there, later, not here.
            self.all.remove(env)
            threading.Thread(target=_close_quietly, args=(env,), daemon=True).start()

    def close(self) -> None:
        for env in self.free:
            _close_quietly(env)
        self.free.clear()


def _close_quietly(env: Any) -> None:
    try:
        env.close()
    except Exception as exc:
        log.warning("closing environment %r failed: %s", env, exc)


class _ElasticDaemonPool:
    """Daemon worker threads for environment calls; grows whenever every worker is busy.

    Not `asyncio.to_thread`: its executor has a few workers, and a tool that hangs forever holds one
    for good; enough of them would stall every environment call in the process. Not a thread per
    call either: `Thread.start()` blocks the event loop until the thread runs (milliseconds on a
    loaded machine, every turn). Daemon threads, so a hung tool never blocks interpreter exit.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        self._jobs.put(job)
        if spawn:
            threading.Thread(target=self._work, daemon=True, name="agentrl-env").start()

    def _work(self) -> None:
        while True:
            self._jobs.get()()
            with self._lock:
                self._idle += 1


_ENV_THREADS = _ElasticDaemonPool()


async def _in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run `fn` on an environment worker thread and await it (cancelling the await abandons the call)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def run() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (fn(*args, **kwargs), None)
        except BaseException as exc:
            outcome = (None, exc)
        # An abandoned call (its episode timed out) may return after the rollout's loop is closed.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_settle, fut, *outcome)

    _ENV_THREADS.submit(run)
    return await fut


def _settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.done():  # the awaiting episode timed out and moved on
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _factory(envs: str | EnvFactory, env_kwargs: dict[str, Any]) -> EnvFactory:
    if isinstance(envs, str):
        from agentrl.env.registry import make

        env_id = envs
        return lambda: make(env_id, **env_kwargs)
    if callable(envs):
        if env_kwargs:
            raise ValueError(
                "env_kwargs only apply to an environment id; bake them into your factory instead"
            )
        return envs
    raise TypeError(
        f"collect needs an environment id (e.g. 'agentrl/calc-v0') or a zero-argument factory, got {type(envs).__name__}"
    )


class _Restart(Exception):
    """Weights were pushed while the episode ran, and `RolloutConfig.on_push` says to play it again."""


class _Episode:
    """The state of one episode in flight; `run` fills it, whatever ends it."""

    def __init__(
        self,
        spec: _EpisodeSpec,
        masker: ChatMasker,
        policy: Policy,
        cfg: RolloutConfig,
        episode_policy: EpisodePolicyFactory | None = None,
    ):
        self.spec, self.masker, self.policy, self.cfg = spec, masker, policy, cfg
        self.episode_policy = episode_policy
        self.env: AgentEnv | None = None
        self.seq: MaskedSequence | None = None
        self.task_id = spec.task.id if isinstance(spec.task, Task) else ""
        self.split: Split = spec.task.split if isinstance(spec.task, Task) else "train"
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.verdict: Verdict | None = None
        self.versions: list[int] = []
        self.generate_s = self.env_s = 0.0
        self.env_busy = False  # an environment call is running on a thread right now
        self.driver: EpisodeDriver | None = (
            None  # an episode an outside agent plays (`agentrl.rollout.driver`)
        )
        self.restarts = 0
        self.sampled_versions: set[int] = set()  # the weights versions of the ids sampled so far

    def may_restart(self) -> bool:
        return self.cfg.on_push == "restart" and self.restarts < self.cfg.max_restarts

    def restart(self) -> None:
        """Forget what this attempt sampled: the next `run` resets the environment and plays again."""
        self.restarts += 1
        self.seq, self.driver, self.versions, self.sampled_versions = None, None, [], set()
        self.finish_reason, self.error, self.verdict = None, None, None

    async def env_call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        self.env_busy = True
        try:
            return await _in_thread(fn, *args, **kwargs)
        finally:
            self.env_busy = False
            self.env_s += time.perf_counter() - t0

    def sampling(self, turn: int, max_tokens: int) -> SamplingConfig:
        base = self.spec.seed
        seed = None if base is None else turn_seed(base, self.spec.index, turn)
        return SamplingConfig(
            temperature=self.cfg.temperature,
            top_p=self.cfg.top_p,
            max_tokens=max_tokens,
            seed=seed,
            stop_token_ids=self.masker.stop_token_ids,
        )

    async def end(self, reason: FinishReason, error: str | None = None) -> None:
        """End the episode from outside (token budget) and score it."""
        self.finish_reason, self.error = reason, error
        self.verdict = await self.env_call(self.env.end_episode, reason, error)

    async def run(self) -> None:
        masker, cfg = self.masker, self.cfg
        options = {"task": self.spec.task} if isinstance(self.spec.task, Task) else {"index": self.spec.task}
        if is_driven(self.env):
            await self.run_driven(options)
            return
        obs, _info = await self.env_call(self.env.reset, seed=self.spec.env_seed, options=options)
        self.task_id, self.split = self.env.task.id, self.env.task.split
        self.seq = seq = masker.start(obs)
        if self.episode_policy is not None:
            self.policy = self.episode_policy(self.env, seq)
        turn = 0
        while True:
            budget = cfg.max_total_tokens - len(seq)
            if budget <= 0:
                await self.end(
                    "max_tokens", f"the context budget of {cfg.max_total_tokens} tokens is used up"
                )
                return
            t0 = time.perf_counter()
            gen: Generation = await self.policy.generate(
                list(seq.token_ids), self.sampling(turn, min(cfg.max_tokens_per_turn, budget))
            )
            self.generate_s += time.perf_counter() - t0
            self.versions += [gen.policy_version, gen.policy_version_end]
            self.sampled_versions.update(gen.versions())
            if self.may_restart() and len(self.sampled_versions) > 1:
                raise _Restart  # pushed since its first token: every token from one version, or none
            turn += 1
            action = masker.add_turn(seq, gen.token_ids, gen.logprobs, gen.stop_reason, gen.versions())
            if gen.stop_reason == "length" and len(seq) >= cfg.max_total_tokens:
                # Cut by the context budget mid-turn: the text is incomplete, so it is not acted on.
                await self.end(
                    "max_tokens", f"turn {turn} ran into the context budget of {cfg.max_total_tokens} tokens"
                )
                return
            new_messages, _reward, terminated, truncated, _info = await self.env_call(self.env.step, action)
            if terminated or truncated:
                episode = self.env.episode
                self.finish_reason, self.error, self.verdict = (
                    episode.finish_reason,
                    episode.error,
                    episode.verdict,
                )
                return
            ids = masker.observation_ids(seq, new_messages)
            if len(seq) + len(ids) > cfg.max_total_tokens:
                await self.end(
                    "max_tokens",
                    f"the observation after turn {turn} ({len(ids)} tokens) does not fit the context budget of "
                    f"{cfg.max_total_tokens} tokens",
                )
                return
            masker.add_observation(seq, new_messages, ids)

    async def run_driven(self, options: dict[str, Any]) -> None:
        """An episode an agent outside the loop plays (a harness's, through a gateway session): its
        environment's driver plays it (`agentrl.rollout.driver`)."""
        context = EpisodeContext(
            policy=self.policy,
            masker=self.masker,
            rollout=self.cfg,
            seed=self.spec.seed,
            index=self.spec.index,
            group_id=self.spec.group_id,
            env_call=self.env_call,
            episode_policy=self.episode_policy,
        )
        self.driver = cast(DrivenEnv, self.env).episode_driver(context)
        await self.driver.play(seed=self.spec.env_seed, options=options)
        if self.may_restart() and len(self.driver.sampled_versions()) > 1:
            raise _Restart  # its calls are over: the check comes after the fact
        episode = self.env.episode
        self.task_id, self.split = self.env.task.id, self.env.task.split
        self.finish_reason, self.error, self.verdict = episode.finish_reason, episode.error, episode.verdict

    def trajectories(self, total_s: float) -> list[Trajectory]:
        """The episode's trajectory; a driven episode's, one per branch of its calls."""
        traj = self.trajectory(total_s)
        if self.driver is None:
            return [traj]
        if self.env is not None and self.env.task is not None:
            traj.task_id, traj.split = self.env.task.id, self.env.task.split
        return self.driver.trajectories(traj)

    def trajectory(self, total_s: float) -> Trajectory:
        seq = self.seq
        episode = self.env.episode if self.env is not None else None
        verdict = self.verdict
        verify_s = verdict.duration_s if verdict is not None else 0.0
        return build_trajectory(
            seq,
            self.versions or [self.policy.version],
            masker=self.masker,
            rollout=self.cfg,
            task_id=self.task_id,
            group_id=self.spec.group_id,
            reward=float(verdict.reward) if verdict is not None else 0.0,
            passed=bool(verdict.passed) if verdict is not None else False,
            finish_reason=self.finish_reason or "env_error",
            env_id=self.env.env_id if self.env is not None else "",
            split=self.split,
            verdict_details=verdict.details if verdict is not None else "",
            judged=verdict.judged if verdict is not None else True,
            submission=episode.submission if episode is not None else None,
            turns=episode.turns if episode is not None else 0,
            tool_calls=episode.tool_calls if episode is not None else 0,
            tool_errors=episode.tool_errors if episode is not None else 0,
            tool_timeouts=episode.tool_timeouts if episode is not None else 0,
            format_errors=episode.format_errors if episode is not None else 0,
            timings=Timings(
                generate_s=self.generate_s,
                env_s=max(0.0, self.env_s - verify_s),
                verify_s=verify_s,
                total_s=total_s,
            ),
            messages=list(episode.messages if episode is not None else seq.messages if seq else []),
            error=self.error,
            restarts=self.restarts,
        )


async def _run_one(
    spec: _EpisodeSpec,
    pool: _EnvPool,
    masker: ChatMasker,
    policy: Policy,
    cfg: RolloutConfig,
    episode_policy: EpisodePolicyFactory | None = None,
    tasks_seen: dict[str, Task] | None = None,
) -> list[Trajectory]:
    ep = _Episode(spec, masker, policy, cfg, episode_policy)
    t0 = time.perf_counter()
    healthy = True
    try:
        # The group travels with the episode's task (a context variable): a policy of several
        # engines (agentrl.rollout.ray_policy) keeps a group's requests on one engine.
        async with asyncio.timeout(cfg.episode_timeout_s):
            ep.env = await pool.acquire()
            with episode_group(spec.group_id):
                while True:
                    try:
                        await ep.run()
                        break
                    except _Restart:  # the next run's reset releases this attempt's sandbox
                        ep.restart()
    except TimeoutError:
        healthy = not ep.env_busy  # a step still running on its thread owns the env: never reuse it
        ep.finish_reason = "timeout"
        ep.error = f"the episode ran past its {cfg.episode_timeout_s:g}s wall-clock limit"
        ep.verdict = None
        episode = ep.env.episode if ep.env is not None else None
        if ep.env is not None and episode is not None and not episode.done:
            # Score and release the sandbox, bounded: the env may be stuck in the very call that timed out.
            try:
                async with asyncio.timeout(cfg.end_timeout_s):
                    ep.verdict = await ep.env_call(ep.env.end_episode, "timeout", ep.error)
            except Exception as exc:
                healthy = False
                log.warning("ending timed-out episode %s failed: %s", spec.index, exc)
    except asyncio.CancelledError:
        healthy = False
        raise
    except Exception as exc:  # the environment (or the policy) failed: this episode only
        healthy = False
        # A policy error may name its own reason (a dead rollout engine: `engine_error`).
        ep.finish_reason = getattr(exc, "finish_reason", "env_error")
        ep.error = f"{type(exc).__name__}: {exc}"
        log.warning("episode %s (task %s) ended by an error: %s", spec.index, ep.task_id, ep.error)
        episode = ep.env.episode if ep.env is not None else None
        if ep.env is not None and episode is not None and not episode.done:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(cfg.end_timeout_s):
                    ep.verdict = await ep.env_call(ep.env.end_episode, "env_error", ep.error)
    finally:
        if ep.env is not None:
            if tasks_seen is not None and getattr(ep.env, "task", None) is not None:
                tasks_seen[spec.group_id] = ep.env.task  # what a group judge scores the group against
            pool.release(ep.env, healthy)
    return ep.trajectories(time.perf_counter() - t0)


async def collect(
    envs: str | EnvFactory,
    tasks: Sequence[Task | int],
    policy: Policy,
    config: RolloutConfig | None = None,
    *,
    seed: int | None = 0,
    masker: ChatMasker | None = None,
    tokenizer: Any = None,
    env_kwargs: dict[str, Any] | None = None,
    on_trajectory: Callable[[Trajectory], None] | None = None,
    episode_policy: EpisodePolicyFactory | None = None,
    group_sizes: Sequence[int] | None = None,
    slots: threading.Semaphore | None = None,
) -> list[Trajectory]:
    """Roll out `group_size` episodes for each task (`group_sizes[i]` for task i, when given); return the
    trajectories in task-then-sample order.

    An episode gives one trajectory; a driven environment's (`agentrl.rollout.driver`: a harness, whose
    agent plays through a gateway session) gives one per branch of its calls, adjacent, branch 0 first.

    `envs` is an environment id (built with `agentrl.make(id, **env_kwargs)`) or a zero-argument
    factory; `tasks` are `Task`s or task indices of the environment's generator. `seed` is the call's
    random stream: episode k samples with seeds derived from (seed, k, turn) and its environment resets
    with seed + its task's position (None: unseeded). The masker comes from
    `masker`, else from `tokenizer` (else `policy.tokenizer`) and its own chat template.
    `on_trajectory` is called as each episode finishes (progress bars, streaming to disk).
    `episode_policy`, if given, is called once per episode right after `reset` with the environment and
    the episode's `MaskedSequence` (whose `messages` the engine keeps current), and that episode plays
    with the policy it returns instead of `policy`. Scripted agents use it (`agentrl.kit.demonstrations`: oracle
    demonstrations through this very loop); they need the task and the conversation as messages,
    which a sampling policy never sees. `slots`, a semaphore shared by calls running at the same time on
    other threads, bounds their episodes together (each episode holds one of its permits).
    """
    cfg = config or RolloutConfig()
    # Environments and their sandboxes are made on worker threads below; the handlers that remove
    # containers on SIGTERM/SIGINT can only be installed from here (the loop's thread, usually main).
    from agentrl.sandbox.reaper import install_signal_handlers

    install_signal_handlers()
    masker = _masker_for(masker, tokenizer, policy)
    pool = _EnvPool(_factory(envs, dict(env_kwargs or {})))
    specs = _episode_specs(tasks, cfg, seed, group_sizes)
    episodes = _Episodes(pool, masker, policy, cfg, episode_policy, on_trajectory, slots)
    try:
        # A verifier that scores a group's answers together (`judge(group=True)`): each group is judged
        # once its episodes are done, before anyone is handed its trajectories.
        return await episodes.run(specs, await _group_judge(pool))
    finally:
        pool.close()


def _masker_for(masker: ChatMasker | None, tokenizer: Any, policy: Policy) -> ChatMasker:
    """`masker`, else one of `tokenizer` (else the policy's) and its own chat template."""
    if masker is not None:
        return masker
    tok = tokenizer if tokenizer is not None else getattr(policy, "tokenizer", None)
    if tok is None:
        raise ValueError("collect needs a masker or a tokenizer (the policy has no `tokenizer` attribute)")
    return ChatMasker(tok)


def _episode_specs(
    tasks: Sequence[Task | int], cfg: RolloutConfig, seed: int | None, group_sizes: Sequence[int] | None
) -> list[_EpisodeSpec]:
    """One spec per episode, in task-then-sample order: a group per task (of `group_sizes[g]` episodes, or
    the rollout's `group_size`), named after its task and this call, its environment seeded seed + g."""
    if group_sizes is not None and (len(group_sizes) != len(tasks) or min(group_sizes, default=1) < 1):
        raise ValueError(
            f"group_sizes must give a positive size for each of the {len(tasks)} tasks: {group_sizes}"
        )
    run_id = uuid.uuid4().hex[:8]
    specs: list[_EpisodeSpec] = []
    for g, task in enumerate(tasks):
        key = task.id if isinstance(task, Task) else f"index-{task}"
        env_seed = None if seed is None else seed + g
        for _k in range(cfg.group_size if group_sizes is None else group_sizes[g]):
            specs.append(_EpisodeSpec(len(specs), task, f"{key}@{run_id}/{g}", seed, env_seed))
    return specs


@dataclass
class _Episodes:
    """One `collect` call's episodes in flight: at most `concurrency` at once (and a permit of `slots` each),
    each group rescored by the group judge when there is one, every trajectory handed to `on_trajectory`."""

    pool: _EnvPool
    masker: ChatMasker
    policy: Policy
    cfg: RolloutConfig
    episode_policy: EpisodePolicyFactory | None
    on_trajectory: Callable[[Trajectory], None] | None
    slots: threading.Semaphore | None
    group_judge: Any = None
    tasks_seen: dict[str, Task] = field(default_factory=dict)
    """Each group's task, as its environment saw it: what a group judge scores the group against."""

    def __post_init__(self) -> None:
        self.semaphore = asyncio.Semaphore(self.cfg.concurrency)

    async def run(self, specs: list[_EpisodeSpec], group_judge: Any) -> list[Trajectory]:
        """Every episode of `specs`, their trajectories in the specs' order; `group_judge` (None: none)
        rescores each group once its episodes are done."""
        self.group_judge = group_judge
        if group_judge is None:
            return [t for trajs in await asyncio.gather(*(self.one(s) for s in specs)) for t in trajs]
        groups: dict[str, list[_EpisodeSpec]] = {}
        for s in specs:
            groups.setdefault(s.group_id, []).append(s)
        return [t for trajs in await asyncio.gather(*(self.group(m) for m in groups.values())) for t in trajs]

    async def one(self, spec: _EpisodeSpec, notify: bool = True) -> list[Trajectory]:
        slots = self.slots
        async with self.semaphore:
            # A shared permit is polled, not waited for on a thread: waiting threads would take the
            # default executor that the environments' calls run on.
            while slots is not None and not slots.acquire(blocking=False):
                await asyncio.sleep(0.005)
            try:
                trajs = await _run_one(
                    spec, self.pool, self.masker, self.policy, self.cfg, self.episode_policy, self.tasks_seen
                )
            finally:
                if slots is not None:
                    slots.release()
        if notify:
            self.notify(trajs)
        return trajs

    async def group(self, members: list[_EpisodeSpec]) -> list[Trajectory]:
        trajs = [t for ts in await asyncio.gather(*(self.one(s, notify=False) for s in members)) for t in ts]
        task = self.tasks_seen.get(members[0].group_id)
        if task is not None:
            trajs = await asyncio.to_thread(_rescore_group, self.group_judge, task, trajs)
        self.notify(trajs)
        return trajs

    def notify(self, trajs: list[Trajectory]) -> None:
        if self.on_trajectory is not None:
            for traj in trajs:
                self.on_trajectory(traj)


async def _group_judge(pool: _EnvPool) -> Any:
    """The environments' verifier when it judges groups (`group` set and `judge_group`), else None."""
    try:
        env = await pool.acquire()
    except Exception:  # an env that cannot be made fails each episode on its own, as without a judge
        return None
    pool.release(env, True)
    verifier = getattr(env, "verifier", None)
    if getattr(verifier, "group", False) is True and callable(getattr(verifier, "judge_group", None)):
        return verifier
    return None


def collect_sync(*args: Any, **kwargs: Any) -> list[Trajectory]:
    """`collect` for synchronous callers (it runs its own event loop)."""
    return asyncio.run(collect(*args, **kwargs))


def _rescore_group(judge: Any, task: Task, trajectories: list[Trajectory]) -> list[Trajectory]:
    """A finished group's trajectories with the rewards of one `judge_group` call: the episodes that ended by
    the policy's doing (one trajectory each, or a harness episode's last branch) are scored side by side;
    the others keep what they had. Returns new trajectories (the inputs are not changed)."""
    from dataclasses import replace

    scored = [
        i
        for i, t in enumerate(trajectories)
        if t.branch == 0 and t.finish_reason not in UNTRAINABLE_FINISH_REASONS
    ]
    if not scored:
        return list(trajectories)
    verdicts = judge.judge_group(task, [trajectories[i].submission for i in scored])
    out = list(trajectories)
    for i, v in zip(scored, verdicts, strict=True):
        out[i] = replace(out[i], reward=v.reward, passed=v.passed, verdict_details=v.details, judged=v.judged)
    return out
