"""The verifier contract, the registry, and the safe way to call one.

A verifier scores an episode from what the agent left behind: `verify(sandbox, task, episode)
-> Verdict`. Verifiers run after the agent's last action. `run_verifier` is the only way the
environment calls one: a verifier that overruns its deadline or crashes gives reward 0 with the
reason in `details` (a crash with the file:line it was raised at), never an exception out of the
environment. The deadline is the outer bound of the whole call (`verifier_deadline`): a verifier's
own `timeout_s`, where it has one, bounds only the commands it runs in the sandbox.

A verifier that relies on what a sandbox promises declares it by name in a class attribute
`needs_capabilities` (fields of `agentrl.sandbox.Capabilities`, e.g. `("isolated",
"protected_dir", "verifier_identity")`): `run_verifier` then gives reward 0, with the reason,
on a sandbox that lacks one, without calling `verify`. Never test a sandbox's backend name.
"""

from __future__ import annotations

import re
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

from agentrl.core.deadline import DeadlineExceeded, call_with_deadline
from agentrl.core.episode import Episode
from agentrl.core.plugins import PluginError, Plugins
from agentrl.core.task import Task
from agentrl.core.types import Verdict
from agentrl.sandbox.base import BACKENDS, Sandbox, backend_capabilities, capabilities_of

ENTRY_POINT_GROUP = "agentrl.verifiers"

DEFAULT_VERIFIER_TIMEOUT_S = 300.0
"""The deadline of a verifier that declares no `timeout_s` of its own."""
VERIFIER_DEADLINE_MARGIN_S = 60.0
"""What the deadline adds to a verifier's own `timeout_s` (which bounds its sandbox command): the
work around that command (copying tests in, killing the agent's processes, reading results back)."""


@runtime_checkable
class Verifier(Protocol):
    """`verify` is the contract. A verifier may also define `async def averify(...)` (same
    arguments); `arun_verifier` awaits it when present and otherwise runs `verify` in a thread."""

    name: str

    def verify(self, sandbox: Sandbox | None, task: Task, episode: Episode) -> Verdict: ...


def _backend_lacks(name: str, needed: tuple[str, ...]) -> bool:
    """Whether backend `name` lacks any of `needed` (a backend plugin that does not load lacks them all)."""
    try:
        return bool(backend_capabilities(name).lacking(*needed))
    except PluginError:
        return True


def capability_refusal(verifier: object, sandbox: Sandbox | None) -> str | None:
    """Why `verifier` cannot run on `sandbox`: the capabilities in its `needs_capabilities` that the
    sandbox lacks, with the backends that have them; None when nothing is missing (or needed)."""
    needed = tuple(getattr(verifier, "needs_capabilities", ()))
    if not needed or sandbox is None:
        return None
    missing = capabilities_of(sandbox).lacking(*needed)
    if not missing:
        return None
    having = [name for name in BACKENDS if not _backend_lacks(name, needed)]
    return (
        f"verifier {getattr(verifier, 'name', type(verifier).__name__)!r} needs a sandbox with "
        f"{', '.join(needed)}; this {getattr(sandbox, 'backend', type(sandbox).__name__)} sandbox lacks "
        f"{', '.join(missing)} (backends that have them: {', '.join(having) or 'none registered'})"
    )


# Verifier factories by name: the built-ins (`agentrl.verifiers` registers them on import), then the
# `agentrl.verifiers` entry points of installed packages, each imported when first asked for.
VERIFIERS: Plugins[Callable[..., Verifier]] = Plugins(ENTRY_POINT_GROUP, "verifier")


def register(name: str, factory: Callable[..., Verifier], *, override: bool = False) -> None:
    """Make `factory(**kwargs) -> Verifier` available as `get(name, **kwargs)`."""
    VERIFIERS.register(name, factory, override=override)


def names() -> list[str]:
    """Every verifier that loads: the built-ins, then the plugins (one that fails to import warns)."""
    return list(VERIFIERS.load_all())


def factory(name: str) -> Callable[..., Verifier]:
    """The factory registered as `name` (for listings and docs); `get` builds a verifier from it."""
    return VERIFIERS.get(name)


def get(name: str, **kwargs: Any) -> Verifier:
    """Build the verifier registered as `name` with `kwargs`."""
    return VERIFIERS.get(name)(**kwargs)


def verifier_deadline(verifier: object, timeout_s: float | None = None) -> float:
    """The wall-clock deadline of one call of `verifier`: `timeout_s` when given, else the
    verifier's own `timeout_s` plus `VERIFIER_DEADLINE_MARGIN_S` when it declares one (`hidden-tests`,
    `state`), else `DEFAULT_VERIFIER_TIMEOUT_S`."""
    if timeout_s is not None:
        return float(timeout_s)
    own = getattr(verifier, "timeout_s", None)
    if isinstance(own, int | float) and not isinstance(own, bool) and own > 0:
        return float(own) + VERIFIER_DEADLINE_MARGIN_S
    return DEFAULT_VERIFIER_TIMEOUT_S


def _name(verifier: object) -> str:
    return repr(getattr(verifier, "name", type(verifier).__name__))


def _overran(verifier: object, deadline_s: float) -> Verdict:
    return Verdict(
        0.0,
        False,
        f"verifier {_name(verifier)} exceeded its {deadline_s:g}s deadline and was abandoned; make it return "
        "sooner, or raise the environment's verifier_timeout_s",
    )


def _crashed(verifier: object, exc: BaseException) -> Verdict:
    """Reward 0, naming the exception and where it was raised: the innermost frame of its traceback."""
    where = ""
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        where = f" (at {frames[-1].filename}:{frames[-1].lineno})"
    return Verdict(0.0, False, f"verifier {_name(verifier)} crashed: {type(exc).__name__}: {exc}{where}")


# The words of the verdicts above and of `capability_refusal`/`_checked`: the verifier did not judge.
_NOT_JUDGED = re.compile(
    r"verifier (?:'[^']*'|\"[^\"]*\") (?:crashed: |exceeded its [^ ]+ deadline|returned |needs a sandbox with )"
)


def verifier_failed(details: str) -> bool:
    """Whether a verdict's `details` say the verifier itself failed (crashed, overran its deadline,
    returned garbage, was refused the sandbox it needs) rather than judged the episode. For readers of
    recorded verdicts: a trajectory keeps only the `details` (`Trajectory.verdict_details`)."""
    return bool(_NOT_JUDGED.match(details or ""))


def run_verifier(
    verifier: Verifier,
    sandbox: Sandbox | None,
    task: Task,
    episode: Episode,
    timeout_s: float | None = None,
) -> Verdict:
    """Run a verifier within its deadline (`verifier_deadline(verifier, timeout_s)`); a crash, an
    overrun or a sandbox without the capabilities it needs is reward 0 with the reason.

    An overrunning verifier is abandoned on its thread, never waited for (the sandbox it uses is
    closed right after); what it returns later is dropped."""
    t0 = time.perf_counter()
    refusal = capability_refusal(verifier, sandbox)
    if refusal is not None:
        return _checked(verifier, Verdict(0.0, False, refusal), t0)
    deadline_s = verifier_deadline(verifier, timeout_s)
    try:
        verdict = call_with_deadline(
            verifier.verify,
            sandbox,
            task,
            episode,
            timeout_s=deadline_s,
            name=f"verifier-{getattr(verifier, 'name', '?')}",
        )
    except DeadlineExceeded:
        verdict = _overran(verifier, deadline_s)
    except Exception as exc:
        verdict = _crashed(verifier, exc)
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
    verifier: Verifier,
    sandbox: Sandbox | None,
    task: Task,
    episode: Episode,
    timeout_s: float | None = None,
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
    deadline_s = verifier_deadline(verifier, timeout_s)
    try:
        async with asyncio.timeout(deadline_s) as scope:
            verdict = await averify(sandbox, task, episode)
    except TimeoutError as exc:
        # Only the deadline's own expiry is an overrun; a TimeoutError the verifier raised is a crash.
        verdict = _overran(verifier, deadline_s) if scope.expired() else _crashed(verifier, exc)
    except Exception as exc:
        verdict = _crashed(verifier, exc)
    return _checked(verifier, verdict, t0)
