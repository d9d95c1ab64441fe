"""The hidden-tests result stream and its runner, without a sandbox.

`read_stream` is a pure function: hand-made streams, one rule each. The runner
(`verifiers/pytest_runner.py`) is run here as a plain subprocess on the host's own Python and
pytest (the sandbox runs the image's), over a tiny workspace and hidden tests in temporary
directories: each tampering trick is played inside the test process and must leave a `tamper`
record (or, for bytecode, simply not run).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agentrl.verifiers.hidden_tests import (
    ExecResult,
    HiddenTestsRun,
    Stream,
    judge,
    read_stream,
    runner_input,
    sign,
)

KEY = b"k" * 32


def stream(*records: tuple, key: bytes = KEY) -> str:
    """A signed stream: each record is (kind, *fields), numbered from 0."""
    lines = []
    for i, (kind, *fields) in enumerate(records):
        body = "\t".join([str(i), kind, *map(repr, fields)])
        lines.append(f"{sign(key, body)}\t{body}\n")
    return "".join(lines)


A, B = "test_m.py::test_a", "test_m.py::test_b"
CLEAN = [
    ("start", 1),
    ("collected", [A, B]),
    ("report", A, "call", "passed", ""),
    ("report", B, "call", "failed", "boom"),
    ("end", 1),
]


# --- read_stream: one rule each ---------------------------------------------------------------


def test_a_clean_stream_gives_outcomes_per_test():
    s = read_stream(stream(*CLEAN), KEY)
    assert not s.tampered and s.end == 1 and s.collected == [A, B]
    assert {k: (v.outcome, v.message) for k, v in s.outcomes.items()} == {
        A: ("passed", ""),
        B: ("failed", "boom"),
    }


def test_phases_merge_as_junit_counts_them():
    rows = [
        ("start", 1),
        ("collected", ["t::setup_err", "t::teardown_err", "t::xfail", "t::xpass", "t::skip"]),
        ("report", "t::setup_err", "setup", "failed", "fixture"),
        ("report", "t::teardown_err", "call", "passed", ""),
        ("report", "t::teardown_err", "teardown", "failed", "cleanup"),
        ("report", "t::xfail", "call", "xfailed", ""),
        ("report", "t::xpass", "call", "xpassed", ""),
        ("report", "t::skip", "setup", "skipped", ""),
        ("end", 1),
    ]
    outcomes = {k: v.outcome for k, v in read_stream(stream(*rows), KEY).outcomes.items()}
    assert outcomes == {
        "t::setup_err": "error",
        "t::teardown_err": "error",
        "t::xfail": "skipped",
        "t::xpass": "passed",
        "t::skip": "skipped",
    }


def test_a_test_whose_call_never_came_is_an_error():
    rows = [("start", 1), ("collected", [A]), ("report", A, "setup", "passed", ""), ("end", 1)]
    assert read_stream(stream(*rows), KEY).outcomes[A].outcome == "error"


def test_a_line_not_signed_with_the_key_is_tampering():
    forged = stream(*CLEAN[:3]) + stream(("report", B, "call", "passed", ""), key=b"x" * 32).replace(
        "0\t", "3\t", 1
    )
    assert "bad signature" in read_stream(forged, KEY).tampered[0]


def test_records_out_of_sequence_are_tampering():
    text = stream(*CLEAN)
    lines = text.splitlines(keepends=True)
    swapped = "".join([lines[0], lines[2], lines[1], *lines[3:]])
    assert "out of sequence" in read_stream(swapped, KEY).tampered[0]


def test_a_second_result_for_the_same_phase_is_forged_and_the_first_stands():
    rows = [*CLEAN[:4], ("report", B, "call", "passed", ""), ("end", 1)]
    assert "a second result for test_m.py::test_b (call)" in read_stream(stream(*rows), KEY).tampered[0]


def test_anything_after_end_is_tampering():
    rows = [*CLEAN, ("report", B, "teardown", "passed", "")]
    assert "came after `end`" in read_stream(stream(*rows), KEY).tampered[0]


def test_a_result_for_a_test_never_collected_is_made_up():
    rows = [*CLEAN[:4], ("report", "test_m.py::test_made_up", "call", "failed", ""), ("end", 1)]
    assert "never collected (made up)" in read_stream(stream(*rows), KEY).tampered[0]


def test_collected_tests_outside_the_tasks_list_are_rejected():
    s = read_stream(stream(*CLEAN), KEY, expected=[A])
    assert "tests the task does not list were collected" in s.tampered[0]
    # A listed function id covers its parametrized variants.
    rows = [("start", 1), ("collected", ["t.py::f[1]", "t.py::f[2]"]), ("end", 0)]
    assert not read_stream(stream(*rows), KEY, expected=["t.py::f"]).tampered


def test_a_results_record_before_collection_and_a_second_start_are_tampering():
    assert (
        "before the tests were collected"
        in read_stream(stream(("start", 1), ("report", A, "call", "passed", "")), KEY).tampered[0]
    )
    assert "second `start`" in read_stream(stream(("start", 1), ("start", 2)), KEY).tampered[0]
    assert "does not open with `start`" in read_stream(stream(("collected", [A])), KEY).tampered[0]


def test_malformed_records_are_tampering():
    assert "malformed" in read_stream(stream(("start", 1), ("end", "zero")), KEY).tampered[0]
    assert "malformed" in read_stream(stream(("start", 1), ("nonsense", 1)), KEY).tampered[0]


def test_a_runner_tamper_record_is_kept():
    rows = [*CLEAN[:2], ("tamper", "audit event ctypes.cdata from x.py:3"), *CLEAN[2:]]
    assert read_stream(stream(*rows), KEY).tampered == ["audit event ctypes.cdata from x.py:3"]


def test_a_stream_cut_at_its_cap_is_marked_not_trusted():
    text = stream(*CLEAN)[:-20] + "\n[agentrl: output truncated, 123 bytes dropped]"
    s = read_stream(text, KEY)
    assert s.cut and s.end is None and not s.tampered


def test_a_last_line_without_newline_is_tampering():
    assert "cut short" in read_stream(stream(*CLEAN).rstrip("\n"), KEY).tampered[0]


# --- judge: the verdict of a checked stream ---------------------------------------------------


def run_of(text: str, exit_code: int, *, timed_out: bool = False) -> HiddenTestsRun:
    res = ExecResult(exit_code, text, "", timed_out, 0.1, False)
    return HiddenTestsRun(read_stream(text, KEY), res, "", None)


def test_judge_scores_a_clean_run():
    v = judge(run_of(stream(*CLEAN), 1), fail_to_pass=[B], pass_to_pass=[A])
    assert (v.reward, v.passed) == (0.0, False) and "1/2 of the FAIL_TO_PASS + PASS_TO_PASS" in v.details
    good = [*CLEAN[:3], ("report", B, "call", "passed", ""), ("end", 0)]
    assert judge(run_of(stream(*good), 0)).reward == 1.0


def test_judge_process_exit_status_must_equal_pytests():
    good = [*CLEAN[:3], ("report", B, "call", "passed", ""), ("end", 1)]
    assert "contradicts pytest's exit status" in judge(run_of(stream(*good), 0)).details


def test_judge_results_must_agree_with_the_exit_status():
    lying = [*CLEAN[:4], ("end", 0)]
    assert "contradict pytest's exit status 0" in judge(run_of(stream(*lying), 0)).details


def test_judge_no_end_means_the_process_was_cut_short():
    v = judge(run_of(stream(*CLEAN[:3]), 0))
    assert v.reward == 0.0 and "pytest never finished" in v.details


def test_judge_timeout_and_collection_errors_score_zero():
    assert "timed out" in judge(run_of(stream(*CLEAN), -9, timed_out=True), timeout_s=3).details
    rows = [("start", 1), ("collect_error", "test_m.py", "ImportError: no"), ("end", 2)]
    assert "collection error in the hidden tests" in judge(run_of(stream(*rows), 2)).details


def test_stream_report_is_what_score_reads():
    s = Stream(outcomes={})
    assert s.report().tests == {}


# --- the runner itself, on the host's Python -------------------------------------------------

TESTS = """
from mathlib import add


def test_add():
    assert add(2, 3) == 5


def test_zero():
    assert add(0, 0) == 0
"""
BUGGY = "def add(a, b):\n    return a - b\n"


def run_runner(tmp_path: Path, module: str, tests: str = TESTS, *, prepare=None):
    """Run the runner over a workspace holding `module` as mathlib.py; return (stream, stderr)."""
    ws, hidden = tmp_path / "ws", tmp_path / "hidden"
    ws.mkdir()
    hidden.mkdir()
    (ws / "mathlib.py").write_text(module)
    if prepare is not None:
        prepare(ws)
    (hidden / "test_m.py").write_text(textwrap.dedent(tests))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    scratch = tmp_path / "scratch"
    config = {
        "scratch": str(scratch),
        "tests_dir": str(hidden),
        "import_paths": [str(ws)],
        "message_chars": 500,
        "args": [
            "-c",
            str(tmp_path / "pytest.ini"),
            f"--rootdir={hidden}",
            "-p",
            "no:cacheprovider",
            "-q",
            str(hidden),
        ],
        "env": {"PATH": os.environ["PATH"], "HOME": str(scratch), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
    }
    key = secrets.token_bytes(32)
    argv, stdin = runner_input(config, key, sys.executable)
    proc = subprocess.run(
        argv,
        input=stdin,
        capture_output=True,
        timeout=120,
    )
    text = proc.stdout.decode()
    s = read_stream(text, key)
    return s, proc.returncode, proc.stderr.decode(errors="replace")


def test_runner_clean_run_streams_every_test(tmp_path):
    s, code, err = run_runner(tmp_path, BUGGY)
    assert not s.tampered, (s.tampered, err[-2000:])
    assert s.end == code == 1
    assert {k: v.outcome for k, v in s.outcomes.items()} == {
        "test_m.py::test_add": "failed",
        "test_m.py::test_zero": "passed",
    }


def test_runner_doctest_is_not_tampering(tmp_path):
    tests = (
        TESTS
        + '\n\ndef test_doctest():\n    import doctest\n\n    def f():\n        """\n        >>> 1 + 1\n        2\n        """\n\n    assert doctest.run_docstring_examples(f, {}) is None\n'
    )
    s, _, err = run_runner(tmp_path, "def add(a, b):\n    return a + b\n", tests)
    assert not s.tampered and s.end == 0, (s.tampered, err[-2000:])


@pytest.mark.parametrize(
    ("name", "payload", "reason"),
    [
        (
            "class patch at import",
            "import _pytest.reports as r\n_o = r.TestReport.from_item_and_call.__func__\n"
            "def _p(cls, item, call):\n    rep = _o(cls, item, call)\n    rep.outcome = 'passed'\n    return rep\n"
            "r.TestReport.from_item_and_call = classmethod(_p)\n",
            "from_item_and_call",
        ),
        (
            "module attribute patch",
            "import _pytest.runner as rn\n_o = rn.call_and_report\n"
            "def _c(item, when, log=True, **kw):\n    rep = _o(item, when, False, **kw)\n    rep.outcome = 'passed'\n"
            "    if log:\n        item.ihook.pytest_runtest_logreport(report=rep)\n    return rep\n"
            "rn.call_and_report = _c\n",
            "_pytest.runner.call_and_report was replaced",
        ),
        (
            "plugin registered through the frames",
            "import sys, pytest\nclass P:\n    @pytest.hookimpl(hookwrapper=True)\n"
            "    def pytest_runtest_makereport(self, item, call):\n        o = yield\n        o.get_result().outcome = 'passed'\n"
            "f = sys._getframe()\nwhile f is not None:\n    c = next((getattr(v, 'config', None) for v in f.f_locals.values() "
            "if hasattr(getattr(v, 'config', None), 'pluginmanager')), None)\n    if c is not None:\n"
            "        c.pluginmanager.register(P(), 'p')\n        break\n    f = f.f_back\n",
            "a pytest plugin from outside pytest",
        ),
        (
            "builtin shadowed in a pytest module",
            "import _pytest.runner as rn\nrn.isinstance = lambda *a: True\n",
            "_pytest.runner.isinstance was added",
        ),
        ("gc walk", "import gc\ngc.get_objects()\n", "gc.get_objects"),
        ("ctypes memory", "import ctypes\nctypes.c_int.from_address(id(1))\n", "ctypes.cdata"),
        ("trace function left running", "import sys\nsys.settrace(lambda *a: None)\n", "sys.settrace"),
    ],
)
def test_runner_flags_tampering_in_the_test_process(tmp_path, name, payload, reason):
    s, _, err = run_runner(tmp_path, payload + BUGGY)
    assert any(reason in t for t in s.tampered), (name, s.tampered, err[-1500:])


def test_runner_flags_a_hidden_tests_code_swapped(tmp_path):
    # From the package, at import: wait for the test module to be defined, then blank its test.
    payload = (
        "import sys, threading, time\n"
        "def _swap():\n"
        "    for _ in range(500):\n"
        "        m = sys.modules.get('test_m')\n"
        "        if m is not None and hasattr(m, 'test_add'):\n"
        "            m.test_add.__code__ = (lambda: None).__code__\n"
        "            return\n"
        "        time.sleep(0.002)\n"
        "threading.Thread(target=_swap, daemon=True).start()\n"
    )
    s, _, err = run_runner(tmp_path, payload + BUGGY)
    assert any("__code__" in t and "hidden test" in t for t in s.tampered), (s.tampered, err[-1500:])


@pytest.mark.parametrize("unchecked", [False, True], ids=["timestamp-pyc", "unchecked-hash-pyc"])
def test_runner_never_loads_workspace_bytecode(tmp_path, unchecked):
    """A planted .pyc whose header matches the source (the planted-pyc attack), and an unchecked
    hash-based one: live for a plain import, never loaded by the runner."""
    import importlib.util
    import marshal

    def plant(ws: Path) -> None:
        src = ws / "mathlib.py"
        code = compile("def add(a, b):\n    return a + b\n", str(src), "exec")
        if unchecked:
            header = (
                importlib.util.MAGIC_NUMBER
                + (1).to_bytes(4, "little")
                + importlib.util.source_hash(src.read_bytes())
            )
        else:
            st = src.stat()
            header = (
                importlib.util.MAGIC_NUMBER
                + (0).to_bytes(4, "little")
                + (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
                + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little")
            )
        pyc = Path(importlib.util.cache_from_source(str(src)))
        pyc.parent.mkdir()
        pyc.write_bytes(header + marshal.dumps(code))
        plain = subprocess.run(
            [sys.executable, "-B", "-c", "import mathlib; print(mathlib.add(2, 3))"],
            cwd=ws,
            capture_output=True,
            text=True,
        )
        assert plain.stdout.strip() == "5", plain  # the bytecode is live for a plain import

    s, _, err = run_runner(tmp_path, BUGGY, prepare=plant)
    assert not s.tampered and s.outcomes["test_m.py::test_add"].outcome == "failed", (s.outcomes, err[-1500:])


def test_runner_forged_records_after_the_end_are_rejected(tmp_path):
    payload = (
        "import atexit, os\n"
        "def _f():\n"
        "    for fd in range(1, 20):\n"
        "        try:\n"
        "            os.write(fd, b\"0\\t9\\treport\\t'test_m.py::test_add'\\t'call'\\t'passed'\\t''\\n\")\n"
        "        except OSError:\n"
        "            pass\n"
        "    os._exit(0)\n"
        "atexit.register(_f)\n"
    )
    s, code, _ = run_runner(tmp_path, payload + BUGGY)
    assert s.tampered and code == 0
