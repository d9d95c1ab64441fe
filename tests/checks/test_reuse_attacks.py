"""The audit's attack on sandbox reuse (`agentrl.checks.attacks_reuse`), played for real on docker.

With the pool's reset, the next episode in the same container finds nothing of the last one; with a
"reset" that only restarts the executor (what reuse without a reset would be), the attack finds
what it planted: it can fail."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import agentrl
from agentrl.checks.audit import run_audit
from agentrl.sandbox import pool as pool_module
from agentrl.sandbox.docker import DockerSandbox
from agentrl.sandbox.pool import SandboxPool

pytestmark = pytest.mark.docker


@pytest.fixture
def own_default_pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[SandboxPool]:
    """A default pool of this test's own, closed after it (the env takes the process-wide one)."""
    pool = SandboxPool(size=1, workers=1)
    monkeypatch.setattr(pool_module, "_default_pool", pool)
    yield pool
    pool.close()


def _leftovers(env_id: str) -> tuple[str, str]:
    env = agentrl.make(env_id, backend="docker")
    try:
        (finding,) = run_audit(env, tasks=1, only=["episode-leftovers"]).findings
    finally:
        env.close()
    return finding.status, finding.evidence


def test_a_reset_container_shows_the_next_episode_nothing(own_default_pool: SandboxPool) -> None:
    status, evidence = _leftovers("agentrl/calc-v0")
    assert status == "contained", evidence
    assert "same sandbox" in evidence and "found none of it" in evidence
    assert own_default_pool.stats().recycled >= 1


def test_reuse_without_a_reset_is_caught(
    own_default_pool: SandboxPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    def executor_only(self: DockerSandbox) -> bool:
        retired = self._executor.retire()
        if retired is not None:
            retired.close()
        self._executor.get()
        return True

    monkeypatch.setattr(DockerSandbox, "recycle", executor_only)
    status, evidence = _leftovers("agentrl/calc-v0")
    assert status == "exploited", evidence
    for left in (
        "file ./",
        "file /tmp/",
        "file /dev/shm/",
        "file /dev/mqueue/",
        "process",
        "ipc",
        "mode 777",
    ):
        assert left in evidence, (left, evidence)
