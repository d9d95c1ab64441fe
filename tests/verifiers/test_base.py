import inspect
import threading
import time
from dataclasses import dataclass

import pytest

from agentrl.core.episode import Episode
from agentrl.core.task import Task
from agentrl.verifiers import Verdict, get, run_verifier
from agentrl.verifiers.base import (
    DEFAULT_VERIFIER_TIMEOUT_S,
    VERIFIER_DEADLINE_MARGIN_S,
    verifier_deadline,
    verifier_failed,
)

T = Task(id="t", prompt="p")
E = Episode(task_id="t")


@dataclass
class Sleepy:
    name: str = "sleepy"

    def verify(self, sandbox, task, episode):
        time.sleep(5)
        return Verdict(1.0, True)


@dataclass
class Crashy:
    name: str = "crashy"

    def verify(self, sandbox, task, episode):
        raise ValueError("boom")


@dataclass
class Weird:
    value: object = None
    name: str = "weird"

    def verify(self, sandbox, task, episode):
        return self.value


def raise_line(fn) -> str:
    """file:line of the `raise` in `fn`'s source."""
    lines, start = inspect.getsourcelines(fn)
    return f"{__file__}:{start + next(i for i, line in enumerate(lines) if 'raise ' in line)}"


@dataclass
class Hangs:
    name: str = "hangs"

    def verify(self, sandbox, task, episode):
        time.sleep(3600)
        return Verdict(1.0, True)


def test_timeout_is_reward_zero_with_reason():
    t0 = time.perf_counter()
    v = run_verifier(Sleepy(), None, T, E, timeout_s=0.2)
    assert time.perf_counter() - t0 < 2
    assert v.reward == 0 and not v.passed
    assert v.details.startswith("verifier 'sleepy' exceeded its 0.2s deadline and was abandoned")
    assert verifier_failed(v.details)


def test_a_hung_verifier_is_abandoned_on_a_daemon_thread():
    """Never joined: an hour-long `time.sleep` in `verify` neither holds the caller nor the process's exit."""
    t0 = time.perf_counter()
    v = run_verifier(Hangs(), None, T, E, timeout_s=1.0)
    assert time.perf_counter() - t0 < 1.0 + 3
    assert v.reward == 0 and "verifier 'hangs' exceeded its 1s deadline" in v.details
    abandoned = [t for t in threading.enumerate() if t.name == "verifier-hangs"]
    assert abandoned and all(t.daemon for t in abandoned)


def test_crash_is_reward_zero_with_reason_and_where_it_was_raised():
    v = run_verifier(Crashy(), None, T, E)
    assert v.reward == 0
    assert v.details == f"verifier 'crashy' crashed: ValueError: boom (at {raise_line(Crashy.verify)})"
    assert verifier_failed(v.details)


@dataclass
class OwnTimeout:
    name: str = "own-timeout"

    def verify(self, sandbox, task, episode):
        raise TimeoutError("the grading service did not answer")


def test_a_timeout_error_the_verifier_raises_is_a_crash_not_an_overrun():
    v = run_verifier(OwnTimeout(), None, T, E, timeout_s=30.0)
    assert v.details.startswith(
        "verifier 'own-timeout' crashed: TimeoutError: the grading service did not answer"
    )


def test_the_deadline_is_the_verifiers_own_timeout_plus_a_margin_else_the_default():
    assert verifier_deadline(get("exact-match")) == DEFAULT_VERIFIER_TIMEOUT_S
    assert verifier_deadline(get("hidden-tests", timeout_s=600)) == 600 + VERIFIER_DEADLINE_MARGIN_S
    assert verifier_deadline(get("state")) == get("state").timeout_s + VERIFIER_DEADLINE_MARGIN_S
    assert verifier_deadline(get("hidden-tests", timeout_s=600), 5.0) == 5.0  # given: exactly that


def test_verdicts_that_judged_are_not_verifier_failures():
    assert not verifier_failed("expected 42, got 41")
    assert not verifier_failed("gate tool-used: FAIL (verifier 'x' crashed: no, a quote of one)")
    assert not verifier_failed("")


def test_non_verdict_and_nan_are_rejected():
    assert "not a Verdict" in run_verifier(Weird(1.0), None, T, E).details
    v = run_verifier(Weird(Verdict(float("nan"), True)), None, T, E)
    assert v.reward == 0 and "non-finite" in v.details


def test_duration_is_recorded():
    v = run_verifier(Weird(Verdict(1.0, True)), None, T, E)
    assert v.passed and v.duration_s >= 0


@dataclass
class AsyncOne:
    name: str = "async-one"

    def verify(self, sandbox, task, episode):
        raise AssertionError("arun_verifier must prefer averify")

    async def averify(self, sandbox, task, episode):
        return Verdict(1.0, True, "async")


@dataclass
class AsyncSlow:
    name: str = "async-slow"

    def verify(self, sandbox, task, episode):
        return Verdict(1.0, True)

    async def averify(self, sandbox, task, episode):
        import asyncio

        await asyncio.sleep(5)
        return Verdict(1.0, True)


def test_async_verifiers_are_awaited_with_the_same_guards():
    import asyncio

    from agentrl.verifiers import arun_verifier

    v = asyncio.run(arun_verifier(AsyncOne(), None, T, E))
    assert v.passed and v.details == "async"
    v = asyncio.run(arun_verifier(AsyncSlow(), None, T, E, timeout_s=0.1))
    assert v.reward == 0 and "verifier 'async-slow' exceeded its 0.1s deadline" in v.details
    # A synchronous verifier runs in a thread: the event loop is not blocked by it.
    v = asyncio.run(arun_verifier(Crashy(), None, T, E))
    assert v.reward == 0 and f"crashed: ValueError: boom (at {raise_line(Crashy.verify)})" in v.details


# --- capabilities: a verifier says what it needs of a sandbox; the backend's name never counts ---


@dataclass
class Needs:
    """Records whether verify ran; needs what it is given."""

    needs_capabilities: tuple[str, ...]
    name: str = "needs"
    calls: int = 0

    def verify(self, sandbox, task, episode):
        self.calls += 1
        return Verdict(1.0, True)

    async def averify(self, sandbox, task, episode):
        return self.verify(sandbox, task, episode)


@pytest.fixture
def local_sandbox():
    import warnings

    from agentrl.sandbox import open_sandbox

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sb = open_sandbox("local")
    with sb:
        yield sb


def test_a_sandbox_lacking_a_needed_capability_is_refused_without_calling_verify(local_sandbox):
    verifier = Needs(("isolated", "verifier_identity", "background_processes"))
    v = run_verifier(verifier, local_sandbox, T, E)
    assert verifier.calls == 0 and v.reward == 0 and not v.passed
    assert v.details == (
        "verifier 'needs' needs a sandbox with isolated, verifier_identity, background_processes; this "
        "local sandbox lacks isolated, verifier_identity (backends that have them: docker)"
    )


def test_a_sandbox_with_every_needed_capability_is_verified(local_sandbox):
    verifier = Needs(("background_processes",))  # what even local promises
    assert run_verifier(verifier, local_sandbox, T, E).passed and verifier.calls == 1


def test_the_async_path_refuses_alike(local_sandbox):
    import asyncio

    from agentrl.verifiers import arun_verifier

    verifier = Needs(("protected_dir",))
    v = asyncio.run(arun_verifier(verifier, local_sandbox, T, E))
    assert verifier.calls == 0 and v.reward == 0 and "lacks protected_dir" in v.details


def test_a_composite_needs_what_its_parts_and_gates_need():
    from agentrl.verifiers.composite import CompositeVerifier

    composite = CompositeVerifier(
        parts=[(Needs(("isolated", "protected_dir")), 1.0), ("exact-match", 1.0)],
        gates=[Needs(("protected_dir", "verifier_identity"))],
    )
    assert composite.needs_capabilities == ("protected_dir", "verifier_identity", "isolated")
    assert not composite.needs_sandbox
    assert CompositeVerifier(parts=[("hidden-tests", 1.0)]).needs_sandbox
