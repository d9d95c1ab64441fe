"""agentrl.core.runlog: the demo's quiet console (output redirected to a log, stage lines with an ETA)."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

from agentrl.core.runlog import Stage, eta, fmt_duration

ROOT = Path(__file__).resolve().parents[2]


def run_script(body: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """`body` in a fresh interpreter (its descriptors 1 and 2 are pipes we can read)."""
    script = "import os, subprocess, sys\nfrom pathlib import Path\nfrom agentrl.core.runlog import console_to_file\n"
    return subprocess.run(
        [sys.executable, "-c", script + textwrap.dedent(body)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **env},
    )


def test_library_and_child_output_goes_to_the_log_and_only_the_console_stream_reaches_the_terminal(tmp_path):
    proc = run_script(
        """
        with console_to_file(Path("run/demo.log")) as console:
            print("stage line", file=console)
            print("a library's print")
            os.write(2, b"a C++ warning\\n")
            subprocess.run([sys.executable, "-c", "import sys; print('child out'); print('child err', file=sys.stderr)"])
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert (proc.stdout, proc.stderr) == ("stage line\n", "")
    log = (tmp_path / "run/demo.log").read_text()
    for line in ("a library's print", "a C++ warning", "child out", "child err"):
        assert line in log


def test_the_console_is_restored_after_an_exception(tmp_path):
    proc = run_script(
        """
        try:
            with console_to_file(Path("demo.log")):
                raise ValueError("boom")
        except ValueError:
            pass
        print("after")
        print("error line", file=sys.stderr)
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert (proc.stdout, proc.stderr) == ("after\n", "error line\n")


def test_debug_mode_leaves_everything_on_the_console(tmp_path):
    proc = run_script(
        """
        with console_to_file(Path("demo.log")) as console:
            print("stage line", file=console)
            print("a library's print")
        """,
        tmp_path,
        AGENTRL_DEBUG="1",
    )
    assert proc.stdout == "stage line\na library's print\n"
    assert not (tmp_path / "demo.log").exists()


def test_fmt_duration():
    assert [fmt_duration(s) for s in (0, 9.4, 60, 75, 3599, 3725)] == [
        "0s",
        "9s",
        "1m00s",
        "1m15s",
        "59m59s",
        "1h02m",
    ]


def test_eta_is_the_pace_so_far():
    assert eta(60.0, 1, 4) == 180.0  # 1 of 4 steps in 60 s: 3 more at 60 s each
    assert eta(60.0, 0, 4) is None  # nothing done: no pace yet
    assert eta(60.0, 4, 4) == 0.0


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def stage(progress, clock: FakeClock, heartbeat: float = 60.0) -> tuple[Stage, io.StringIO]:
    out = io.StringIO()
    return Stage(out, "2/3 GRPO", progress, heartbeat=heartbeat, clock=clock), out


def test_stage_line_counts_elapsed_and_eta():
    clock = FakeClock()
    s, _ = stage(lambda: (1, 4, "step"), clock)
    clock.t += 60
    assert s.line() == "[demo] 2/3 GRPO: step 1/4, 1m00s, ETA 3m00s"


def test_a_stage_that_cannot_be_counted_shows_its_latest_milestone():
    clock = FakeClock()
    s, _ = stage(lambda: (0, 0, "main: 40 SFT steps"), clock)
    clock.t += 5
    assert s.line() == "[demo] 2/3 GRPO: main: 40 SFT steps, 5s"


def test_a_failing_progress_reader_shows_elapsed_only():
    clock = FakeClock()

    def broken() -> tuple[int, int, str]:
        raise FileNotFoundError("metrics.jsonl")

    s, _ = stage(broken, clock)
    assert s.line() == "[demo] 2/3 GRPO: 0s"


def test_stage_prints_when_progress_moves_or_the_heartbeat_is_due():
    clock = FakeClock()
    state = [0]
    s, out = stage(lambda: (state[0], 4, "step"), clock, heartbeat=60)
    s.tick()  # first: printed
    clock.t += 10
    s.tick()  # nothing moved, heartbeat not due: quiet
    state[0] = 1
    clock.t += 10
    s.tick()  # moved: printed
    clock.t += 61
    s.tick()  # heartbeat
    assert out.getvalue().splitlines() == [
        "[demo] 2/3 GRPO: step 0/4, 0s",
        "[demo] 2/3 GRPO: step 1/4, 20s, ETA 1m00s",
        "[demo] 2/3 GRPO: step 1/4, 1m21s, ETA 4m03s",
    ]


def test_stage_as_context_prints_a_first_and_a_last_line():
    clock = FakeClock()
    out = io.StringIO()
    done = [0]
    with Stage(out, "3/3 evaluation", lambda: (done[0], 8, "episode"), poll=3600, clock=clock):
        clock.t += 42
        done[0] = 8  # finished between two polls: the last count is still shown
    assert out.getvalue().splitlines() == [
        "[demo] 3/3 evaluation: episode 0/8, 0s",
        "[demo] 3/3 evaluation: episode 8/8, 42s, ETA 0s",
        "[demo] 3/3 evaluation: done in 42s",
    ]
