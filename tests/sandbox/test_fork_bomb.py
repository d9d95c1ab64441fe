"""Fork bombs end on time: a timeout holds while a bomb fills the sandbox's process table.

The bomb is contained by the sandbox's pids limit (its forks fail with EAGAIN); the timeout's
kill runs from the host, so no free pid is needed for it: docker freezes the container's cgroup
and kills the command's processes in it, bwrap freezes the exec's processes in the sandbox's
cgroup, kills them and its pid namespace. Checked for a tool command (also a bomb whose leader
thread exited, which /proc shows as a zombie and `cgroup.procs` not at all), for a background bomb
cleared by `kill_agent_processes`, and for the verifier identity's run of code that bombs on
import; each must end within its timeout plus `MARGIN_S` (a bound, not a speed target), leave
the sandbox answering, and leave no process of the bomb on the host.
"""

from __future__ import annotations

import subprocess
import textwrap
import time
import uuid

import pytest

from agentrl.sandbox import Limits, SandboxDead, open_sandbox
from agentrl.sandbox.docker import _IN_CONTAINER_KILL_S, DockerSandbox

# The default pids limit: the fuller the table, the longer an in-sandbox killer waits for a pid.
LIMITS = Limits(memory_mb=512, cpus=1.0, pids=256, disk_mb=32, exec_timeout_s=20)
TIMEOUT_S = 5.0
MARGIN_S = 5.0

# Every process forks for ever and survives every refused fork; the first refusal of each
# process is reported, so the output says what stopped the forks.
BOMB = textwrap.dedent(
    """
    import os
    said = False
    while True:
        try:
            os.fork()
        except OSError as exc:
            if not said:
                said = True
                os.write(2, ("fork refused: " + exc.strerror + "\\n").encode())
    """
)
REFUSED = "fork refused: Resource temporarily unavailable"
# The same from a thread, after the main thread has exited: the process then reads as a zombie
# in /proc while it forks on, so a killer that skips zombies would spare it.
LEADERLESS_BOMB = (
    "import ctypes, threading\n"
    "def bomb():\n"
    + textwrap.indent(BOMB, "    ")
    + "\nthreading.Thread(target=bomb).start()\nctypes.CDLL(None).pthread_exit(None)\n"
)

# The bwrap root file system is exported from the docker image, so both need the engine.
BACKENDS = [
    pytest.param("docker", marks=pytest.mark.docker, id="docker"),
    pytest.param("bwrap", marks=pytest.mark.docker, id="bwrap"),
]

pytestmark = pytest.mark.slow


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "bwrap":
        request.getfixturevalue("bwrap_path")  # fails loudly when bubblewrap is missing
    return request.param


@pytest.fixture
def sb(backend: str):
    with open_sandbox(backend, limits=LIMITS) as box:
        # Without a pids limit a bomb would fill the host's process table, not the sandbox's.
        enforcement = getattr(box, "enforcement", None)
        if enforcement is not None and "NOT" in enforcement.pids:
            pytest.fail(f"this sandbox enforces no pids limit ({enforcement.pids}); no bomb is run")
        if isinstance(box, DockerSandbox) and box._host_cgroup() is None:
            pytest.fail(
                "this process cannot freeze the containers' cgroups (a remote or rootless engine, or "
                "not root): the host-side kill these tests check is out of reach",
                pytrace=False,
            )
        yield box


@pytest.fixture
def token() -> str:
    """A string on the bomb's command line, so the host's process table can be searched for it."""
    return f"agentrl-bomb-{uuid.uuid4().hex[:12]}"


def host_processes_with(token: str) -> list[str]:
    """Live processes on the host (containers' included: one kernel) whose command line holds `token`."""
    ps = subprocess.run(["ps", "-eo", "pid=,stat=,args="], capture_output=True, text=True, check=True)
    return [line for line in ps.stdout.splitlines() if token in line and " Z" not in f" {line.split()[1]}"]


def assert_gone_from_host(token: str, within_s: float = 2.0) -> None:
    deadline = time.monotonic() + within_s
    while (left := host_processes_with(token)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"{len(left)} processes of the bomb outlived it on the host: {left[:5]}"


def assert_answers(box) -> None:
    after = box.exec("echo alive; ps -eo args=", timeout=20)
    assert after.ok and after.stdout.startswith("alive\n"), after
    assert "python3 -c" not in after.stdout and ":|:" not in after.stdout, after.stdout


@pytest.mark.parametrize("bomb", [BOMB, LEADERLESS_BOMB], ids=["fork_loop", "leaderless"])
def test_fork_bomb_in_a_command_ends_within_its_timeout(sb, token, bomb):
    t0 = time.monotonic()
    r = sb.exec(["python3", "-c", bomb, token], timeout=TIMEOUT_S)
    elapsed = time.monotonic() - t0
    assert r.timed_out and r.exit_code == -9, r
    assert elapsed < TIMEOUT_S + MARGIN_S, f"a {TIMEOUT_S:g}s timeout took {elapsed:.1f}s"
    assert REFUSED in r.stderr, r.stderr[:500]  # the pids limit held it, not the host's
    assert_gone_from_host(token)
    assert_answers(sb)


def test_fork_bomb_in_code_the_verifier_imports_ends_within_its_timeout(sb, token):
    # The agent's package bombs on import; the verifier identity imports it (as hidden tests do).
    sb.write_file("bombpkg/__init__.py", BOMB)
    load = f"import sys; sys.path.append({sb.workdir!r}); import bombpkg"
    t0 = time.monotonic()
    r = sb.exec(["python3", "-c", load, token], timeout=TIMEOUT_S, as_verifier=True)
    elapsed = time.monotonic() - t0
    assert r.timed_out and r.exit_code == -9, r
    assert elapsed < TIMEOUT_S + MARGIN_S, f"a {TIMEOUT_S:g}s timeout took {elapsed:.1f}s"
    assert REFUSED in r.stderr, r.stderr[:500]
    assert_gone_from_host(token)
    assert_answers(sb)


def test_background_shell_fork_bomb_is_cleared_within_bounds(sb, token):
    # The classic bomb backgrounds itself: on docker it outlives its command until
    # kill_agent_processes (the verifier's first step); on bwrap it dies with its exec.
    t0 = time.monotonic()
    sb.exec(["bash", "-c", ":(){ :|:& };:", token], timeout=TIMEOUT_S)
    assert time.monotonic() - t0 < TIMEOUT_S + MARGIN_S
    t0 = time.monotonic()
    sb.kill_agent_processes()
    assert time.monotonic() - t0 < MARGIN_S
    assert_gone_from_host(token)
    assert_answers(sb)


@pytest.mark.docker
def test_docker_bomb_timeout_spares_the_agents_other_background_processes():
    """docker keeps the agent's background processes across execs: the timeout's host-side
    kill takes the timed-out command's processes only."""
    with open_sandbox("docker", limits=LIMITS) as box:
        assert box.exec("nohup sleep 4321 >/dev/null 2>&1 &").ok
        assert "sleep 4321" in box.exec("ps -eo args=").stdout
        # Orphans started within a second before a command count as its own (clock-tick slack).
        time.sleep(1.5)
        r = box.exec(["python3", "-c", BOMB], timeout=TIMEOUT_S)
        assert r.timed_out
        assert "sleep 4321" in box.exec("ps -eo args=").stdout


@pytest.mark.docker
def test_docker_without_host_access_kills_in_the_container_or_kills_the_container(monkeypatch, token):
    """An engine on another machine: no cgroup to reach, so the killers run inside the container,
    within their budget; when a full process table leaves them no pid, the container is killed
    and the sandbox says why. Either way the timeout holds."""
    monkeypatch.setattr(DockerSandbox, "_host_cgroup", lambda self: None)
    with open_sandbox("docker", limits=LIMITS) as box:
        t0 = time.monotonic()
        try:
            r = box.exec(["python3", "-c", BOMB, token], timeout=TIMEOUT_S)
        except SandboxDead as exc:
            assert "fork bomb" in str(exc) and "container was killed" in str(exc), exc
            with pytest.raises(SandboxDead, match="container was killed"):
                box.exec("echo alive")
            assert not box.alive()
        else:
            assert r.timed_out, r
            assert_answers(box)
        bound = TIMEOUT_S + _IN_CONTAINER_KILL_S + MARGIN_S
        assert time.monotonic() - t0 < bound
    assert_gone_from_host(token)
