"""Adversarial sandbox tests: one property each, the same attack against every isolating backend.

Each test plays an agent that tries to break out or break things (network egress, fork and
memory bombs, disk fill, output floods, processes that outlive their timeout, writes outside
the workspace, privilege escalation, state left for the next episode) and checks that the
sandbox contains it and that the host, and where promised the sandbox, still work.

Limits are small so the attacks hit them fast; the docker half runs in well under two
minutes on two cores.
"""

from __future__ import annotations

import textwrap
import time
import tracemalloc

import pytest

from agentrl.sandbox import (
    PROTECTED_DIR,
    FileTooLargeError,
    Limits,
    NotRegularFileError,
    SandboxDead,
    open_sandbox,
)
from tests import fixtures_net

loopback_listener = fixtures_net.loopback_listener

LIMITS = Limits(
    memory_mb=256,
    cpus=1.0,
    pids=64,
    disk_mb=32,
    exec_timeout_s=20,
    output_limit_bytes=64 * 1024,
)

BACKENDS = [
    pytest.param("docker", marks=pytest.mark.docker, id="docker"),
    pytest.param("bwrap", id="bwrap"),
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "bwrap":
        request.getfixturevalue("bwrap_path")  # fails loudly when bubblewrap is missing
    return request.param


@pytest.fixture
def sb(backend: str):
    with open_sandbox(backend, limits=LIMITS) as box:
        yield box


def py(code: str) -> list[str]:
    return ["python3", "-c", textwrap.dedent(code)]


def running_commands(box) -> list[str]:
    """Command lines of every live process in the sandbox (zombies show as `[name] <defunct>`),
    but the resident executor's (`python3 -I -S -c ...'agentrl-executor'...`)."""
    r = box.exec(["ps", "-eo", "args="])
    assert r.exit_code == 0, r
    return [line for line in r.stdout.splitlines() if "agentrl-executor" not in line]


def test_network_egress_refused(sb, loopback_listener):
    """A listener on this machine's loopback, which this process reaches, is out of the sandbox's reach
    (its loopback is its own); with no interface but that one (below), nothing else is in reach either."""
    assert loopback_listener.reachable_from_here()
    seen = len(loopback_listener.accepted)
    r = sb.exec(
        py(
            f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {loopback_listener.port}), timeout=3).close()
                print("CONNECTED")
            except OSError as exc:
                print("no connection:", exc)
            """
        ),
        timeout=15,
    )
    assert r.exit_code == 0, r
    assert "no connection" in r.stdout and "CONNECTED" not in r.stdout, r
    assert len(loopback_listener.accepted) == seen


def test_no_network_interface_but_loopback(sb):
    r = sb.exec(["cat", "/proc/net/dev"])
    interfaces = {line.split(":")[0].strip() for line in r.stdout.splitlines()[2:]}
    assert interfaces == {"lo"}, r.stdout


def test_fork_loop_stopped_by_pids_limit(sb):
    # Children sleep with their output closed, so the exec ends when the parent gives up.
    r = sb.exec(
        py(
            """
            import os, time
            n = 0
            try:
                while n < 10_000:
                    if os.fork() == 0:
                        os.closerange(0, 3)
                        time.sleep(60)
                        os._exit(0)
                    n += 1
            except OSError as exc:
                print("stopped after", n, "forks:", exc.strerror)
            """
        ),
        timeout=30,
    )
    assert "stopped after" in r.stdout, r
    forks = int(r.stdout.split()[2])
    assert 0 < forks < LIMITS.pids, r.stdout
    sb.kill_agent_processes()
    assert sb.exec("echo alive").stdout == "alive\n"


@pytest.mark.slow
def test_fork_bomb_killed_at_timeout_and_sandbox_answers(sb):
    # Every process forks forever and never exits: only the timeout's tree kill ends it.
    bomb = py(
        """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """
    )
    t0 = time.monotonic()
    r = sb.exec(bomb, timeout=2)
    assert r.timed_out and r.exit_code == -9, r
    assert time.monotonic() - t0 < 30
    after = sb.exec("echo alive")
    assert after.ok and after.stdout == "alive\n", after
    assert not [c for c in running_commands(sb) if c.startswith("python3")]


@pytest.mark.slow
def test_background_fork_bomb_cleared_by_kill_agent_processes(sb):
    # The classic bomb backgrounds itself, so the exec returns while it rages on.
    sb.exec(["bash", "-c", ":(){ :|:& };:"], timeout=3)
    sb.kill_agent_processes()
    after = sb.exec("echo alive")
    assert after.ok and after.stdout == "alive\n", after
    assert not [c for c in running_commands(sb) if c.startswith("bash")]


@pytest.mark.slow
def test_memory_bomb_killed_by_memory_limit(sb):
    tracemalloc.start()
    try:
        r = sb.exec(
            py(
                """
                blocks = []
                while True:
                    blocks.append(bytearray(16 << 20))  # touched: bytearray zero-fills
                    print(len(blocks) * 16, flush=True)
                """
            ),
            timeout=30,
        )
        _, host_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not r.timed_out, "the memory limit never stopped the bomb"
    assert r.exit_code != 0, r
    reached_mb = int(r.stdout.split()[-1]) if r.stdout.strip() else 0
    assert reached_mb <= LIMITS.memory_mb + 16, (
        f"allocated {reached_mb} MiB under a {LIMITS.memory_mb} MiB cap"
    )
    assert host_peak < 8 << 20, f"the host side held {host_peak} bytes"
    # Either the sandbox survived (the OOM killer took the bomb) or it says clearly it is dead.
    try:
        assert sb.exec("echo alive").stdout == "alive\n"
    except SandboxDead:
        assert not sb.alive()


@pytest.mark.parametrize("where", ["workspace", "/tmp"])
def test_disk_fill_stopped_at_cap(sb, where):
    target = "fill.bin" if where == "workspace" else "/tmp/fill.bin"
    r = sb.exec(f"dd if=/dev/zero of={target} bs=1M count={LIMITS.disk_mb * 4}", timeout=30)
    assert r.exit_code != 0 and "No space left" in r.stderr, r
    size = int(sb.exec(["stat", "-c", "%s", target]).stdout)
    assert size <= LIMITS.disk_mb << 20
    # The cap is per mount: freeing space makes it usable again.
    assert sb.exec(f"rm {target} && echo ok > small.txt && cat small.txt").stdout == "ok\n"


@pytest.mark.parametrize("path", ["/dev/zero", "/dev/urandom", "zero-link", "fifo", "/workspace/fifo-link"])
def test_read_file_refuses_devices_fifos_and_links_to_them(sb, path):
    assert sb.exec("ln -s /dev/zero zero-link; mkfifo fifo; ln -s /workspace/fifo fifo-link").ok
    tracemalloc.start()
    try:
        with pytest.raises(NotRegularFileError, match="not a regular file|devices"):
            sb.read_file(path)
        _, host_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert host_peak < 1 << 20  # refused before a byte was read (a FIFO is not waited on either)


def test_read_file_reads_at_most_its_limit(sb):
    assert sb.exec("head -c 20000000 /dev/urandom > big.bin").ok
    tracemalloc.start()
    try:
        with pytest.raises(FileTooLargeError, match="holds more than 1000000 bytes"):
            sb.read_file("big.bin", max_bytes=1_000_000)
        head = sb.read_file("big.bin", max_bytes=1_000_000, truncate=True)
        _, host_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(head) == 1_000_000 and head == sb.read_file("big.bin", max_bytes=20_000_000)[:1_000_000]
    assert host_peak < 8 << 20  # a 20 MB file; at most 1 MB + 1 byte of it read
    small = Limits(read_limit_bytes=10)
    assert small.read_limit_bytes == 10  # the default limit is a sandbox limit like the others


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_100mb_of_output_is_capped_while_streaming(sb, stream):
    redirect = "" if stream == "stdout" else " 1>&2"
    tracemalloc.start()
    try:
        r = sb.exec(f"head -c 100000000 /dev/zero | tr '\\0' x{redirect}", timeout=60)
        _, host_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    text = getattr(r, stream)
    assert r.exit_code == 0 and r.truncated, r
    assert text.startswith("x" * 1000)
    assert "output truncated" in text and "bytes dropped" in text
    assert len(text) <= LIMITS.output_limit_bytes + 200
    # Streamed, never buffered: the host never held more than a few caps' worth.
    assert host_peak < 16 << 20, f"the host side held {host_peak} bytes"


TREES = {
    "sleep": "sleep 4321",
    "background_child": "sleep 4321 & sleep 4321",
    "setsid_nohup_grandchild": "(setsid nohup sleep 4321 >/dev/null 2>&1 &); sleep 4321",
    "env_scrubbed_daemon": "(env -i setsid sleep 4321 </dev/null >/dev/null 2>&1 &); sleep 4321",
    "double_fork_python": "python3 -c 'import os,time\nif os.fork()==0:\n os.setsid()\n if os.fork()==0: time.sleep(4321)\n os._exit(0)\ntime.sleep(4321)'",
}


@pytest.mark.slow
@pytest.mark.parametrize("tree", list(TREES), ids=list(TREES))
def test_timeout_kills_whole_process_tree(sb, tree):
    t0 = time.monotonic()
    r = sb.exec(TREES[tree], timeout=1.5)
    elapsed = time.monotonic() - t0
    assert r.timed_out and r.exit_code == -9, r
    assert 1.5 <= elapsed < 15, elapsed
    survivors = [c for c in running_commands(sb) if "4321" in c and "defunct" not in c]
    assert survivors == [], f"outlived the timeout: {survivors}"


@pytest.mark.parametrize(
    "path", ["/pwned", "/etc/pwned", "/usr/pwned", "/usr/bin/python3", f"{PROTECTED_DIR}/pwned"]
)
def test_writes_outside_workspace_refused(sb, path):
    before = sb.exec(["sh", "-c", f"md5sum {path} 2>/dev/null || echo absent"]).stdout
    r = sb.exec(f"echo pwned > {path}")
    assert r.exit_code != 0, r
    with pytest.raises(OSError):
        sb.write_file(path, "pwned")
    after = sb.exec(["sh", "-c", f"md5sum {path} 2>/dev/null || echo absent"]).stdout
    assert after == before


def test_agent_is_unprivileged(sb):
    r = sb.exec("id -u; grep -E '^(NoNewPrivs|CapEff):' /proc/self/status")
    uid, *status = r.stdout.splitlines()
    assert uid != "0"
    fields = dict(line.split(":\t") for line in status)
    assert fields["NoNewPrivs"].strip() == "1"
    assert int(fields["CapEff"], 16) == 0


ESCALATIONS = {
    "su": "su -c 'id -u' root </dev/null",
    "setuid_copy": 'cp "$(command -v id)" ./id_copy && chmod 4755 ./id_copy && ./id_copy -u',
    "chmod_system_binary": 'chmod u+s "$(command -v id)" && "$(command -v id)" -u',
    "user_namespace": "unshare -r id -u",
    "setuid_syscall": "python3 -c 'import os; os.setuid(0); print(os.getuid())'",
    "mount": "mount -t tmpfs none /mnt && id -u",
}


@pytest.mark.parametrize("attempt", list(ESCALATIONS), ids=list(ESCALATIONS))
def test_privilege_escalation_refused(sb, attempt):
    r = sb.exec(ESCALATIONS[attempt], timeout=15)
    # Each attempt prints a uid only if it got that far; root's would be "0".
    assert "0" not in r.stdout.split(), r
    assert sb.exec("id -u").stdout.strip() != "0"


def test_files_do_not_leak_into_the_next_sandbox(backend, sb):
    sb.write_file("secret.txt", "episode 1")
    assert sb.exec("echo episode 1 > /tmp/secret.txt").ok
    sb.close()
    with open_sandbox(backend, limits=LIMITS) as fresh:
        r = fresh.exec("ls -A . /tmp; cat secret.txt /tmp/secret.txt")
        assert "secret" not in r.stdout, r
        with pytest.raises(FileNotFoundError):
            fresh.read_file("secret.txt")


# --- the verifier identity and what the sandbox shows (pristine symlinks, /proc leaks) -------------


def test_verifier_identity_reads_the_workspace_but_writes_neither_it_nor_verifier(sb):
    sb.write_file("mod.py", "X = 1\n")
    sb.write_file(f"{PROTECTED_DIR}/t/test_x.py", "def test_x(): pass\n", privileged=True)
    r = sb.exec(
        "cat mod.py; cat /verifier/t/test_x.py; touch /workspace/planted; touch /verifier/t/planted; "
        "mkdir /tmp/v-scratch && echo scratch-ok",
        as_verifier=True,
    )
    assert "X = 1" in r.stdout and "def test_x" in r.stdout and "scratch-ok" in r.stdout, r
    assert r.stderr.count("touch: cannot touch") == 2, r
    assert "planted" not in sb.exec("ls /workspace /verifier/t").stdout


def test_verifier_identity_writes_the_log_folder_a_verifier_prepared(sb):
    """Harbor's contract: the test script, as the verifier identity, writes its reward under /verifier/logs
    (made by a privileged exec, world-writable); the agent cannot overwrite what it wrote."""
    assert sb.exec(f"mkdir -p {PROTECTED_DIR}/logs && chmod 1777 {PROTECTED_DIR}/logs", privileged=True).ok
    reward = f"{PROTECTED_DIR}/logs/verifier/reward.txt"
    r = sb.exec(f"mkdir -p {PROTECTED_DIR}/logs/verifier && echo 1 > {reward}", as_verifier=True)
    assert r.ok, r
    assert not sb.exec(f"echo 0 > {reward}").ok
    assert sb.exec(f"cat {reward}", privileged=True).stdout.strip() == "1"


def test_root_only_image_paths_are_hidden_from_agent_and_verifier(sb):
    # /root is 0700 in the image: docker hides it by permissions, bwrap by a mount over it.
    for kwargs in ({}, {"as_verifier": True}):
        r = sb.exec("ls -A /root | wc -l; cat /etc/shadow 2>&1 | head -c 80", **kwargs)
        assert r.stdout.split("\n", 1)[0].strip() == "0" or "Permission denied" in r.stderr, (kwargs, r)
        assert "root:" not in r.stdout, (kwargs, r)
    privileged = sb.exec("head -c 5 /etc/shadow", privileged=True)
    assert privileged.stdout == "root:", privileged


def test_privileged_and_verifier_identity_are_exclusive(sb):
    with pytest.raises(ValueError, match="two different identities"):
        sb.exec("true", privileged=True, as_verifier=True)


def test_no_host_paths_or_sandbox_options_visible_in_proc(backend, sb):
    import os

    from agentrl.sandbox.bwrap import rootfs_cache_dir

    r = sb.exec(
        "for f in /proc/[0-9]*/cmdline /proc/[0-9]*/environ; do tr '\\0' ' ' < $f 2>/dev/null; echo; done"
    )
    seen = r.stdout
    host_only = [p for p in os.environ.get("PATH", "").split(":") if "/." in p or p.startswith("/root")]
    for marker in ["--setenv", "--ro-bind", "--bind", str(rootfs_cache_dir()), "agentrl-bwrap-", *host_only]:
        assert marker not in seen, (marker, seen[:2000])
