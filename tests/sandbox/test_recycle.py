"""Reusing a docker sandbox for another episode (`DockerSandbox.recycle`, `SandboxPool.release`):
nothing an episode left behind (processes, files, IPC objects, a changed workspace) reaches the next."""

from __future__ import annotations

import os
import threading
import time

import docker
import pytest

from agentrl.sandbox import PROTECTED_DIR, Limits, open_sandbox
from agentrl.sandbox.pool import SandboxPool

pytestmark = pytest.mark.docker

LIMITS = Limits(memory_mb=256, pids=64, disk_mb=32, exec_timeout_s=20)

# What an episode plants, as the agent (uid 1000): a daemon in a session of its own, files in every
# place it can write (a symlink out of the container among them), the workspace opened to everyone
# and tagged with an xattr, and one System V object of each kind.
PLANT_AS_AGENT = r"""
set -e
cd /workspace
echo one > f; mkdir -p d/e; echo two > d/e/g; ln -s /etc d/to-etc; ln -s /etc/passwd link
echo t > /tmp/t; mkdir /tmp/dir; echo s > /dev/shm/s; touch /dev/mqueue/q
chmod 777 /workspace
python3 - <<'EOF'
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
assert libc.shmget(0x5151, 4096, 0o1666) >= 0
assert libc.semget(0x5252, 1, 0o1666) >= 0
assert libc.msgget(0x5353, 0o1666) >= 0
os.setxattr("/workspace", "user.left", b"behind")
EOF
(setsid sh -c 'while true; do sleep 1; done' </dev/null >/dev/null 2>&1 &)
"""
# What the next episode would see of it (prints nothing when nothing is left).
LOOK = r"""
cd /workspace
ls -A /workspace /tmp /dev/shm /dev/mqueue | grep -v ':$' | grep . || true
stat -c 'workspace mode %a owner %u' /workspace | grep -v 'mode 755 owner 1000' || true
ipcs -m -s -q | grep -E '0x0000(5151|5252|5353)' || true
python3 -c "import os; print(os.listxattr('/workspace') or '', end='')"
ps -eo user=,args= | grep -v -E '^root +(/sbin/docker-init|sleep infinity)|agentrl-executor|ps -eo|grep|/bin/sh -c' || true
"""


def _box():
    return open_sandbox("docker", limits=LIMITS)


def test_a_recycled_container_keeps_nothing_of_the_episode() -> None:
    with _box() as sb:
        fresh = sb.exec(["/bin/sh", "-c", LOOK])
        assert fresh.ok and fresh.stdout.strip() == "", fresh
        planted = sb.exec(["/bin/sh", "-c", PLANT_AS_AGENT])
        assert planted.ok, planted
        # The verifier's identity and a privileged command leave their own things too.
        assert sb.exec(
            ["/bin/sh", "-c", "echo v > /tmp/by-verifier; (setsid sleep 600 &)"], as_verifier=True
        ).ok
        assert sb.exec(["/bin/sh", "-c", f"echo p > {PROTECTED_DIR}/hidden"], privileged=True).ok
        assert sb.exec(["/bin/sh", "-c", LOOK]).stdout.strip() != ""
        executor = sb.resident_executor
        container_id = sb.id

        assert sb.recycle() is True

        assert sb.id == container_id  # the same container, not a new one
        assert sb.resident_executor is not None and sb.resident_executor is not executor
        after = sb.exec(["/bin/sh", "-c", LOOK])
        assert after.ok and after.stdout.strip() == "", f"left from the last episode: {after.stdout!r}"
        assert sb.exec(["/bin/sh", "-c", f"ls -A {PROTECTED_DIR}"], privileged=True).stdout.strip() == ""
        # The symlinks were removed, never followed: /etc is whole, inside and on this host.
        assert sb.exec("test -s /etc/passwd").ok
        assert os.path.getsize("/etc/passwd") > 0
        # And it works as a fresh one does.
        sb.write_file("again.txt", "x")
        assert sb.exec("cat again.txt && touch /tmp/ok && id -u").stdout == "x1000\n"


def test_a_container_whose_executor_was_killed_is_not_reused() -> None:
    with _box() as sb:
        pid = sb.exec("echo $PPID").stdout.strip()
        sb.exec(["/bin/sh", "-c", f"(sleep 0.3; kill -9 {pid}) >/dev/null 2>&1 &"])
        time.sleep(1.0)
        assert sb.recycle() is False


def test_a_removed_container_is_not_reused() -> None:
    with _box() as sb:
        docker.from_env().containers.get(sb.id).remove(force=True)
        assert sb.recycle() is False


def test_the_pool_hands_a_released_container_out_again_reset() -> None:
    with SandboxPool(size=1, workers=1) as pool:
        first = pool.acquire("docker", limits=LIMITS)
        assert first.exec(["/bin/sh", "-c", PLANT_AS_AGENT]).ok
        pool.release(first)
        deadline = time.monotonic() + 60
        while pool.stats().recycled < 1:
            assert time.monotonic() < deadline, pool.stats()
            time.sleep(0.05)
        again = pool.acquire("docker", limits=LIMITS)
        assert again is first  # reset ones are handed out first
        assert again.exec(["/bin/sh", "-c", LOOK]).stdout.strip() == ""
        stats = pool.stats()
        assert stats.recycled == 1 and stats.recycle_refused == 0, stats
        pool.release(again)
    # Closing the pool removes what it kept, reset ones included.
    assert first._closed


def test_a_pool_without_recycling_removes_what_is_released() -> None:
    client = docker.from_env()
    with SandboxPool(size=0, workers=1, recycle=False) as pool:
        sb = pool.acquire("docker", limits=LIMITS)
        name = sb.name
        pool.release(sb)
        deadline = time.monotonic() + 60
        while client.api.containers(all=True, filters={"name": name}):
            assert time.monotonic() < deadline, "the released container was never removed"
            time.sleep(0.05)
        assert pool.stats().recycled == 0


def test_a_tampered_sandbox_is_closed_not_reused() -> None:
    with SandboxPool(size=0, workers=1) as pool:
        sb = pool.acquire("docker", limits=LIMITS)
        pid = sb.exec("echo $PPID").stdout.strip()
        sb.exec(["/bin/sh", "-c", f"(sleep 0.3; kill -9 {pid}) >/dev/null 2>&1 &"])
        time.sleep(1.0)
        pool.release(sb)
        deadline = time.monotonic() + 60
        while pool.stats().recycle_refused < 1:
            assert time.monotonic() < deadline, pool.stats()
            time.sleep(0.05)
        assert sb._closed and pool.warm_count() == 0


def test_an_env_whose_step_still_runs_elsewhere_closes_its_sandbox_instead_of_releasing_it() -> None:
    """The rollout ended an episode whose tool call hangs on another thread: that thread may still
    send a command, so the sandbox must never go to another episode."""
    from agentrl.env.registry import make

    released: list[object] = []

    class Lender:
        def release(self, sandbox: object) -> None:
            released.append(sandbox)

    env = make("agentrl/calc-v0", backend="docker", use_pool=False)
    try:
        env.reset(seed=0)
        sb = env.sandbox
        env._lender = Lender()
        other = threading.Thread(target=lambda: None)
        other.start()
        other.join()
        env._step_thread = other.ident  # a step in progress on that thread
        env.close()
        assert released == [] and sb._closed
        env._step_thread = None  # that step returned
        env.reset(seed=1)
        sb = env.sandbox
        env._lender = Lender()
        env.close()  # no step running: released to the pool
        assert released == [sb]
    finally:
        env.close()
