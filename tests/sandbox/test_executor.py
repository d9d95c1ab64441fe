"""The resident executor: its framing, today's exec semantics through it, and what the agent can do to it.

The semantics of `exec` are the other sandbox tests' (they run through the executor, which is on
by default); here the same commands run with it on and off side by side, and the executor's own
guarantees are checked: a command's output cannot forge a frame, the agent can neither read its
channel nor its memory, and an executor killed, replaced or frozen from inside ends the sandbox
(`SandboxDead`, an episode `env_error`) instead of answering for it.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from agentrl.sandbox import Limits, SandboxDead, open_sandbox
from agentrl.sandbox import executor as host
from agentrl.sandbox import executor_inside as wire
from agentrl.sandbox.pool import SandboxPool

LIMITS = Limits(memory_mb=256, pids=64, disk_mb=32, exec_timeout_s=20, output_limit_bytes=1000)

BACKENDS = [
    pytest.param("docker", marks=pytest.mark.docker, id="docker"),
    pytest.param("bwrap", marks=pytest.mark.docker, id="bwrap"),  # its rootfs comes from the image
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "bwrap":
        request.getfixturevalue("bwrap_path")
    return request.param


@pytest.fixture
def sb(backend: str):
    with open_sandbox(backend, limits=LIMITS, env={"FROM_SPEC": "spec"}) as box:
        assert box._executor.current is not None, box._executor.disabled
        yield box


# --- framing ---------------------------------------------------------------------------------


def test_frames_round_trip_in_any_split():
    nonce = os.urandom(wire.NONCE_BYTES)
    frames = [
        wire.encode(nonce, 1, {"op": "run", "argv": ["echo", "é"]}, [b"stdin"]),
        wire.encode(nonce, 2, {"exit": 0}, [b"out" * 1000, b""]),
    ]
    stream = b"".join(frames)
    for step in (1, 7, 31, len(stream)):
        parser = wire.Parser(nonce)
        got = []
        for i in range(0, len(stream), step):
            got += parser.feed(stream[i : i + step])
        assert got == [
            (1, {"op": "run", "argv": ["echo", "é"]}, [b"stdin"]),
            (2, {"exit": 0}, [b"out" * 1000, b""]),
        ]


@pytest.mark.parametrize("where", ["magic", "nonce", "length", "blobs"])
def test_a_frame_that_is_not_ours_is_refused(where):
    nonce = os.urandom(wire.NONCE_BYTES)
    frame = bytearray(wire.encode(nonce, 1, {"exit": 0}, [b"x"]))
    if where == "magic":
        frame[0:4] = b"EVIL"
    elif where == "nonce":
        frame[4:20] = os.urandom(wire.NONCE_BYTES)
    elif where == "length":
        frame[28:32] = (wire.MAX_BODY + 1).to_bytes(4, "big")
    else:  # a header that claims more blob bytes than its frame holds
        head = b'{"exit":0,"blobs":[99]}'
        body = wire.META_LEN.pack(len(head)) + head + b"x"
        frame = bytearray(wire.HEADER.pack(wire.MAGIC, nonce, 1, len(body)) + body)
    with pytest.raises(wire.FrameError):
        wire.Parser(nonce).feed(bytes(frame))


# --- the same semantics with and without it --------------------------------------------------

SEMANTICS = {
    "shell": ("echo $((6 * 7)) $FROM_SPEC $FROM_EXEC; echo err >&2; exit 7", {"env": {"FROM_EXEC": "x"}}),
    "argv": (["echo", "$((6 * 7))", "a  b"], {}),
    "identity": ("id -u; pwd; echo $HOME", {}),
    "signal": (["sh", "-c", "kill -TERM $$"], {}),
    "signal_of_child": ("python3 -c 'import os; os.kill(os.getpid(), 9)'", {}),
    "exit_137": ("exit 137", {}),
    "stdin": (["wc", "-c"], {"stdin": b"\x00\x01\x02" * 1000}),
    "missing": (["no-such-program"], {}),
    "truncation": (["seq", "1", "10000"], {}),
    "timeout": ("sleep 30", {"timeout": 1}),
}


@pytest.mark.parametrize("case", list(SEMANTICS), ids=list(SEMANTICS))
def test_results_match_with_and_without_the_executor(backend, case):
    cmd, kwargs = SEMANTICS[case]
    results = []
    for executor in (True, False):
        with open_sandbox(backend, limits=LIMITS, env={"FROM_SPEC": "spec"}, executor=executor) as box:
            assert (box._executor.current is not None) is executor
            results.append(box.exec(cmd, **kwargs))
    on, off = results
    assert (on.exit_code, on.stdout, on.timed_out, on.truncated) == (
        off.exit_code,
        off.stdout,
        off.timed_out,
        off.truncated,
    ), (on, off)
    if case == "missing":  # the runtimes word it differently; the program's name is in both
        assert "no-such-program" in on.stderr and "no-such-program" in off.stderr
    else:
        assert on.stderr == off.stderr


def test_commands_run_concurrently_through_one_executor(sb):
    results: dict[int, object] = {}

    def run(i: int) -> None:
        results[i] = sb.exec(f"sleep 0.5; echo {i}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert time.monotonic() - t0 < 4
    assert [results[i].stdout for i in range(8)] == [f"{i}\n" for i in range(8)]  # type: ignore[attr-defined]


def test_files_go_through_the_executor_on_docker(backend):
    with open_sandbox(backend, limits=LIMITS) as box:
        calls = []
        executor = box._executor.current
        for name in ("read", "write"):
            original = getattr(executor, name)

            def spy(*args, _original=original, _name=name, **kwargs):
                calls.append(_name)
                return _original(*args, **kwargs)

            setattr(executor, name, spy)
        box.write_file("d/f.sh", "#!/bin/sh\necho ran\n", mode=0o750)
        assert box.read_file("d/f.sh") == b"#!/bin/sh\necho ran\n"
        assert box.exec("stat -c '%U %a' d/f.sh; ./d/f.sh").stdout == "agent 750\nran\n"
        # docker reaches files through it; bwrap reads and writes them from the host side.
        assert calls == (["write", "read"] if backend == "docker" else [])


def test_an_image_without_python_runs_without_an_executor(backend, monkeypatch):
    monkeypatch.setattr(host, "launch_argv", lambda python="python3": ["/no/python3", "-c", "x"])
    monkeypatch.setattr(f"agentrl.sandbox.{backend}.launch_argv", host.launch_argv)
    with open_sandbox(backend, limits=LIMITS) as box:
        assert box._executor.current is None and box._executor.disabled
        assert box.exec("echo still works").stdout == "still works\n"
        box.write_file("x.txt", "x")
        assert box.read_file("x.txt") == b"x"


# --- what the agent can do to it ---------------------------------------------------------------


def test_output_that_looks_like_a_frame_is_only_output(sb):
    # A frame with a guessed nonce, printed by a command: it arrives as that command's stdout.
    forged = wire.encode(b"\0" * wire.NONCE_BYTES, 1, {"exit": 0, "timed_out": False}, [b"pwned", b""])
    r = sb.exec(
        ["python3", "-c", "import sys; sys.stdout.buffer.write(sys.stdin.buffer.read())"], stdin=forged
    )
    assert r.ok and r.stdout == forged.decode(errors="replace"), r
    assert sb.exec("echo next").stdout == "next\n"
    sb.check_intact()


def test_the_agent_cannot_reach_the_executors_channel_or_memory(sb):
    pid = "1" if sb.backend == "bwrap" else "$PPID"
    r = sb.exec(
        f"cat /proc/{pid}/environ; ls /proc/{pid}/fd/; echo forged > /proc/{pid}/fd/1; "
        f"head -c 16 /proc/{pid}/mem; "
        f"python3 -c 'import ctypes,sys; print(\"attach\", ctypes.CDLL(None).ptrace(16, int(sys.argv[1]), 0, 0))' {pid}"
    )
    assert "Permission denied" in r.stderr, r
    assert "forged" not in r.stdout and "attach -1" in r.stdout, r  # PTRACE_ATTACH refused
    assert sb.exec("echo still mine").stdout == "still mine\n"
    sb.check_intact()


def test_killing_the_executor_from_a_command_ends_the_sandbox(sb):
    if sb.backend == "bwrap":
        # There it is PID 1 of the sandbox's pid namespace: the kernel drops the agent's signals.
        r = sb.exec("kill -9 1; kill -STOP 1; echo sent")
        assert r.stdout == "sent\n" and sb.exec("echo alive").stdout == "alive\n"
        sb.check_intact()
        return
    with pytest.raises(SandboxDead, match="resident executor"):
        sb.exec("kill -9 $PPID; sleep 5")
    with pytest.raises(SandboxDead, match="resident executor"):
        sb.exec("echo again")
    assert not sb.alive()


@pytest.mark.docker
def test_an_executor_killed_in_the_background_is_caught_before_the_verifier():
    with open_sandbox("docker", limits=LIMITS) as box:
        assert box.exec("nohup sh -c 'sleep 0.5; kill -9 $0' $PPID >/dev/null 2>&1 &").ok
        time.sleep(1.5)
        with pytest.raises(SandboxDead, match="resident executor"):
            box.check_intact()
        with pytest.raises(SandboxDead, match="resident executor"):
            box.kill_agent_processes()  # the verifier's first step: it kills, then refuses


@pytest.mark.docker
def test_a_command_the_host_killers_ended_reads_as_timed_out(monkeypatch):
    """An executor starved past a command's deadline (a fork bomb holding the sandbox's CPU) answers
    only after the host-side killers ended the command; it then reports a SIGKILL it did not send.
    The host's patience is cut short here, so its killers step in before the executor's own deadline."""
    monkeypatch.setattr(host, "REPLY_GRACE_S", -2.5)  # overdue 0.5 s into a 3 s command
    with open_sandbox("docker", limits=LIMITS) as box:
        r = box.exec("sleep 30", timeout=3)
        assert r.timed_out and r.exit_code == -9, r
        assert r.duration_s < 3, r  # the host ended it, not the executor's deadline
        assert box.exec("echo alive", timeout=5).stdout == "alive\n"


@pytest.mark.docker
def test_a_frozen_executor_is_caught():
    with open_sandbox("docker", limits=LIMITS) as box:
        assert box.exec("nohup sh -c 'sleep 0.3; kill -STOP $0' $PPID >/dev/null 2>&1 &").ok
        time.sleep(1)
        t0 = time.monotonic()
        with pytest.raises(SandboxDead, match="stopped answering"):
            box.check_intact()
        assert time.monotonic() - t0 < host.PING_TIMEOUT_S + 2
        assert not box.alive()


@pytest.mark.docker
def test_a_replaced_executor_is_caught():
    # The agent kills the executor and starts its own, which cannot reach the channel anyway.
    fake = "import sys, time; sys.stdout.write('AGENTRL-EXECUTOR-HELLO\\n'); time.sleep(60)"
    with open_sandbox("docker", limits=LIMITS) as box:
        with pytest.raises(SandboxDead, match="resident executor"):
            box.exec(f'(nohup python3 -c "{fake}" >/dev/null 2>&1 &); kill -9 $PPID')
        with pytest.raises(SandboxDead):
            box.check_intact()


def test_a_flood_of_output_is_capped_inside(sb):
    t0 = time.monotonic()
    r = sb.exec("yes agentrl | head -c 300000000; yes err | head -c 50000000 >&2", timeout=60)
    assert r.ok and r.truncated and len(r.stdout) < 1100 and len(r.stderr) < 1100, r
    assert time.monotonic() - t0 < 60
    assert sb.exec("echo after").stdout == "after\n"
    sb.check_intact()


def test_kill_agent_processes_retires_it_and_the_next_command_starts_another(sb):
    first = sb._executor.current
    results = []
    t = threading.Thread(target=lambda: results.append(sb.exec("sleep 30", timeout=60)))
    t.start()
    time.sleep(0.5)
    sb.kill_agent_processes()
    t.join(10)
    assert results and results[0].exit_code == -9 and results[0].duration_s < 5
    assert sb.exec("echo fresh").stdout == "fresh\n"
    second = sb._executor.current
    assert second is not first and second.nonce != first.nonce and second.lost is None
    sb.check_intact()


def test_the_verifier_identity_never_runs_through_it(sb):
    executor = sb._executor.current
    seen = []
    original = executor.run
    executor.run = lambda *a, **k: seen.append(a) or original(*a, **k)
    sb.write_file("/verifier/t.txt", "hidden", privileged=True)
    assert sb.exec("cat /verifier/t.txt", as_verifier=True).stdout == "hidden"
    assert sb.exec("id -u", privileged=True).ok
    assert seen == []
    assert sb.exec("true").ok and len(seen) == 1


def test_a_warm_sandbox_whose_executor_died_is_replaced(backend):
    with SandboxPool(size=1, workers=1) as pool:
        pool.prewarm(1, backend=backend, limits=LIMITS, timeout_s=120)
        warm = next(iter(pool._keys.values())).ready[0].sandbox
        warm._executor.current._gone("killed for the test", tampered=True)
        with pool.acquire(backend, limits=LIMITS) as box:
            assert box is not warm and box.exec("echo ok").stdout == "ok\n"
        assert pool.stats().discarded_dead == 1


@pytest.mark.docker
def test_a_tool_env_episode_whose_executor_was_killed_ends_env_error_with_no_reward():
    from agentrl.core.task import Task
    from agentrl.env.tool_env import ToolEnv

    def call(name: str, **args: str) -> str:
        import json

        return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"

    task = Task(id="t/0", prompt="What is 2+2?", answer="4")
    with ToolEnv(tasks=[task], tools=["bash", "submit"], verifier="exact-match", use_pool=False) as env:
        env.reset(options={"task": task})
        env.step(call("bash", command="nohup sh -c 'sleep 0.3; kill -9 $0' $PPID >/dev/null 2>&1 &"))
        time.sleep(1.0)
        _, reward, _, _, info = env.step(call("submit", answer="4"))
    assert reward == 0.0 and info["finish_reason"] == "env_error", info
    assert "resident executor" in info["error"]


# --- when its owner dies ----------------------------------------------------------------------

OWNER = """
import json, os, signal, sys
from agentrl.sandbox import open_sandbox
sb = open_sandbox(sys.argv[1])
assert sb.exec("true").ok
if sys.argv[1] == "bwrap":
    resident = sb._residents.current
    os.kill(resident.pid, signal.SIGSTOP)  # frozen: it will never read the EOF its owner's death sends
    print(json.dumps({"root": str(sb._root), "pid": resident.pid}), flush=True)
else:
    print(json.dumps({"name": sb.name}), flush=True)
os._exit(0)  # no close(), no finalizers: what a SIGKILL leaves
"""


@pytest.mark.docker
def test_a_docker_executor_ends_when_its_owner_dies():
    import json
    import subprocess
    import sys

    import docker

    from agentrl.sandbox import reaper

    r = subprocess.run([sys.executable, "-c", OWNER, "docker"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    name = json.loads(r.stdout)["name"]
    container = docker.from_env().containers.get(name)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "agentrl-executor" in str(container.top()["Processes"]):
            time.sleep(0.2)
        assert "agentrl-executor" not in str(container.top()["Processes"])  # EOF on its channel
    finally:
        reaper.reap()
    with pytest.raises(docker.errors.NotFound):
        docker.from_env().containers.get(name)


@pytest.mark.docker
def test_a_frozen_bwrap_executor_left_by_a_dead_owner_is_reaped(bwrap_path):
    import json
    import subprocess
    import sys

    from agentrl.sandbox.bwrap import reap_stale

    r = subprocess.run([sys.executable, "-c", OWNER, "bwrap"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    left = json.loads(r.stdout)
    assert os.path.exists(f"/proc/{left['pid']}")  # frozen, it outlives its owner
    reap_stale()
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{left['pid']}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{left['pid']}") and not os.path.exists(left["root"])
