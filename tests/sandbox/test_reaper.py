"""The leak reaper: a run that dies, however it dies, leaves no container behind for long."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import docker
import pytest

from agentrl.sandbox import open_sandbox, reaper
from tests import fixtures_model
from tests.interrupted_loop import WHERE, assert_stopped_cleanly, capture, run_episodes

tiny_model_dir = (
    fixtures_model.tiny_model_dir
)  # the session-wide tiny model (its tokenizer drives the rollout)

pytestmark = pytest.mark.docker

AGENTRL_CLI = Path(sys.executable).with_name("agentrl")


def containers_of(run_id: str) -> list:
    return docker.from_env().containers.list(all=True, filters={"label": f"agentrl.run_id={run_id}"})


def default_sigint() -> None:
    # A suite started in the background by a script (`make test &`) inherits SIGINT ignored, and
    # Python then installs no KeyboardInterrupt handler; the child must see the Ctrl-C a test sends.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn_run(run_id: str, body: str = "", n_sandboxes: int = 2) -> subprocess.Popen:
    """A child "training run" that opens sandboxes, says READY, then runs `body`
    (by default: an exec that is still in flight when the test kills it)."""
    code = textwrap.dedent(
        f"""
        import sys, time
        from agentrl.sandbox import open_sandbox
        boxes = [open_sandbox("docker") for _ in range({n_sandboxes})]
        print("READY", flush=True)
        """
    ) + textwrap.dedent(body or "boxes[0].exec('sleep 60', timeout=120)\n")
    env = {**os.environ, "AGENTRL_RUN_ID": run_id}
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
    line = proc.stdout.readline()
    assert line.strip() == "READY", (
        f"child failed to start: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}"
    )
    return proc


@pytest.fixture
def run_id():
    rid = f"test-reaper-{uuid.uuid4().hex[:8]}"
    yield rid
    for c in containers_of(rid):  # never leave our own experiments behind
        c.remove(force=True)


def test_sigkilled_run_is_reaped(run_id):
    proc = spawn_run(run_id)
    time.sleep(0.5)  # mid-episode: the exec is running
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    leaked = containers_of(run_id)
    assert len(leaked) == 2, "SIGKILL runs no handler, so the containers must still be there"
    removed = reaper.reap()
    assert {c.name for c in leaked} <= set(removed)
    assert containers_of(run_id) == []


def test_next_startup_reaps_dead_runs(run_id):
    proc = spawn_run(run_id, n_sandboxes=1)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert len(containers_of(run_id)) == 1
    # A new process's first sandbox triggers the start-up reap.
    code = textwrap.dedent(
        """
        from agentrl.sandbox import open_sandbox, reaper
        with open_sandbox("docker"):
            reaper.wait_startup_reap(timeout=60)
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert containers_of(run_id) == []


def test_sigterm_removes_containers_and_still_terminates(run_id):
    proc = spawn_run(run_id)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM  # died of SIGTERM, as without us
    assert containers_of(run_id) == []


def test_sigterm_chains_to_the_previous_handler(run_id):
    body = """
    import signal, sys
    def mine(signum, frame):
        print("USER HANDLER", flush=True)
        sys.exit(3)
    signal.signal(signal.SIGTERM, mine)  # installed before any sandbox: ours must chain to it
    """
    code_prefix = textwrap.dedent(body)
    code = code_prefix + textwrap.dedent(
        """
        from agentrl.sandbox import open_sandbox
        boxes = [open_sandbox("docker") for _ in range(2)]
        print("READY", flush=True)
        boxes[0].exec('sleep 60', timeout=120)
        """
    )
    env = {**os.environ, "AGENTRL_RUN_ID": run_id}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "READY"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 3
    assert "USER HANDLER" in proc.stdout.read()
    assert containers_of(run_id) == []


def test_sigint_removes_containers_and_raises_keyboard_interrupt(run_id):
    body = """
    try:
        boxes[0].exec('sleep 60', timeout=120)
    except KeyboardInterrupt:
        print("KEYBOARD INTERRUPT", flush=True)
    """
    proc = spawn_run(run_id, body)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert "KEYBOARD INTERRUPT" in out
    assert containers_of(run_id) == []


def test_normal_exit_without_close_removes_containers(run_id):
    proc = spawn_run(run_id, body="pass\n")
    assert proc.wait(timeout=60) == 0
    assert containers_of(run_id) == []


def test_live_runs_are_left_alone():
    with open_sandbox("docker") as box:
        assert box.name not in reaper.reap()
        assert box.alive()


def test_owner_alive_rules():
    me = reaper.owner_labels()
    assert reaper.owner_alive(me) is True
    # Same pid, other start time: the pid was recycled, the owner is gone.
    assert reaper.owner_alive({**me, reaper.LABEL_PID_START: "1"}) is False
    # Another boot of this machine.
    assert reaper.owner_alive({**me, reaper.LABEL_BOOT_ID: "another-boot"}) is False
    # Another host: this machine cannot tell.
    assert reaper.owner_alive({**me, reaper.LABEL_HOST: "elsewhere"}) is None
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert reaper.owner_alive({**me, reaper.LABEL_PID: str(dead.pid)}) is False


def test_cli_reap(run_id):
    proc = spawn_run(run_id, n_sandboxes=1)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    (leaked,) = containers_of(run_id)
    out = subprocess.run([str(AGENTRL_CLI), "sandbox", "reap"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert leaked.name in out.stdout and "removed" in out.stdout
    assert containers_of(run_id) == []


# --- a rollout driver stopped by a scheduler ------------------------------

# The rollout API on calc-v0 (docker, warm pool), 2 tasks x 2 episodes at once. A scripted agent's
# first action is a python call that sleeps: when the test signals, every episode has a container
# with a command running in it, opened on a rollout worker thread, and the pool holds warm ones.
ROLLOUT_DRIVER = """
import sys
from transformers import AutoTokenizer
from agentrl.env.agents import tool_call
from agentrl.kit.demonstrations import ScriptedPolicy
from agentrl.rollout.masker import ChatMasker
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.loop import collect_sync

masker = ChatMasker(AutoTokenizer.from_pretrained(sys.argv[1]))

class Sleeper:
    def act(self, observation):
        print("ACT", flush=True)
        return tool_call("python", code="import time; time.sleep(120)")

collect_sync(
    "agentrl/calc-v0", [0, 1], None, RolloutConfig(group_size=2, concurrency=4, episode_timeout_s=300),
    masker=masker, episode_policy=lambda env, seq: ScriptedPolicy(Sleeper(), seq, masker),
    env_kwargs={"exec_timeout_s": 200},
)
"""


def spawn_rollout(run_id: str, model_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "AGENTRL_RUN_ID": run_id, "AGENTRL_POOL_SIZE": "2"}
    proc = subprocess.Popen(
        [sys.executable, "-c", ROLLOUT_DRIVER, str(model_dir)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
    for _ in range(4):  # every episode has sent its sleeping python call
        line = proc.stdout.readline()
        assert line.strip() == "ACT", (
            f"the driver failed: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}"
        )
    time.sleep(1.0)  # the calls are running in their containers
    assert len(containers_of(run_id)) >= 4
    return proc


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signalled_rollout_driver_leaves_no_container(run_id, tiny_model_dir, signum):
    proc = spawn_rollout(run_id, tiny_model_dir)
    proc.send_signal(signum)
    proc.communicate(timeout=120)
    assert containers_of(run_id) == []


def test_a_sigkilled_rollout_driver_is_cleaned_by_the_next_start_up_reap(run_id, tiny_model_dir):
    proc = spawn_rollout(run_id, tiny_model_dir)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert len(containers_of(run_id)) >= 4  # nothing can run on SIGKILL
    code = textwrap.dedent(
        """
        from agentrl.sandbox import open_sandbox, reaper
        with open_sandbox("docker"):
            reaper.wait_startup_reap(timeout=60)
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert containers_of(run_id) == []


def test_a_sandbox_closed_while_the_engine_is_frozen_is_owed_not_forgotten(private_engine, monkeypatch):
    from agentrl.sandbox.engine import engine

    monkeypatch.setenv("DOCKER_HOST", private_engine.address)
    monkeypatch.setenv("AGENTRL_DOCKER_TIMEOUT_S", "2")
    engine().check_health()
    box = open_sandbox("docker")
    with private_engine.frozen():
        box.close()  # does not raise, does not hang past the timeout
        assert box.name in reaper.pending_removals()
        assert reaper.retry_deferred() == []  # still frozen: still owed
    engine().check_health()
    assert reaper.retry_deferred() == [box.name]
    assert reaper.pending_removals() == []
    # The engine may be finishing the removal it was asked for while frozen ("in progress").
    deadline = time.monotonic() + 10
    while private_engine.containers(f"agentrl.run_id={reaper.run_id()}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert private_engine.containers(f"agentrl.run_id={reaper.run_id()}") == []


@pytest.mark.parametrize("where", WHERE)
def test_ctrl_c_in_an_event_loop_stops_its_tasks_cleanly_through_the_reapers_handler(
    where, caplog, monkeypatch
):
    """The reaper's SIGINT handler stands in front of Python's default one, so asyncio does not install its
    own: the interrupt it passes on must come from the loop, not from inside whichever task was running."""
    monkeypatch.setitem(reaper._previous, signal.SIGINT, signal.default_int_handler)
    previous = signal.signal(signal.SIGINT, reaper._on_signal)
    try:
        with capture(caplog) as seen, pytest.raises(KeyboardInterrupt):
            run_episodes(where, seen)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert_stopped_cleanly(seen)
