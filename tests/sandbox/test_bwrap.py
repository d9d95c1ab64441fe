"""The `bwrap` backend: the sandbox protocol under bubblewrap, and its root file system export.

The rootfs comes from the local Docker image (exported once, cached), so most tests carry
the `docker` mark; `test_unprivileged_user_*` runs the backend as uid 1000 from a copied
rootfs, the way it runs on a GPU node without Docker.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from agentrl.sandbox import Limits, Sandbox, SandboxDead, SandboxPathError, open_sandbox
from agentrl.sandbox.bwrap import ROOTFS_ENV, BwrapSandbox, export_rootfs, find_rootfs
from tests import fixtures_net

loopback_listener = fixtures_net.loopback_listener

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def sb(bwrap_path):
    with open_sandbox("bwrap", limits=Limits(exec_timeout_s=10, output_limit_bytes=1000)) as box:
        yield box


def test_satisfies_protocol_and_runs_as_agent_in_workspace(sb):
    assert isinstance(sb, Sandbox) and sb.backend == "bwrap" and sb.alive()
    r = sb.exec("id -u; id -un; pwd; echo $HOME; hostname")
    assert r.ok, r
    assert r.stdout.split() == ["1000", "agent", "/workspace", "/workspace", "agentrl"]


def test_files_persist_across_execs_and_host_side_round_trip(sb):
    sb.write_file("src/a.py", "print(6*7)\n")
    assert sb.exec("python3 src/a.py").stdout == "42\n"
    sb.exec("echo from-agent > /workspace/out.txt; echo t > /tmp/t")
    assert sb.read_file("out.txt") == b"from-agent\n"
    assert sb.read_file("/tmp/t") == b"t\n"
    assert sb.exec("cat /tmp/t").stdout == "t\n"  # /tmp persists too, like a container's
    assert sb.read_file("/etc/debian_version").strip()  # the rootfs is readable


def test_exit_codes_signals_stdin_env(sb):
    assert sb.exec(["sh", "-c", "exit 3"]).exit_code == 3
    assert sb.exec("kill -9 $$").exit_code == -9
    r = sb.exec("cat; echo $FOO; echo err >&2", stdin=b"in\n", env={"FOO": "bar"})
    assert (r.stdout, r.stderr) == ("in\nbar\n", "err\n")
    r = sb.exec(["python3", "-c", "import sys; print(len(sys.stdin.read()))"], stdin="x" * 200_000)
    assert r.stdout == "200000\n"


def test_environment_is_clean(sb, monkeypatch):
    monkeypatch.setenv("AGENTRL_HOST_SECRET", "s3cret")
    env = sb.exec("env").stdout
    assert "s3cret" not in env and "PATH=" in env


def test_output_capped_while_streaming(sb):
    r = sb.exec("head -c 100000000 /dev/zero | tr '\\0' y")
    assert r.ok and r.truncated
    assert r.stdout == "y" * 1000 + "\n[agentrl: output truncated, 99999000 bytes dropped]"
    assert r.duration_s < 10


def test_timeout_kills_grandchildren_and_setsid_escapees(sb):
    r = sb.exec("(sleep 1000 &); setsid sleep 1001 & sleep 1002", timeout=1)
    assert r.timed_out and r.exit_code == -9 and 0.9 < r.duration_s < 5
    time.sleep(0.3)
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert not any(line.startswith(("sleep 1000", "sleep 1001", "sleep 1002")) for line in ps.splitlines())


def test_background_process_ends_with_its_exec(sb):
    # Each exec is its own pid namespace: nothing outlives it (documented difference from docker).
    r = sb.exec("sleep 1000 & echo started")
    assert r.ok and r.duration_s < 2
    assert "sleep" not in sb.exec("ps -eo comm").stdout


def test_verifier_dir_is_read_only_for_the_agent(sb):
    sb.write_file("/verifier/test_hidden.py", "def test_x(): pass\n", privileged=True)
    r = sb.exec("echo pwned > /verifier/test_hidden.py")
    assert r.exit_code != 0 and "Read-only" in r.stderr
    assert sb.read_file("/verifier/test_hidden.py") == b"def test_x(): pass\n"
    with pytest.raises(SandboxPathError, match="privileged=True"):
        sb.write_file("/verifier/x", "y")
    # The verifier's own exec may write there.
    assert sb.exec("echo ok > /verifier/result", privileged=True).ok
    assert sb.read_file("/verifier/result") == b"ok\n"


def test_rootfs_is_read_only_from_both_sides(sb):
    r = sb.exec("echo x > /etc/pwned; echo x > /usr/bin/pwned")
    assert r.exit_code != 0
    with pytest.raises(SandboxPathError, match="read-only"):
        sb.write_file("/etc/pwned", "x", privileged=True)
    assert not (sb.rootfs / "etc" / "pwned").exists()


def test_no_network(sb, loopback_listener):
    """This machine's loopback listener is out of reach (the sandbox's loopback is its own), and no other
    interface exists."""
    assert loopback_listener.reachable_from_here()
    seen = len(loopback_listener.accepted)
    connect = f"import socket; socket.create_connection(('127.0.0.1', {loopback_listener.port}), timeout=2)"
    r = sb.exec(["python3", "-c", connect])
    assert r.exit_code != 0 and "refused" in r.stderr.lower(), r
    assert len(loopback_listener.accepted) == seen
    assert sb.exec("cat /proc/net/dev").stdout.count(":") == 1  # only lo


def test_network_only_when_limits_allow_it(bwrap_path):
    host_ifaces = Path("/proc/net/dev").read_text().count(":")
    with open_sandbox("bwrap", limits=Limits(network=True)) as box:
        assert box.exec("cat /proc/net/dev").stdout.count(":") == host_ifaces
        assert box.enforcement.network.startswith("shared")


def test_symlinks_planted_by_the_agent_cannot_redirect_host_side_io(sb, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("host secret")
    sb.exec(f"ln -s {secret} abs; ln -s ../../../../../../../../{secret} rel; ln -s / root; ln -s /proc/1 p")
    # Links resolve in the sandbox's namespace: they reach the sandbox's own paths only.
    for path in ("abs", "rel"):
        with pytest.raises(FileNotFoundError):
            sb.read_file(path)
    with pytest.raises(SandboxPathError):
        sb.write_file("root/etc/passwd", "x")
    with pytest.raises(SandboxPathError):
        sb.read_file("p/environ")
    assert secret.read_text() == "host secret"


def test_fifo_planted_by_the_agent_is_refused_not_hung_on(sb):
    sb.exec("mkfifo results.json")
    with pytest.raises(SandboxPathError, match="regular file"):
        sb.read_file("results.json")


def test_copy_in_and_setuid_bits_dropped(sb, tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "test_a.py").write_text("def test_a():\n    assert True\n")
    sb.copy_in(tmp_path / "t", "/verifier/tests", privileged=True)
    r = sb.exec("python3 -m pytest -q -p no:cacheprovider /verifier/tests", privileged=True)
    assert r.ok, r.stdout + r.stderr
    sb.write_file("suid", "#!/bin/sh\nid -u\n", mode=0o4755)
    assert sb.exec("stat -c %a suid").stdout.strip() == "755"


def test_limits_pids_and_memory_contained(bwrap_path):
    with open_sandbox("bwrap", limits=Limits(pids=32, memory_mb=128, exec_timeout_s=20)) as box:
        r = box.exec("for i in $(seq 100); do sleep 5 & done; wait", timeout=20)
        assert "fork" in r.stderr.lower() or "resource" in r.stderr.lower(), r
        r = box.exec(["python3", "-c", "x = bytearray(512 << 20)"])
        assert r.exit_code != 0
        assert box.exec("echo fine").ok


def test_disk_cap(bwrap_path):
    with open_sandbox("bwrap", limits=Limits(disk_mb=16)) as box:
        r = box.exec("head -c 64000000 /dev/zero > big")
        assert r.exit_code != 0
        assert os.path.getsize(box.host_workdir / "big") <= 16 << 20


def test_kill_agent_processes_stops_a_running_exec(sb):
    import threading

    results = []
    t = threading.Thread(target=lambda: results.append(sb.exec("sleep 30", timeout=60)))
    t.start()
    time.sleep(0.5)
    sb.kill_agent_processes()
    t.join(10)
    assert results and results[0].exit_code == -9 and results[0].duration_s < 5


def test_concurrent_execs_do_not_kill_each_other(sb):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(sb.exec, "sleep 1.5; echo slow")
        fast = [sb.exec(f"echo {i}") for i in range(5)]
        assert slow.result(timeout=30).stdout == "slow\n"
    assert [r.stdout for r in fast] == [f"{i}\n" for i in range(5)]


def test_close_twice_cleans_up_and_then_refuses(sb):
    root = sb._root
    assert root.is_dir() and sb.host_workdir.is_dir()
    sb.close()
    sb.close()
    assert not root.exists() and not sb.alive()
    with pytest.raises(SandboxDead):
        sb.exec("true")


def test_file_from_one_sandbox_absent_in_the_next(bwrap_path):
    with open_sandbox("bwrap") as a:
        a.exec("echo leak > /workspace/leak; echo leak > /tmp/leak")
    with open_sandbox("bwrap") as b:
        assert b.exec("ls /workspace /tmp").stdout.split() == ["/tmp:", "/workspace:"]


def test_what_a_killed_process_left_behind_is_reaped(bwrap_path):
    from agentrl.sandbox.bwrap import reap_stale

    script = (
        "import json, os\n"
        "from agentrl.sandbox import open_sandbox\n"
        "sb = open_sandbox('bwrap')\n"
        "sb.exec('echo x > /workspace/x')\n"
        "print(json.dumps([str(sb._root), sb._cgroups.dirs[0].as_posix() if sb._cgroups else '', sb._holder.pid]))\n"
        "os._exit(0)  # no close(), no finalizers: what a SIGKILL leaves\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    root, cgroup, holder = json.loads(r.stdout)
    # The tmpfs holder reads a pipe only the dead process wrote: it is gone, and its tmpfs with it.
    deadline = time.monotonic() + 5
    while Path(f"/proc/{holder}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{holder}").exists()
    assert Path(root).is_dir()
    assert reap_stale() and not Path(root).exists()
    assert not cgroup or not Path(cgroup).exists()
    assert not any(root in line for line in Path("/proc/mounts").read_text().splitlines())


@pytest.mark.slow
def test_export_rootfs_to_a_directory_strips_setuid_and_device_nodes(tmp_path):
    dest = export_rootfs(dest=tmp_path / "rootfs")
    assert (dest / "usr" / "bin" / "python3").exists() and (dest / ".agentrl-rootfs-complete").exists()
    su = dest / "usr" / "bin" / "su"
    assert su.exists() and not su.stat().st_mode & 0o6000  # setuid root in the image
    devices = [
        Path(d, f)
        for d, _, files in os.walk(dest)
        for f in files
        if stat.S_ISCHR(os.lstat(Path(d, f)).st_mode) or stat.S_ISBLK(os.lstat(Path(d, f)).st_mode)
    ]
    assert devices == []
    start = time.monotonic()
    assert export_rootfs(dest=dest) == dest and time.monotonic() - start < 5  # complete: reused
    from agentrl.sandbox.bwrap import cached_rootfs

    assert cached_rootfs() != dest  # the tag index names the cache, never a caller's directory


def test_a_sandbox_failing_half_way_through_setup_leaves_nothing(bwrap_path, monkeypatch):
    import uuid

    import agentrl.sandbox.bwrap as bw

    known = uuid.uuid4()
    monkeypatch.setattr(bw.uuid, "uuid4", lambda: known)

    def broken(*args, **kwargs):
        raise OSError("simulated failure while creating cgroups")

    monkeypatch.setattr(bw.Cgroups, "create", broken)
    with pytest.raises(OSError, match="simulated"):
        BwrapSandbox()
    assert not list(Path(tempfile.gettempdir()).glob(f"agentrl-bwrap-{known.hex[:12]}-*"))


def test_missing_workdir_is_a_clear_error(bwrap_path):
    from agentrl.sandbox import SandboxError

    with pytest.raises(SandboxError, match="does not exist in the root file system"):
        BwrapSandbox(workdir="/nowhere")


@pytest.mark.slow
def test_unprivileged_user_with_rootfs_from_env(bwrap_path):
    """uid 1000, no Docker access, AGENTRL_BWRAP_ROOTFS: the GPU-node setting. RLIMITs enforce."""
    # pytest's tmp_path sits under a 0700 directory uid 1000 cannot enter.
    tmp_path = Path(tempfile.mkdtemp(prefix="agentrl-unpriv-"))
    try:
        _run_unprivileged(tmp_path)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _run_unprivileged(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    # A hard-linked copy of the cached export is instant; exporting again costs seconds.
    rootfs = tmp_path / "rootfs"
    linked = subprocess.run(["cp", "-al", str(find_rootfs()), str(rootfs)], capture_output=True)
    if linked.returncode != 0:
        shutil.rmtree(rootfs, ignore_errors=True)
        export_rootfs(dest=rootfs)
    assert (rootfs / "usr" / "bin" / "prlimit").exists()
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, 1000, 1000)
    script = textwrap.dedent(
        """
        from agentrl.sandbox import Limits, open_sandbox
        with open_sandbox("bwrap", limits=Limits(pids=16, memory_mb=256, disk_mb=16)) as sb:
            print(sb.enforcement.pids, sb.enforcement.memory, sb.enforcement.disk, sep="|")
            assert sb.exec("id -u").stdout == "1000\\n"
            r = sb.exec("for i in $(seq 40); do sleep 3 & done; wait")
            print("fork-refused" if "fork" in r.stderr.lower() else "fork-allowed")
            r = sb.exec(["python3", "-c", "bytearray(400 << 20)"])
            print("mem-refused" if "MemoryError" in r.stderr else "mem-allowed")
            sb.write_file("x.txt", "hi")
            print(sb.exec("cat x.txt").stdout)
            r = sb.exec("for i in 1 2 3 4 5 6; do head -c 4000000 /dev/zero > f$i; done")
            print("disk-capped" if "No space left" in r.stderr else r)
        """
    )
    env = {
        "PATH": os.environ["PATH"],
        ROOTFS_ENV: str(rootfs),
        "HOME": str(home),
        "TMPDIR": str(home),
        "DOCKER_HOST": "unix:///nonexistent.sock",
    }
    r = subprocess.run(
        ["setpriv", "--reuid", "1000", "--regid", "1000", "--clear-groups", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == (
        "RLIMIT_NPROC (per bwrap: the agent's commands together)|RLIMIT_AS (per process)|"
        "tmpfs size cap (workspace and /tmp)"
    )
    assert lines[1:5] == ["fork-refused", "mem-refused", "hi", "disk-capped"]
