"""The sandbox provider: what an environment gets its sandboxes from, decided by the backend's capabilities."""

from __future__ import annotations

import time
import warnings

import pytest

from agentrl.core.plugins import UnknownPluginError
from agentrl.sandbox.base import backend_capabilities
from agentrl.sandbox.pool import get_default_pool
from agentrl.sandbox.provider import SandboxProvider


@pytest.fixture(autouse=True)
def _quiet_local():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*NO isolation.*")
        yield


def closed_soon(sb, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not sb.alive():
            return True
        time.sleep(0.05)
    return False


def test_unpooled_sandboxes_are_started_on_acquire_and_closed_on_release():
    provider = SandboxProvider("local", pooled=False)
    sb = provider.acquire(env={"A": "1"})
    assert sb.backend == "local" and sb.exec("echo $A").stdout == "1\n"
    provider.release(sb)
    assert not sb.alive()


def test_pooled_sandboxes_come_from_the_warm_pool_and_go_back_to_it():
    provider = SandboxProvider("local")
    pool = get_default_pool()
    before = pool.stats()
    sb = provider.acquire(env={"PROVIDER_TEST": "1"})
    after = pool.stats()
    assert after.hits + after.misses == before.hits + before.misses + 1  # the pool handed it out
    provider.release(sb)
    assert closed_soon(sb)  # a local sandbox cannot be reset: the pool closes it (off the caller's path)


def test_a_backend_without_host_placement_ignores_the_docker_hosts(monkeypatch):
    monkeypatch.setenv("AGENTRL_DOCKER_HOSTS", "tcp://127.0.0.1:1")
    provider = SandboxProvider("local")
    assert not provider.capabilities.host_placement
    sb = provider.acquire()
    assert sb.exec("true").ok
    provider.release(sb)


def test_exit_handlers_only_for_a_backend_whose_sandboxes_outlive_the_process():
    assert SandboxProvider("local").install_exit_handlers() is False
    assert SandboxProvider("bwrap").install_exit_handlers() is False
    assert backend_capabilities("docker").outlives_process
    assert SandboxProvider("docker").install_exit_handlers() is True  # pytest runs tests on the main thread


def test_an_unknown_backend_is_refused_before_any_sandbox_starts():
    with pytest.raises(UnknownPluginError, match="no sandbox backend named 'dokcer'. Did you mean 'docker'?"):
        SandboxProvider("dokcer")
