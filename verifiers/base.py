"""The verifier contract, the registry, and the safe way to call one.

A verifier scores an episode from what the agent left behind: `verify(sandbox, task, episode)
-> Verdict`. Verifiers run after the agent's last action. `run_verifier` is the only way the
environment calls one: a verifier that times out or crashes gives reward 0 with the reason in
`details`, never an exception out of the environment.

A verifier that relies on what a sandbox promises declares it by name in a class attribute
`needs_capabilities` (fields of `agentrl.sandbox.Capabilities`, e.g. `("isolated",
"protected_dir", "verifier_identity")`): `run_verifier` then gives reward 0, with the reason,
on a sandbox that lacks one, without calling `verify`. Never test a sandbox's backend name.
"""

from __future__ import annotations

import concurrent.futures
import difflib
import importlib.metadata
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from agentrl.episode import Episode
from agentrl.sandbox.base import BACKENDS, Sandbox, backend_capabilities, capabilities_of
from agentrl.task import Task

ENTRY_POINT_GROUP = "agentrl.verifiers"


@dataclass(frozen=True)
class Verdict:
    reward: float
    passed: bool
    details: str = ""
    duration_s: float = 0.0


@runtime_checkable
class Verifier(Protocol):
    """`verify` is the contract. A verifier may also define `async def averify(...)` (same
    arguments); `arun_verifier` awaits it when present and otherwise runs `verify` in a thread."""

    name: str

    def verify(self, sandbox: Sandbox | None, task: Task, episode: Episode) -> Verdict: ...


def capability_refusal(verifier: object, sandbox: Sandbox | None) -> str | None:
    """Why `verifier` cannot run on `sandbox`: the capabilities in its `needs_capabilities` that the
    sandbox lacks, with the backends that have them; None when nothing is missing (or needed)."""
    needed = tuple(getattr(verifier, "needs_capabilities", ()))
    if not needed or sandbox is None:
        return None
    missing = capabilities_of(sandbox).lacking(*needed)
    if not missing:
        return None
    having = [name for name in BACKENDS if not backend_capabilities(name).lacking(*needed)]
    return (
        f"verifier {getattr(verifier, 'name', type(verifier).__name__)!r} needs a sandbox with "
        f"{', '.join(needed)}; this {getattr(sandbox, 'backend', type(sandbox).__name__)} sandbox lacks "
        f"{', '.join(missing)} (backends that have them: {', '.join(having) or 'none registered'})"
    )


_REGISTRY: dict[str, Callable[..., Verifier]] = {}
_entry_points_loaded = False
_lock = threading.Lock()


def register(name: str, factory: Callable[..., Verifier], *, override: bool = False) -> None:
    """Make `factory(**kwargs) -> Verifier` available as `get(name, **kwargs)`."""
    if name in _REGISTRY and not override and _REGISTRY[name] is not factory:
        raise ValueError(f"a verifier named {name!r} is already registered; pass override=True to replace it")
    _REGISTRY[name] = factory


def _load_entry_points() -> None:
    """Third-party verifiers: entry points in group `agentrl.verifiers`, name -> factory. Loaded on first need."""
    global _entry_points_loaded
    with _lock:
        if _entry_points_loaded:
            return
        _entry_points_loaded = True
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in _REGISTRY:
                continue
            try:
                register(ep.name, ep.load())
            except Exception as exc:
                # One broken plugin must not take the others down; say which and why.
                import warnings

                warnings.warn(f"verifier plugin {ep.name!r} ({ep.value}) failed to load: {exc}", stacklevel=2)


def names() -> list[str]:
    _load_entry_points()
    return sorted(_REGISTRY)


def factory(name: str) -> Callable[..., Verifier]:
    """The factory registered as `name` (for listings and docs); `get` builds a verifier from it."""
    if name not in _REGISTRY:
        _load_entry_points()
    if name not in _REGISTRY:
        raise KeyError(f"no verifier named {name!r}. Registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def get(name: str, **kwargs: Any) -> Verifier:
    """Build the verifier registered as `name` with `kwargs`."""
    if name not in _REGISTRY:
        _load_entry_points()
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise KeyError(f"no verifier named {name!r}.{hint} Registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name](**kwargs)


def run_verifier(
    verifier: Verifier, sandbox: Sandbox | None, task: Task, episode: Episode, timeout_s: float = 300.0
) -> Verdict:
    """Run a verifier with a wall-clock timeout; a crash, a timeout or a sandbox without the
    capabilities it needs is reward 0 with the reason."""
    t0 = time.perf_counter()
    refusal = capability_refusal(verifier, sandbox)
    if refusal is not None:
        return _checked(verifier, Verdict(0.0, False, refusal), t0)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="verifier")
    future = pool.submit(verifier.verify, sandbox, task, episode)
    try:
        verdict = future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        verdict = Verdict(0.0, False, f"verifier {verifier.name!r} timed out after {timeout_s:g}s")
    except Exception as exc:
        verdict = Verdict(0.0, False, f"verifier {verifier.name!r} crashed: {type(exc).__name__}: {exc}")
    finally:
        # Never wait for a hung verifier thread: the sandbox it uses is closed right after.
        pool.shutdown(wait=False, cancel_futures=True)
    return _checked(verifier, verdict, t0)


def _checked(verifier: Verifier, verdict: Any, t0: float) -> Verdict:
    """Refuse what is not a finite Verdict (reward 0 with the reason) and stamp the duration."""
    if not isinstance(verdict, Verdict):
        verdict = Verdict(
            0.0, False, f"verifier {verifier.name!r} returned {type(verdict).__name__}, not a Verdict"
        )
    reward = float(verdict.reward)
    if reward != reward or not (-1e9 < reward < 1e9):  # NaN or absurd: never feed that to the trainer
        verdict = Verdict(
            0.0, False, f"verifier {verifier.name!r} returned a non-finite reward {verdict.reward!r}"
        )
    return replace(verdict, duration_s=time.perf_counter() - t0)


async def arun_verifier(
    verifier: Verifier, sandbox: Sandbox | None, task: Task, episode: Episode, timeout_s: float = 300.0
) -> Verdict:
    """`run_verifier` for asyncio code: awaits the verifier's own `averify` when it has one (with the
    same timeout and crash handling), else runs the synchronous verifier in a worker thread."""
    import asyncio

    averify = getattr(verifier, "averify", None)
    if averify is None:
        return await asyncio.to_thread(run_verifier, verifier, sandbox, task, episode, timeout_s)
    t0 = time.perf_counter()
    refusal = capability_refusal(verifier, sandbox)
    if refusal is not None:
        return _checked(verifier, Verdict(0.0, False, refusal), t0)
    try:
        verdict = await asyncio.wait_for(averify(sandbox, task, episode), timeout=timeout_s)
    except TimeoutError:
        verdict = Verdict(0.0, False, f"verifier {verifier.name!r} timed out after {timeout_s:g}s")
    except Exception as exc:
        verdict = Verdict(0.0, False, f"verifier {verifier.name!r} crashed: {type(exc).__name__}: {exc}")
    return _checked(verifier, verdict, t0)
