"""The host process runner of `local` and `bwrap` (`agentrl.sandbox.process`), on real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from agentrl.sandbox.process import kill_group, kill_marked, run_capped

ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}


def run(argv, *, timeout=10.0, output_limit=1000, kills=None, **kw):
    def kill_tree(proc: subprocess.Popen[bytes]) -> None:
        if kills is not None:
            kills.append(proc.pid)
        kill_group(proc)

    return run_capped(
        argv,
        cwd=None,
        env=ENV,
        stdin=None,
        timeout=timeout,
        output_limit=output_limit,
        kill_tree=kill_tree,
        **kw,
    )


def test_a_passed_fd_is_readable_by_the_child_and_no_other_is():
    fd = os.memfd_create("agentrl-test", 0)  # close-on-exec: only pass_fds lets it through
    try:
        os.write(fd, b"options")
        os.lseek(fd, 0, os.SEEK_SET)
        r = run(["cat", f"/proc/self/fd/{fd}"], pass_fds=(fd,))
        assert (r.exit_code, r.stdout) == (0, "options")
        assert run(["cat", f"/proc/self/fd/{fd}"]).exit_code != 0
    finally:
        os.close(fd)


def test_kill_tree_runs_on_the_deadline_only():
    kills: list[int] = []
    assert run(["true"], kills=kills).ok and kills == []
    r = run(["sleep", "30"], timeout=0.3, kills=kills)
    assert (r.exit_code, r.timed_out, len(kills)) == (-9, True, 1)


def test_the_group_kill_reaches_children_in_the_group():
    # The shell's child keeps the pipes open; killing the group ends both at the deadline.
    r = run(["/bin/sh", "-c", "sleep 30 & echo started; wait"], timeout=0.5)
    assert (r.stdout, r.timed_out) == ("started\n", True)


def test_kill_marked_finds_processes_by_their_environment_marker():
    marker = f"agentrl-test-{os.getpid()}"
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"],
        env={**ENV, "AGENTRL_TEST_MARK": marker},
        start_new_session=True,
    )
    try:
        # Until the child has exec'd, /proc shows the environment it forked with (without the marker).
        environ = Path(f"/proc/{proc.pid}/environ")
        deadline = time.monotonic() + 10
        while marker.encode() not in environ.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert kill_marked("AGENTRL_TEST_MARK", marker) == 1
        assert proc.wait(timeout=10) == -9
        assert kill_marked("AGENTRL_TEST_MARK", marker) == 0
    finally:
        kill_group(proc)
