"""The Docker engine layer: bounded life-cycle calls, a health check, fast and clear failures.

Frozen-engine tests run against a private dockerd (tests/fixtures_dockerd.py), never the shared
one, with a 2 s API timeout so each takes seconds.
"""

from __future__ import annotations

import threading
import time

import pytest
import requests

from agentrl.sandbox import EngineUnavailable, open_sandbox, reaper
from agentrl.sandbox.engine import ENGINE_DOWN, engine

pytestmark = pytest.mark.docker


@pytest.fixture
def on_private(private_engine, monkeypatch):
    """Sandboxes of this test go to the private engine, with a 2 s API timeout."""
    monkeypatch.setenv("DOCKER_HOST", private_engine.address)
    monkeypatch.setenv("AGENTRL_DOCKER_TIMEOUT_S", "2")
    eng = engine()
    eng.check_health()  # a thawed engine from an earlier test is healthy again
    yield private_engine
    private_engine.thaw()
    eng.check_health()
    settle_owed_removals()


def settle_owed_removals(timeout_s: float = 20.0) -> None:
    """Retry owed removals until none is left: a create that timed out while the engine was frozen
    is carried out by the engine once it thaws, and must be removed then, not forgotten."""
    deadline = time.monotonic() + timeout_s
    while reaper.pending_removals() and time.monotonic() < deadline:
        reaper.retry_deferred()
        time.sleep(0.2)


def test_lifecycle_calls_are_bounded_in_concurrency(monkeypatch):
    monkeypatch.setenv("AGENTRL_DOCKER_MAX_LIFECYCLE_CALLS", "2")
    eng = engine()
    boxes, errors = [], []

    def open_one() -> None:
        try:
            boxes.append(open_sandbox("docker"))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for box in boxes:
        box.close()
    assert errors == []
    stats = eng.stats()
    assert stats.calls == 6 * 3  # create, start, remove each
    assert stats.max_in_flight == 2  # six threads asked at once; two ran
    assert stats.in_flight == 0


def test_a_frozen_engine_is_reported_in_words_then_fails_fast(on_private):
    eng = engine()
    with on_private.frozen():
        with pytest.raises(EngineUnavailable) as first:
            open_sandbox("docker")
        assert ENGINE_DOWN in str(first.value) and "ReadTimeout" not in str(first.value)
        # Known down: the next call does not wait out another timeout.
        t0 = time.monotonic()
        with pytest.raises(EngineUnavailable, match=ENGINE_DOWN):
            open_sandbox("docker")
        assert time.monotonic() - t0 < eng.timeout_s
        assert eng.stats().fast_failures >= 1
    assert eng.check_health()  # back: calls go through again
    open_sandbox("docker").close()
    # The create that hung was queued in the engine and runs now that it thawed: still removed.
    settle_owed_removals()
    assert reaper.pending_removals() == []
    assert on_private.containers(f"agentrl.run_id={reaper.run_id()}") == []


def test_a_start_that_times_out_leaves_no_created_container(on_private, monkeypatch):
    eng = engine()
    real_start = eng.api.start

    def start_on_a_frozen_engine(*args, **kwargs):
        on_private.freeze()  # the create went through; the engine hangs from the start on
        return real_start(*args, **kwargs)

    monkeypatch.setattr(eng.api, "start", start_on_a_frozen_engine)
    try:
        with pytest.raises(EngineUnavailable, match=ENGINE_DOWN) as info:
            open_sandbox("docker")
        assert len(reaper.pending_removals()) == 1  # created, never started, and not forgotten
        assert "starting container" in str(info.value)
    finally:
        on_private.thaw()
    assert eng.check_health()
    assert len(reaper.retry_deferred()) == 1
    assert on_private.containers(f"agentrl.run_id={reaper.run_id()}") == []


def test_a_start_that_hangs_while_the_engine_answers_pings_removes_the_container(monkeypatch):
    # The libnetwork deadlock: pings answer, starts hang. The created container is removed at once.
    eng = engine()

    def hung_start(*args, **kwargs):
        raise requests.exceptions.ReadTimeout("read timed out (a start that never returns)")

    monkeypatch.setattr(eng.api, "start", hung_start)
    with pytest.raises(EngineUnavailable, match="answers pings: it is overloaded or deadlocked"):
        open_sandbox("docker")
    assert reaper.pending_removals() == []
    mine = eng.client.containers.list(all=True, filters={"label": f"agentrl.run_id={reaper.run_id()}"})
    assert [c.status for c in mine if c.status == "created"] == []
