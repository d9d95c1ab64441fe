"""`RayPolicy`: several vLLM engines as Ray actors behind the one `Policy` interface.

    policy = RayPolicy("/path/to/model", engines=4, address="auto")   # `engine.count`, `cluster.ray_address`
    gen = await policy.generate(prompt_ids, SamplingConfig(...))       # as with VLLMPolicy
    policy.update_weights(state_dict)                                  # every engine, one version
    policy.versions()                                                  # [v, v, v, v]

- Placement: one Ray placement-group bundle per engine, spread over the nodes (`SPREAD`): one GPU
  per engine where the cluster has GPUs, else one CPU; `resources` adds custom resources per
  engine (a dict for all, or a list with one dict per engine, e.g. to pin engine i to node i).
- Each engine is an async actor holding a `VLLMPolicy` (in-process engine on CPU; on GPUs the
  engine core in its own process, on the GPU Ray assigned). Requests from many episodes batch
  inside each engine (continuous batching), as with one engine.
- Group affinity: every request of one GRPO group goes to the same engine (the rollout marks each
  episode with its group, `agentrl.rollout.cluster.episode_group`), so the group's shared prompt is
  prefilled once per engine and reused from its prefix cache; a new group goes to the engine with
  the fewest groups in flight.
- Weights: `update_weights` puts the state dict into Ray's object store once and every engine loads
  it from there; each engine reports the version it holds (`versions()`).
- LoRA: `load_adapter` and `add_adapter` reach every engine the same way (pushed bytes through the
  object store, each engine writing its own temporary directory; a directory path must be readable on
  every node), with `VLLMPolicy`'s meaning.
- Failure: when an engine actor dies, each request in flight on it (and any sent to it before the
  death is noticed, which takes one failed request) raises `EngineDied`, which ends that episode
  alone with finish_reason `engine_error` (recorded, never trained on). The engine is
  restarted in the background in its bundle and loaded with the newest weights and adapters; until it is back,
  its groups' next requests go to the other engines. The run goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from agentrl.rollout.adapters import AdapterSource
from agentrl.rollout.cluster import connect, current_group
from agentrl.rollout.policy import Generation, SamplingConfig
from agentrl.rollout.weight_sync import WeightsLike, named_tensors

log = logging.getLogger(__name__)

_DEATHS = (RayActorError, ActorDiedError, ActorUnavailableError)


class EngineDied(RuntimeError):
    """The rollout engine serving this request died; the episode ends with `engine_error`."""

    finish_reason = "engine_error"


class EngineActor:
    """One vLLM engine in a Ray worker (wrapped with `ray.remote` by `RayPolicy`)."""

    def __init__(self, index: int, model: str, policy_kwargs: dict[str, Any]) -> None:
        import torch

        from agentrl.rollout.policy import VLLMPolicy

        self.index = index
        # CPU: the in-process engine (no second process in the actor); GPU: the engine core in its
        # own process on the GPU Ray gave this actor (CUDA_VISIBLE_DEVICES is set by Ray).
        self.policy = VLLMPolicy(model, in_process=not torch.cuda.is_available(), **policy_kwargs)

    def info(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "version": self.policy.version,
        }

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        return await self.policy.generate(prompt_ids, sampling)

    async def update_weights(self, weights: dict[str, Any], version: int) -> int:
        # Blocking inside vLLM: off the actor's event loop, so requests in flight keep streaming.
        return await asyncio.to_thread(self.policy.update_weights, weights, version=version)

    async def load_adapter(self, adapter: Any, version: int) -> int:
        return await asyncio.to_thread(self.policy.load_adapter, adapter, version=version)

    async def add_adapter(self, name: str, adapter: Any) -> None:
        await asyncio.to_thread(self.policy.add_adapter, name, adapter)

    def version(self) -> int:
        return self.policy.version

    def close(self) -> None:
        self.policy.close()  # vLLM shut down cleanly; pushed adapters' temporary directories deleted


@dataclass
class _Slot:
    index: int
    actor: Any = None
    info: dict[str, Any] | None = None
    alive: bool = False
    generation: int = 0  # bumped on each (re)start: a death reported against an old actor is ignored
    restarting: bool = False


class RayPolicy:
    """`engines` vLLM engines on a Ray cluster, serving one model as one `Policy` (see the module doc)."""

    supports_constraints = True  # each engine is a VLLMPolicy

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        engines: int = 2,
        address: str | None = "auto",
        resources: Mapping[str, float] | Sequence[Mapping[str, float]] | None = None,
        restart: bool = True,
        start_timeout_s: float = 900.0,
        version: int = 0,
        **policy_kwargs: Any,
    ) -> None:
        """
        model: checkpoint directory, readable at the same path on every node.
        engines: how many engine actors (`engine.count`).
        address: the Ray cluster (`cluster.ray_address`): `auto`, HOST:PORT, or None for a private one.
        resources: custom Ray resources each engine asks for: one mapping for all, or one per engine.
        restart: restart an engine that died (its episodes in flight end with `engine_error`).
        version: the version of the starting weights, in every engine (a resumed run continues its count).
        policy_kwargs: `VLLMPolicy` arguments of every engine (dtype, max_model_len, seed, ...).
        """
        if engines < 1:
            raise ValueError(f"engines must be >= 1, got {engines}")
        per_engine = _per_engine_resources(resources, engines)
        connect(address)
        from transformers import AutoTokenizer

        self.model = str(model)
        self.engines = engines
        self.restart = restart
        self.start_timeout_s = start_timeout_s
        self.policy_kwargs = {**policy_kwargs, "version": version}
        self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        self.gpus_per_engine = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
        base = {"GPU": 1.0, "CPU": 1.0} if self.gpus_per_engine else {"CPU": 1.0}
        self._bundles = [{**base, **{k: float(v) for k, v in extra.items()}} for extra in per_engine]
        self._pg = placement_group(
            self._bundles, strategy="SPREAD", name=f"agentrl-engines-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
        try:
            ray.get(self._pg.ready(), timeout=start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self._pg)
            raise RuntimeError(
                f"the Ray cluster cannot place {engines} rollout engine(s) with {self._bundles} within "
                f"{start_timeout_s:g}s (it has {ray.cluster_resources()}); lower engine.count or add nodes"
            ) from None
        self._lock = threading.Lock()
        self._slots = [_Slot(i) for i in range(engines)]
        self._groups: dict[str, int] = {}  # group id -> engine
        self._group_requests: dict[str, int] = {}  # group id -> requests in flight
        self._version = version
        self._weights_ref: Any = None
        # What a restarted engine must load to serve as the others do: the newest weights, the current
        # adapter (its source: an object-store ref or a path, and its version) and the named ones.
        self._adapter: tuple[Any, int] | None = None
        self._named_adapters: dict[str, Any] = {}
        self._pushes = 0  # bumped by every push: a restart that raced one loads again
        self.served = [0] * engines  # requests answered, per engine
        self.deaths = [0] * engines
        self.restarts = [0] * engines
        self._closed = False
        self._remote = ray.remote(EngineActor)
        try:
            for slot in self._slots:
                slot.actor = self._spawn(slot.index)
            infos = ray.get([s.actor.info.remote() for s in self._slots], timeout=start_timeout_s)
        except BaseException:
            self.close()
            raise
        for slot, info in zip(self._slots, infos, strict=True):
            slot.info, slot.alive = info, True

    # --- engines ------------------------------------------------------------------------------

    def _spawn(self, index: int) -> Any:
        bundle = self._bundles[index]
        return self._remote.options(
            num_cpus=bundle["CPU"],
            num_gpus=bundle.get("GPU", 0),
            resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._pg, placement_group_bundle_index=index
            ),
            max_restarts=0,  # restarted by us, with the newest weights, not with the first ones
            max_concurrency=1000,
        ).remote(index, self.model, self.policy_kwargs)

    def engine_info(self) -> list[dict[str, Any] | None]:
        """Per engine: pid, Ray node id and version at its last (re)start; None while it restarts."""
        return [s.info if s.alive else None for s in self._slots]

    def versions(self) -> list[int]:
        """The policy version each live engine holds now (asked of each engine)."""
        with self._lock:
            actors = [s.actor for s in self._slots if s.alive]
        return ray.get([a.version.remote() for a in actors], timeout=120)

    def wait_all_alive(self, timeout_s: float = 600.0) -> None:
        """Block until every engine is up (after a restart)."""
        deadline = time.monotonic() + timeout_s
        while not all(s.alive for s in self._slots):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout engines not all back within {timeout_s:g}s")
            time.sleep(0.2)

    def _on_death(self, index: int, generation: int, exc: BaseException) -> None:
        with self._lock:
            slot = self._slots[index]
            if slot.generation != generation or not slot.alive:
                return  # already known (another request saw it first)
            slot.alive = False
            self.deaths[index] += 1
            if not self.restart or self._closed:
                return
            slot.restarting = True
        log.warning("rollout engine %d died (%s); restarting it", index, type(exc).__name__)
        threading.Thread(
            target=self._restart, args=(index,), name=f"agentrl-engine-{index}-restart", daemon=True
        ).start()

    def _restart(self, index: int) -> None:
        slot = self._slots[index]
        with contextlib.suppress(Exception):
            ray.kill(slot.actor, no_restart=True)  # frees its bundle if it is only half dead
        while not self._closed:
            try:
                actor = self._spawn(index)
                info = ray.get(actor.info.remote(), timeout=self.start_timeout_s)
                while True:
                    with self._lock:
                        ref, version, pushes = self._weights_ref, self._version, self._pushes
                        adapter, named = self._adapter, dict(self._named_adapters)
                    wait = self.start_timeout_s
                    if ref is not None:
                        ray.get(actor.update_weights.remote(ref, version), timeout=wait)
                        info["version"] = version
                    for name, source in named.items():
                        ray.get(actor.add_adapter.remote(name, source), timeout=wait)
                    if adapter is not None:
                        ray.get(actor.load_adapter.remote(*adapter), timeout=wait)
                        info["version"] = adapter[1]
                    with self._lock:
                        if self._pushes != pushes:
                            continue  # a push landed meanwhile: load that one too
                        slot.actor, slot.info, slot.alive, slot.restarting = actor, info, True, False
                        slot.generation += 1
                        self.restarts[index] += 1
                        break
                log.warning("rollout engine %d is back (pid %s)", index, info["pid"])
                return
            except Exception as exc:
                if self._closed:
                    return
                log.warning("restarting rollout engine %d failed (%s); retrying", index, exc)
                time.sleep(2.0)

    # --- routing ------------------------------------------------------------------------------

    def _route(self, group: str | None) -> tuple[int, Any, int]:
        """The engine for a request of `group`: its group's engine while that one lives, else the
        live engine with the fewest groups in flight (the group moves there)."""
        with self._lock:
            alive = [s for s in self._slots if s.alive]
            if not alive:
                return -1, None, -1
            index = self._groups.get(group) if group is not None else None
            if index is None or not self._slots[index].alive:
                in_flight = [0] * self.engines
                for g, n in self._group_requests.items():
                    if n > 0 and g in self._groups:
                        in_flight[self._groups[g]] += 1
                index = min(alive, key=lambda s: (in_flight[s.index], self.served[s.index], s.index)).index
                if group is not None:
                    self._groups[group] = index
            if group is not None:
                self._group_requests[group] = self._group_requests.get(group, 0) + 1
            slot = self._slots[index]
            return index, slot.actor, slot.generation

    def engine_of(self, group: str) -> int | None:
        """The engine a group's requests go to (None: the group has not asked yet)."""
        return self._groups.get(group)

    # --- Policy API ---------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        if self._closed:
            raise RuntimeError("this RayPolicy is closed; create a new one")
        group = current_group()
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            index, actor, generation = self._route(group)
            if actor is not None:
                break
            if time.monotonic() > deadline:  # every engine is down and none came back
                raise EngineDied(
                    f"no rollout engine is alive (all {self.engines} restarting for {self.start_timeout_s:g}s)"
                )
            await asyncio.sleep(0.2)
        try:
            gen = await actor.generate.remote(list(prompt_ids), sampling)
        except _DEATHS as exc:
            self._on_death(index, generation, exc)
            raise EngineDied(
                f"rollout engine {index} died during this request ({type(exc).__name__}); it is being restarted "
                "and the run goes on without this episode"
            ) from exc
        finally:
            if group is not None:
                with self._lock:
                    self._group_requests[group] -= 1
        with self._lock:
            self.served[index] += 1
        return gen

    def update_weights(self, weights: WeightsLike, *, version: int | None = None) -> int:
        """Load new weights into every engine (one object-store copy all of them read); returns the new version
        (`version`, else one more than before), which every engine then reports.

        An engine that dies during the push is restarted with these weights; the others have them.
        """
        state = dict(named_tensors(weights))
        ref = ray.put(state)
        with self._lock:
            version = self._version + 1 if version is None else version
            targets = [(s.index, s.actor, s.generation) for s in self._slots if s.alive]
            # A restart from here on loads this version.
            self._weights_ref, self._version = ref, version
            self._pushes += 1
        # All engines load at once (each pulls the one copy from the object store), then wait.
        pending = [
            (index, generation, actor.update_weights.remote(ref, version))
            for index, actor, generation in targets
        ]
        for index, generation, done in pending:
            try:
                ray.get(done, timeout=self.start_timeout_s)
            except _DEATHS as exc:
                self._on_death(index, generation, exc)
        return version

    def load_adapter(self, adapter: AdapterSource, *, version: int | None = None) -> int:
        """Push a LoRA adapter to every engine (`VLLMPolicy.load_adapter`: bytes, one object-store copy all
        engines read, or a directory readable on every node); returns the new version, which every engine
        then reports. Bad input raises the engines' error and changes nothing."""
        source = ray.put(dict(adapter)) if isinstance(adapter, Mapping) else os.fspath(adapter)
        with self._lock:
            version = self._version + 1 if version is None else version
            targets = [(s.index, s.actor, s.generation) for s in self._slots if s.alive]
            undo = (self._adapter, self._version)
            # A restart from here on loads this adapter.
            self._adapter, self._version = (source, version), version
            self._pushes += 1
            pushes = self._pushes
        try:
            self._fan_out([(i, g, a.load_adapter.remote(source, version)) for i, a, g in targets])
        except BaseException:
            with self._lock:
                if self._pushes == pushes:  # nothing pushed since: as if this push had not happened
                    self._adapter, self._version = undo
                    self._pushes += 1
            raise
        return version

    def add_adapter(self, name: str, adapter: AdapterSource) -> None:
        """Add a named LoRA adapter to every engine (`VLLMPolicy.add_adapter`)."""
        source = ray.put(dict(adapter)) if isinstance(adapter, Mapping) else os.fspath(adapter)
        with self._lock:
            targets = [(s.index, s.actor, s.generation) for s in self._slots if s.alive]
            had, undo = name in self._named_adapters, self._named_adapters.get(name)
            self._named_adapters[name] = source
            self._pushes += 1
            pushes = self._pushes
        try:
            self._fan_out([(i, g, a.add_adapter.remote(name, source)) for i, a, g in targets])
        except BaseException:
            with self._lock:
                if self._pushes == pushes:
                    if had:
                        self._named_adapters[name] = undo
                    else:
                        del self._named_adapters[name]
                    self._pushes += 1
            raise

    def _fan_out(self, pending: list[tuple[int, int, Any]]) -> None:
        """Wait for a call sent to every engine; a dead engine is restarted (it loads the newest state),
        and an engine's error (the same bad input fails alike on every engine) is raised as it was raised
        there, after all engines have answered."""
        error: BaseException | None = None
        for index, generation, done in pending:
            try:
                ray.get(done, timeout=self.start_timeout_s)
            except _DEATHS as exc:
                self._on_death(index, generation, exc)
            except ray.exceptions.RayTaskError as exc:
                error = error or (exc.cause if isinstance(exc.cause, Exception) else exc)
        if error is not None:
            raise error

    def close(self) -> None:
        """Stop every engine and free the cluster's resources. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        actors = [s.actor for s in getattr(self, "_slots", []) if s.actor is not None]
        with contextlib.suppress(Exception):  # a dead or hung engine is killed all the same
            ray.wait([a.close.remote() for a in actors], num_returns=len(actors), timeout=30)
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(self._pg)

    def __enter__(self) -> RayPolicy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _per_engine_resources(
    resources: Mapping[str, float] | Sequence[Mapping[str, float]] | None, engines: int
) -> list[Mapping[str, float]]:
    if resources is None:
        return [{}] * engines
    if isinstance(resources, Mapping):
        return [resources] * engines
    resources = list(resources)
    if len(resources) != engines:
        raise ValueError(
            f"engine.resources lists {len(resources)} engine(s) but engine.count is {engines}; "
            "give one mapping per engine, or a single mapping for all"
        )
    return resources
