"""The `local` backend: the sandbox protocol on plain subprocesses (no isolation, by design)."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import pytest

from agentrl.sandbox import Limits, Sandbox, SandboxDead, SandboxError, SandboxPathError, open_sandbox
from agentrl.sandbox.local import LocalSandbox


@pytest.fixture
def sb():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        box = open_sandbox("local", limits=Limits(exec_timeout_s=10, output_limit_bytes=1000))
    with box:
        yield box


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (its parent was killed and init has not reaped it yet).
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_satisfies_protocol(sb):
    assert isinstance(sb, Sandbox)
    assert sb.backend == "local" and sb.workdir == "/workspace" and sb.alive()


def test_warns_that_there_is_no_isolation():
    import agentrl.sandbox.local as local

    local._warned = False
    with pytest.warns(RuntimeWarning, match="NO isolation"):
        LocalSandbox().close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second sandbox in the same process says nothing
        LocalSandbox().close()


def test_exec_runs_in_workspace_and_files_round_trip(sb):
    sb.write_file("a/b.txt", "hello")
    assert sb.read_file("/workspace/a/b.txt") == b"hello"
    r = sb.exec("cat a/b.txt && echo && pwd")
    assert r.ok and r.stdout.startswith("hello")
    assert r.stdout.splitlines()[-1] == str(sb.host_workdir)
    sb.exec(["sh", "-c", "echo made > made.txt"])
    assert sb.read_file("made.txt") == b"made\n"


def test_exit_code_stderr_and_argv_list(sb):
    r = sb.exec(["python3", "-c", "import sys; sys.stderr.write('bad'); sys.exit(3)"])
    assert (r.exit_code, r.stderr, r.timed_out, r.ok) == (3, "bad", False, False)


def test_stdin_and_env(sb):
    r = sb.exec("cat; echo $FOO", stdin="piped\n", env={"FOO": "bar"})
    assert r.stdout == "piped\nbar\n"
    big = b"x" * 300_000  # more than a pipe buffer: stdin is written while output is read
    r = sb.exec(["python3", "-c", "import sys; print(len(sys.stdin.buffer.read()))"], stdin=big)
    assert r.stdout.strip() == "300000"


def test_sandbox_env_is_clean_and_set(sb):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        box = open_sandbox("local", env={"TASK": "t1"})
    with box:
        os.environ["AGENTRL_LEAK_CHECK"] = "1"
        try:
            r = box.exec("env")
        finally:
            del os.environ["AGENTRL_LEAK_CHECK"]
    assert "TASK=t1" in r.stdout and "AGENTRL_LEAK_CHECK" not in r.stdout


def test_output_capped_while_streaming(sb):
    start = time.monotonic()
    r = sb.exec("head -c 100000000 /dev/zero | tr '\\0' x; echo done >&2")
    assert r.exit_code == 0 and r.truncated
    assert r.stdout == "x" * 1000 + "\n[agentrl: output truncated, 99999000 bytes dropped]"
    assert r.stderr == "done\n"
    assert time.monotonic() - start < 10


def test_timeout_kills_tree_including_setsid_escapees(sb, tmp_path):
    pidfile = sb.host_workdir / "pids"
    r = sb.exec(
        "sleep 1000 & echo $! > pids; setsid sh -c 'echo $$ >> pids; sleep 1000' & sleep 1000",
        timeout=1,
    )
    assert r.timed_out and r.exit_code == -9 and not r.ok
    assert 0.9 < r.duration_s < 5
    pids = [int(p) for p in pidfile.read_text().split()]
    assert len(pids) == 2
    time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def test_background_job_does_not_hold_exec_and_is_killed_by_kill_agent_processes(sb):
    r = sb.exec("sleep 1000 & echo $!", timeout=5)
    assert r.ok and r.duration_s < 2
    pid = int(r.stdout)
    assert _alive(pid)
    sb.kill_agent_processes()
    time.sleep(0.1)
    assert not _alive(pid)


def test_protected_dir_needs_privilege(sb):
    with pytest.raises(SandboxPathError, match="privileged=True"):
        sb.write_file("/verifier/test_hidden.py", "x")
    sb.write_file("/verifier/test_hidden.py", "x", privileged=True)
    assert sb.read_file("/verifier/test_hidden.py") == b"x"
    assert (sb.host_protected / "test_hidden.py").read_text() == "x"


def test_copy_in_tree_keeps_modes_and_symlinks(sb, tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (tmp_path / "d" / "run.sh").chmod(0o755)
    (tmp_path / "d" / "sub" / "f.txt").write_text("f")
    (tmp_path / "d" / "link").symlink_to("sub/f.txt")
    sb.copy_in(tmp_path / "d", "proj")
    assert sb.exec("./proj/run.sh").stdout == "ran\n"
    assert sb.read_file("proj/link") == b"f"
    assert os.readlink(sb.host_workdir / "proj" / "link") == "sub/f.txt"


@pytest.mark.parametrize("path", ["../escape.txt", "/etc/passwd", "a/../../x", "/workspace/../etc/x"])
def test_paths_escaping_the_sandbox_are_refused(sb, path):
    with pytest.raises(SandboxPathError):
        sb.write_file(path, "x")
    with pytest.raises((SandboxPathError, FileNotFoundError)):
        sb.read_file(path)


def test_symlink_pointing_outside_is_refused(sb, tmp_path):
    outside = tmp_path / "secret"
    outside.write_text("secret")
    # Link targets are resolved in the sandbox's namespace: climbing out lands on the
    # sandbox's "/", which the local backend does not map, so the access is refused.
    (sb.host_workdir / "up").symlink_to("../../../../../../../../etc/passwd")
    (sb.host_workdir / "root").symlink_to("/")
    with pytest.raises(SandboxPathError):
        sb.read_file("up")
    with pytest.raises(SandboxPathError):
        sb.write_file("root/etc/pwned", "x")
    # An absolute host path means the sandbox's path of that name, never the host file.
    (sb.host_workdir / "abs").symlink_to(outside)
    with pytest.raises(FileNotFoundError):
        sb.read_file("abs")
    (sb.host_workdir / "absdir").symlink_to(tmp_path)
    sb.write_file("absdir/secret", "pwned")
    assert outside.read_text() == "secret"
    # A link that stays inside is followed.
    sb.write_file("real.txt", "ok")
    (sb.host_workdir / "inside").symlink_to("/workspace/real.txt")
    assert sb.read_file("inside") == b"ok"


def test_fifo_is_refused_instead_of_hanging(sb):
    os.mkfifo(sb.host_workdir / "fifo")
    with pytest.raises(SandboxPathError, match="regular file"):
        sb.read_file("fifo")
    with pytest.raises(SandboxPathError, match="regular file"):
        sb.write_file("fifo", "x")


def test_missing_file_is_file_not_found(sb):
    with pytest.raises(FileNotFoundError):
        sb.read_file("nope.txt")


def test_close_twice_removes_everything_and_then_refuses(sb):
    root = sb.host_workdir.parent
    sb.close()
    sb.close()
    assert not root.exists() and not sb.alive()
    with pytest.raises(SandboxDead):
        sb.exec("true")
    with pytest.raises(SandboxError):
        sb.write_file("x", "y")


def test_image_is_ignored_and_bad_cmd_is_a_clear_error(sb):
    with pytest.raises(ValueError, match="non-empty list"):
        sb.exec([])
    assert Path(sb.host_workdir).is_dir()
