"""The `docker` backend: the sandbox protocol against a real Docker engine."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import docker
import pytest

from agentrl.sandbox import (
    PROTECTED_DIR,
    Limits,
    Sandbox,
    SandboxDead,
    SandboxError,
    SandboxPathError,
    open_sandbox,
)
from agentrl.sandbox.docker import DockerSandbox

pytestmark = pytest.mark.docker

LIMITS = Limits(memory_mb=256, pids=64, disk_mb=32, exec_timeout_s=20, output_limit_bytes=1000)


@pytest.fixture
def sb():
    with open_sandbox(
        "docker", limits=LIMITS, env={"FROM_OPEN": "yes"}, labels={"agentrl.env_id": "test/Env-v0"}
    ) as box:
        yield box


def container(box: DockerSandbox):
    return docker.from_env().containers.get(box.id)


def test_satisfies_protocol(sb):
    assert isinstance(sb, Sandbox) and isinstance(sb, DockerSandbox)
    assert sb.backend == "docker" and sb.workdir == "/workspace" and sb.limits == LIMITS
    assert sb.alive()


def test_runs_as_agent_in_workspace(sb):
    r = sb.exec("id -u; id -g; pwd; echo $HOME")
    assert r.ok and r.stdout.split() == ["1000", "1000", "/workspace", "/workspace"], r


def test_string_runs_in_shell_list_does_not(sb):
    assert sb.exec("echo $((6 * 7))").stdout == "42\n"
    assert sb.exec(["echo", "$((6 * 7))", "a  b"]).stdout == "$((6 * 7)) a  b\n"


def test_exit_codes_and_stderr(sb):
    r = sb.exec("echo out; echo err >&2; exit 7")
    assert (r.exit_code, r.stdout, r.stderr, r.ok, r.timed_out, r.truncated) == (
        7,
        "out\n",
        "err\n",
        False,
        False,
        False,
    )
    assert sb.exec(["false"]).exit_code == 1
    assert sb.exec(["true"]).ok
    missing = sb.exec(["no-such-program"])
    assert missing.exit_code == 127 and not missing.ok
    assert missing.stdout == "" and "no-such-program" in missing.stderr
    assert sb.exec("no-such-program").exit_code == 127  # the shell's own convention agrees


def test_killed_by_signal_is_negative(sb):
    assert sb.exec(["sh", "-c", "kill -TERM $$"]).exit_code == -15
    assert sb.exec(["python3", "-c", "import os; os.kill(os.getpid(), 9)"]).exit_code == -9


def test_stdin_str_and_bytes(sb):
    assert sb.exec(["cat"], stdin="héllo").stdout == "héllo"
    assert sb.exec(["wc", "-c"], stdin=b"\x00\x01\x02").stdout.strip() == "3"


def test_large_stdin_while_command_prints(sb):
    # 4 MiB in while `cat` echoes it back: writing and reading must interleave or both block.
    payload = b"y" * (4 << 20)
    r = sb.exec(["sh", "-c", "cat | wc -c; cat /dev/null"], stdin=payload)
    assert r.stdout.strip() == str(len(payload))
    r = sb.exec(["cat"], stdin=payload)
    assert r.truncated and r.stdout.startswith("y" * 1000)


def test_stdin_ignored_by_command_does_not_hang(sb):
    r = sb.exec(["true"], stdin=b"z" * (8 << 20), timeout=10)
    assert r.ok and not r.timed_out


def test_env_from_open_and_from_exec(sb):
    r = sb.exec("echo $FROM_OPEN $FROM_EXEC", env={"FROM_EXEC": "also"})
    assert r.stdout == "yes also\n"


def test_output_truncation_marker_counts_dropped_bytes(sb):
    # `seq 1 10000` prints 9*2 + 90*3 + 900*4 + 9000*5 + 6 = 48894 bytes; 1000 are kept.
    r = sb.exec(["seq", "1", "10000"])
    assert r.truncated and r.exit_code == 0
    kept, note = r.stdout[:1000], r.stdout[1000:]
    assert kept == "".join(f"{i}\n" for i in range(1, 10001))[:1000]
    assert note == "\n[agentrl: output truncated, 47894 bytes dropped]"
    assert r.stderr == ""


def test_timeout_reports_killed(sb):
    t0 = time.monotonic()
    r = sb.exec(["sleep", "30"], timeout=1)
    assert r.timed_out and r.exit_code == -9 and not r.ok
    assert 1 <= r.duration_s < 10 and time.monotonic() - t0 < 10


def test_default_timeout_comes_from_limits():
    with open_sandbox("docker", limits=Limits(exec_timeout_s=1)) as box:
        r = box.exec("sleep 30")
        assert r.timed_out and r.duration_s < 10


def test_write_and_read_files(sb):
    sb.write_file("a/b/c.txt", "hello")
    assert sb.read_file("a/b/c.txt") == b"hello"
    assert sb.read_file("/workspace/a/b/c.txt") == b"hello"
    blob = bytes(range(256)) * 1000
    sb.write_file("/tmp/blob.bin", blob)
    assert sb.read_file("/tmp/blob.bin") == blob  # not capped: files are not command output
    assert sb.exec("stat -c '%U %a' a/b/c.txt").stdout == "agent 644\n"


def test_write_file_mode_makes_scripts_runnable(sb):
    sb.write_file("run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
    assert sb.exec("./run.sh").stdout == "ran\n"


def test_write_file_replaces_existing(sb):
    sb.write_file("f.txt", "one")
    sb.write_file("f.txt", "two")
    assert sb.read_file("f.txt") == b"two"


def test_read_missing_and_directory(sb):
    with pytest.raises(FileNotFoundError):
        sb.read_file("nope.txt")
    with pytest.raises(IsADirectoryError):
        sb.read_file("/workspace")


def test_copy_in_file_and_tree(sb, tmp_path):
    (tmp_path / "one.txt").write_text("1")
    tree = tmp_path / "pkg"
    (tree / "sub").mkdir(parents=True)
    (tree / "__init__.py").write_text("")
    (tree / "sub" / "mod.py").write_text("X = 3\n")
    (tree / "tool.sh").write_text("#!/bin/sh\necho tool\n")
    (tree / "tool.sh").chmod(0o755)
    sb.copy_in(tmp_path / "one.txt", "copied/one.txt")
    sb.copy_in(tree, "pkg")
    assert sb.read_file("copied/one.txt") == b"1"
    assert sb.exec(["python3", "-c", "from pkg.sub.mod import X; print(X)"]).stdout == "3\n"
    assert sb.exec("pkg/tool.sh").stdout == "tool\n"
    assert sb.exec("stat -c %U pkg/sub/mod.py").stdout == "agent\n"
    with pytest.raises(FileNotFoundError):
        sb.copy_in(tmp_path / "missing", "x")


def test_privileged_writes_verifier_dir_agent_cannot(sb, tmp_path):
    sb.write_file(f"{PROTECTED_DIR}/test_hidden.py", "def test_x(): pass\n", privileged=True)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_more.py").write_text("def test_y(): pass\n")
    sb.copy_in(tmp_path / "tests", f"{PROTECTED_DIR}/tests", privileged=True)
    assert sb.exec(f"stat -c '%U %a' {PROTECTED_DIR}/test_hidden.py").stdout == "root 644\n"
    # The agent can read the hidden tests once they are there, but change nothing.
    assert sb.read_file(f"{PROTECTED_DIR}/tests/test_more.py") == b"def test_y(): pass\n"
    for attack in (
        f"echo x >> {PROTECTED_DIR}/test_hidden.py",
        f"rm -f {PROTECTED_DIR}/test_hidden.py",
        f"touch {PROTECTED_DIR}/conftest.py",
        f"chmod 777 {PROTECTED_DIR}",
    ):
        assert sb.exec(attack).exit_code != 0, attack
    with pytest.raises(PermissionError, match="privileged=True"):
        sb.write_file(f"{PROTECTED_DIR}/conftest.py", "import os")
    r = sb.exec(f"cd {PROTECTED_DIR} && python3 -m pytest -q -p no:cacheprovider", privileged=True)
    assert r.ok and "2 passed" in r.stdout, r


def test_read_file_never_reads_for_the_agent_as_root(sb):
    sb.write_file(f"{PROTECTED_DIR}/secret.txt", "hidden", mode=0o600, privileged=True)
    assert sb.read_file(f"{PROTECTED_DIR}/secret.txt") == b"hidden"  # the verifier's own path
    assert sb.exec(f"ln -s {PROTECTED_DIR}/secret.txt link.txt").ok
    with pytest.raises(PermissionError):
        sb.read_file("link.txt")  # an agent-planted path is read as the agent


def test_root_read_never_follows_a_link_out_of_the_verifier_dir(sb):
    # Code run for the verifier could plant a link in /verifier; the read as root must not follow
    # it to what only root may read elsewhere.
    assert sb.exec(
        f"echo root-only > /tmp/private && chmod 600 /tmp/private && ln -s /tmp/private {PROTECTED_DIR}/report.xml",
        privileged=True,
    ).ok
    with pytest.raises(SandboxPathError, match="resolves outside /verifier"):
        sb.read_file(f"{PROTECTED_DIR}/report.xml")


def test_privileged_exec_is_root_without_capabilities(sb):
    r = sb.exec("id -u; grep CapEff /proc/self/status", privileged=True)
    uid, capeff = r.stdout.splitlines()
    assert uid == "0" and int(capeff.split()[1], 16) == 0


def test_labels_and_host_config(sb):
    c = container(sb)
    labels = c.labels
    assert labels["agentrl.env_id"] == "test/Env-v0"
    assert labels["agentrl.pid"] == str(os.getpid())
    assert labels["agentrl.host"] and labels["agentrl.run_id"] and labels["agentrl.pid_start"]
    assert labels["agentrl.created_at"].endswith("+00:00")
    hc = c.attrs["HostConfig"]
    assert hc["NetworkMode"] == "none"
    assert hc["ReadonlyRootfs"] is True
    assert hc["CapDrop"] == ["ALL"]
    assert "no-new-privileges" in hc["SecurityOpt"]
    assert hc["Memory"] == hc["MemorySwap"] == 256 << 20
    assert hc["PidsLimit"] == 64 and hc["NanoCpus"] == 10**9
    assert set(hc["Tmpfs"]) == {"/workspace", "/tmp", PROTECTED_DIR}


def test_network_limit_attaches_a_network():
    with open_sandbox("docker", limits=Limits(network=True)) as box:
        assert container(box).attrs["HostConfig"]["NetworkMode"] == "bridge"


def test_background_process_outlives_its_exec(sb):
    # Like a shell's `&`: an agent may start a server in one call and query it in the next.
    assert sb.exec("nohup sleep 888 >/dev/null 2>&1 &").ok
    assert "sleep 888" in sb.exec(["ps", "-eo", "args="]).stdout


def test_kill_agent_processes(sb):
    sb.exec("nohup sleep 777 >/dev/null 2>&1 & (setsid sleep 778 >/dev/null 2>&1 &)")
    sb.kill_agent_processes()
    procs = sb.exec(["ps", "-eo", "user=,args="]).stdout
    assert "sleep 77" not in procs
    assert sb.alive() and sb.exec("echo still here").stdout == "still here\n"


def test_close_is_idempotent_and_context_manager_closes():
    box = open_sandbox("docker", limits=LIMITS)
    with box as entered:
        assert entered is box
    assert not box.alive()
    box.close()
    box.close()
    with pytest.raises(docker.errors.NotFound):
        docker.from_env().containers.get(box.id)
    with pytest.raises(SandboxDead, match="closed"):
        box.exec("true")


def test_sandbox_dead_after_external_removal():
    box = open_sandbox("docker", limits=LIMITS)
    try:
        container(box).remove(force=True)
        assert not box.alive()
        with pytest.raises(SandboxDead, match="gone"):
            box.exec("echo hi")
        with pytest.raises(SandboxDead):
            box.read_file("x")
    finally:
        box.close()


def test_missing_image_says_how_to_build():
    with pytest.raises(SandboxError, match="agentrl sandbox build"):
        open_sandbox("docker", image="agentrl/no-such-image:never")


def test_unreachable_engine_says_how_to_start_it(tmp_path):
    code = (
        "from agentrl.sandbox import open_sandbox, SandboxError\n"
        "try:\n"
        "    open_sandbox('docker')\n"
        "except SandboxError as exc:\n"
        "    print('SandboxError:', exc)\n"
    )
    env = {**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "SandboxError: cannot reach the Docker engine" in out.stdout, out
    assert "make setup" in out.stdout


def test_bad_workdir_rejected():
    with pytest.raises(ValueError, match="inside /verifier"):
        open_sandbox("docker", workdir="/verifier/ws")
    with pytest.raises(ValueError, match="absolute"):
        open_sandbox("docker", workdir="relative")


def test_custom_workdir(tmp_path):
    with open_sandbox("docker", limits=LIMITS, workdir="/home/agent/work") as box:
        box.write_file("x.txt", "x")
        assert box.exec("pwd; cat x.txt").stdout == "/home/agent/work\nx"
