"""The `hidden-tests` verifier: run the task's hidden pytest suite after the episode, where the agent cannot reach it, and trust only what the agent's code cannot forge.

    ToolEnv(..., verifier=("hidden-tests", {"mode": "fraction", "timeout_s": 60}))

The difficulty: the hidden tests import the agent's code, so that code runs inside the test
run. Everything below follows from three rules: what runs the agent's code has no privilege
worth stealing; the verdict is decided outside the process that runs it; and inside that
process, tampering with the harness leaves traces the agent's code cannot erase.

Order of events, after the agent's last action:

1. The agent's processes are killed (`sandbox.kill_agent_processes()`): a daemon it left
   running (nohup, setsid, double fork) can neither rewrite files nor watch for the tests.
2. The hidden tests (`task.hidden_tests`, a host file or folder) are copied, privileged, into
   a fresh directory under `/verifier` (`PROTECTED_DIR`), with our pytest.ini. They exist
   nowhere in the sandbox before this moment, and never in the workspace.
3. pytest runs as the sandbox's *verifier identity* (`exec(as_verifier=True)`; docker: uid
   2000; bwrap: a mount view), never as root: it reads the workspace and the tests, writes
   neither (a fresh /tmp only), and cannot read the image's root-only files. A workspace
   package replaced by a symlink to the pristine source (`/opt/src/...`) leads to a
   permission error (docker) or an empty, masked directory (bwrap): no confused deputy.
4. The interpreter is the image's, by absolute path, isolated (`python3 -I -B -c BOOTSTRAP`).
   The runner (`pytest_runner.py`) arrives on stdin, followed by a fresh per-run MAC key and
   the run's settings: nothing of them is on disk, in an environment block, on a command line
   or in a module global, and the settings are dropped before pytest imports any test. It rebuilds the
   environment (system PATH, HOME/TMPDIR in its scratch dir, PYTEST_DISABLE_PLUGIN_AUTOLOAD,
   no PYTEST_ADDOPTS/PYTHONPATH), imports the system's pytest and all its plugins, snapshots
   the harness (below), and only then *appends* the workspace to `sys.path`.
5. pytest gets `-c <our ini>` and `--rootdir`/`--confcutdir` at the hidden tests (the
   workspace's `pytest.ini`, `pyproject.toml`, `setup.cfg`, `tox.ini` and `conftest.py` are
   never read), `-p no:cacheprovider`, and, when the task lists its tests as node ids
   (FAIL_TO_PASS + PASS_TO_PASS), exactly those ids; otherwise the whole hidden suite.
6. Results are *streamed*: the runner's reporter plugin writes one signed, numbered record per
   event to the command's stdout, which only this verifier (the host process, which never
   imports the agent's code) reads: `start`, collection errors, the collected node ids, each
   test phase's outcome as it happens, `end` with pytest's exit status. No report file exists
   anywhere the code under test could rewrite, or replace with a symlink to /dev/zero; the
   stream is capped (`max_report_mb`) while it is read.
7. `read_stream` checks the stream: every record well-formed, signed with this run's key and
   in sequence; exactly one start, one collected list, one end, nothing after the end; each
   (test, phase) reported once (the first result is the only result: a record added later,
   by atexit or after `os._exit`, is a duplicate); every reported test in the collected list,
   and every collected test one the task lists (a made-up test is rejected); no `tamper`
   record; pytest's exit status equal to the process's and in agreement with the outcomes.
   Any violation: reward 0, with the reason. Only then is the score computed.

Inside the test process (`pytest_runner.py` has the details):

- Guard snapshot, taken before the workspace is importable: the identity of every module,
  class and function of pytest, pluggy, unittest, of the runner itself, of builtins and of
  sys's functions. Re-checked after collection (when every test module, and so the agent's
  package, has been imported), at each test (the modules where outcomes are made; the runtest
  hooks' implementations; the test modules' globals) and at the end. Every registered plugin
  and hook implementation must come from pytest or the hidden tests, and every test's function
  must be code compiled from the hidden tests (through a decorator from a module loaded before
  the workspace, at most): a test module swapped for a copy compiled elsewhere is caught. A
  difference is a `tamper` record: "patch pytest's report objects at import" is caught here,
  whichever object was patched.
- An audit hook (`sys.addaudithook`: no code can remove it) writes a `tamper` record, or
  fails the operation if it cannot, on: attribute writes to the guarded classes and
  functions (including `__code__`/`__defaults__` swaps) and to the hidden tests' functions,
  ctypes memory access, `gc.get_objects`/`get_referrers`/`get_referents`,
  `sys._current_frames`, `sys.settrace`/`setprofile`, opening `/proc/*/mem`, a second code
  object compiled under a hidden test's file name, a function made from a test's code.
- Workspace imports are source-only: workspace directories get a finder whose only loader
  compiles the `.py` source every time. A planted `__pycache__/*.pyc` whose header matches
  the source (`planted-pyc` in the audit), an unchecked hash-based `.pyc`, a sourceless `.pyc` or an extension
  module (`.so`) in the workspace is never loaded. (`-B` only stops writing bytecode.)

How the older tricks are neutralised (tests/verifiers/test_hidden_tests.py has one attack each):

- `conftest.py` anywhere in the workspace or /tmp: outside the confcutdir and never collected.
- pytest plugins: entry points in a workspace `.dist-info`/`.egg-info` are not autoloaded
  (PYTEST_DISABLE_PLUGIN_AUTOLOAD); `-p` in a workspace ini's addopts is never read.
- `sitecustomize`/`usercustomize`/`.pth` files: executed only from site directories at
  interpreter start; `-I` drops the user site and the workspace is a plain `sys.path` entry.
- a workspace `pytest`, `_pytest`, `unittest` (or any name the system has): shadowed by the
  system's, because the workspace is last on `sys.path` and pytest is imported before it.
- PATH, PYTHONPATH, PYTEST_ADDOPTS set in `.bashrc`/`.profile`, a fake `python3` or `pytest`:
  no shell reads those files, the interpreter is an absolute path on the read-only root, and
  the environment is rebuilt from scratch.
- `sys.exit()` at import: a collection error, reward 0. `os._exit()` or a crash: no `end`
  record, reward 0. An `atexit` hook that writes results: records after `end`, reward 0.
- a fake report or fake results printed anywhere: only the signed stream counts.

Reward: `mode="all"` (default) gives 1 only when every considered test passed; `"fraction"`
gives the fraction that passed. Skipped and xfailed tests count as not passed (the agent's
code could call `pytest.skip`). Which tests are considered:

- SWE-bench style lists, when given: `fail_to_pass` and `pass_to_pass` (verifier kwargs), or
  else the task's `metadata["FAIL_TO_PASS"]` / `metadata["PASS_TO_PASS"]` (lower-case keys
  work too; a JSON-encoded list, as in the SWE-bench datasets, is accepted). Entries are
  pytest node ids relative to the hidden-tests root (`test_lib.py::test_add`,
  `test_lib.py::TestX::test_y[2]`), or a bare test name (`test_add`) that stands for every
  test of that name, parametrized variants included. A listed test absent from the results
  counts as failed. With node ids only, exactly the listed tests run; with a bare name, the
  whole suite runs and unlisted tests do not count.
- Otherwise every test the suite collects (at least one must run).

A timeout, a collection error, a pytest crash or an exit status that disagrees with the
results gives reward 0 with the reason in `details`.

Canary twins (`agentrl.verifiers.canaries`, on by default): before the tests are copied in, each
considered test gets a twin, a copy of its own source whose one top-level assertion contradicts
the test's, under a name drawn like the file's own and in a random order; which of the two is
real is known only here. On honest code a test and its twin never both pass, so a forger that
changes outcomes wholesale (whatever it patches: the hook executor, the reporter's emitter, the
runner's guard, the test modules, unittest) passes a pair and scores 0 as tampering. The verdict's
details say how many twins ran and which considered tests had none.

Twin sets (`agentrl.verifiers.twin_sets`), when the task lists FAIL_TO_PASS node ids: a forger
that tells a test from its twins by their code must still not be able to tell which one is real,
and a guess must not pay. So the FAIL_TO_PASS tests run first, in a process of their own, from a
folder that holds no other test: each failing test (each failing case of a parametrized one) is a
set of members differing in one value, drawn so that the real one is not special, none of them
keeping the test's name; the sets are sized so that guessing every set wins 1 in `odds` (32) at
most (where a draw falls short, for want of values, it is drawn again, up to `PLAN_TRIES` times;
a draw with no set at all, once more).
Two members passing is tampering. Only then, in a second process, the PASS_TO_PASS tests
(with canary twins) and any FAIL_TO_PASS test no set could cover. Both runs are checked as below;
their installed tests are removed at the end, so that a later verification of the same sandbox
finds nothing of this one.

Known limits (honest ones):

- The code under test still runs inside the pytest process; no in-process harness can be
  made unforgeable. The guard, the audit hook and the stream rules make forging require
  targeting this harness specifically (reaching its live objects through frames, changing
  instance state no snapshot covers, signing forged records with the reporter's own emitter);
  the canary twins make such forging score 0 unless it can tell each real test from its twin,
  which takes knowing the right answers. A considered test with no top-level assertion that
  can be contradicted (only `with pytest.raises(...)`, say) has no twin, and its outcome is
  protected by the in-process checks alone. The audited events and the snapshot are tuned on
  pytest 7-9 and these suites; a test suite that
  itself uses ctypes memory access, `gc.get_referrers` or `sys.settrace` (doctest's is
  allowed) scores 0 here.
- Until pytest's session starts, pytest configures itself (its legacypath plugin adds
  properties to its own classes): a change to the harness whose new value is itself harness
  code is taken into the snapshot then. Code of the agent's that runs that early (a hidden
  conftest that imports the package) could swap pytest's functions among themselves unseen;
  anything else it changes is caught.
- The image's interpreter must be Python 3.8 or newer (audit hooks).
- A workspace package that needs compiled extensions cannot load them from the workspace
  (source only): install them in the image.
- The verifier identity must be able to read the workspace: on docker, files the agent made
  unreadable to others (chmod 600) fail to import, which scores 0. It can write only what
  the agent made world-writable there (bwrap: nothing).
- Hidden tests run with a scratch directory as the working directory; a test that needs the
  workspace finds it in the `AGENTRL_WORKSPACE` environment variable (or imports from it). A
  module of the agent's that has the name of a standard or system module is not importable
  by the tests: pick task module names that do not collide.
- It needs a sandbox whose `capabilities` have `isolated`, `protected_dir` and
  `verifier_identity` (docker, bwrap); on any other (local) it refuses to run (reward 0, reason).
"""

from __future__ import annotations

import json
import logging
import random
import secrets
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from agentrl.core.episode import Episode
from agentrl.core.task import Task
from agentrl.sandbox.base import PROTECTED_DIR, ExecResult, Sandbox
from agentrl.verifiers.base import Verdict, capability_refusal
from agentrl.verifiers.canaries import CanaryPlan, plant_canaries
from agentrl.verifiers.result_stream import (
    RECORD_KINDS,
    CaseResult,
    Outcome,
    Report,
    Stream,
    _as_list,
    _first_line,
    covered,
    read_stream,
    score,
    sign,
)
from agentrl.verifiers.twin_sets import DEFAULT_ODDS, DecisionPlan, plan_twin_sets

PLAN_TRIES = 8
"""Draws of the twin sets per verification before the best one is taken: `tasks synth` keeps a task
only where most draws reach the odds, so all eight fall short less than once in 256."""

# Reading the result stream and scoring a report live in `result_stream`; their public names are
# importable from here as well.
__all__ = [
    "BOOTSTRAP",
    "RECORD_KINDS",
    "CaseResult",
    "HiddenTestsRun",
    "HiddenTestsVerifier",
    "InstalledTests",
    "Outcome",
    "Report",
    "Stream",
    "check_run",
    "covered",
    "install_tests",
    "judge",
    "node_ids_to_run",
    "read_stream",
    "remove_tests",
    "run_tests",
    "runner_input",
    "score",
    "sign",
    "stage_tests",
]

SYSTEM_PYTHON = "/usr/bin/python3"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_DETAILS_LIMIT = 3000
log = logging.getLogger(__name__)

# The runner's text, sent on stdin (never imported here: it runs the agent's code).
RUNNER_SOURCE = Path(__file__).with_name("pytest_runner.py").read_text()
_KEY_BYTES = 32
# Reads the program from stdin, runs it; the program then reads the key that follows it.
BOOTSTRAP = "import sys;exec(compile(sys.stdin.buffer.read({n}),'<agentrl-hidden-tests>','exec'))"

# Our ini file: its presence (given with -c) means no ini file of the workspace is ever read.
INI = "[pytest]\n"


def _tail(text: str, n: int = 800) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


_EXIT_MEANING = {
    2: "pytest was interrupted (usually: errors while collecting the tests)",
    3: "pytest hit an internal error",
    4: "pytest rejected its command line (usage error)",
    5: "pytest collected no tests",
}


# --- running the hidden tests in a sandbox -------------------------------------------------


def stage_tests(hidden: Path, staged: Path) -> None:
    """Copy the hidden tests (a file or a folder) to `staged`, a folder, afresh."""
    if staged.exists():
        shutil.rmtree(staged)
    if hidden.is_file():
        staged.mkdir()
        shutil.copy2(hidden, staged / hidden.name)
    else:
        shutil.copytree(hidden, staged, symlinks=True)


@dataclass(frozen=True)
class InstalledTests:
    """Hidden tests copied under /verifier (with our ini), ready to run any number of times."""

    run_dir: str
    tests_dir: str
    target: str
    has_conftest: bool


def install_tests(
    sandbox: Sandbox,
    hidden: Path,
    run_dir: str | None = None,
    *,
    rewrite: Callable[[Path], object] | None = None,
) -> InstalledTests:
    """Copy the hidden tests (a host file or folder) and our ini into a fresh directory under
    /verifier, privileged, readable by the verifier identity and writable by nobody else.

    `rewrite`: called on the staged copy of the tests folder before it is copied in (the
    canaries are planted there); the host's hidden tests are never changed.
    """
    run_dir = run_dir or f"{PROTECTED_DIR}/hidden-tests-{uuid.uuid4().hex[:12]}"
    tests_dir = f"{run_dir}/tests"
    with tempfile.TemporaryDirectory(prefix="agentrl-hidden-tests-") as stage:
        Path(stage, "pytest.ini").write_text(INI)
        staged = Path(stage, "tests")
        stage_tests(hidden, staged)
        if rewrite is not None:
            rewrite(staged)
        # Readable by the verifier identity (not root on docker); the modes travel with the copy.
        for path in [Path(stage), *Path(stage).rglob("*")]:
            if not path.is_symlink():
                path.chmod(0o755 if path.is_dir() else 0o644)
        sandbox.copy_in(stage, run_dir, privileged=True)
    target = f"{tests_dir}/{hidden.name}" if hidden.is_file() else tests_dir
    return InstalledTests(run_dir, tests_dir, target, hidden.is_dir() and any(hidden.rglob("conftest.py")))


@dataclass(frozen=True)
class HiddenTestsRun:
    """One run of the hidden tests: the checked stream and the command's own result."""

    stream: Stream
    result: ExecResult
    output: str
    """The tail of pytest's own output (stderr), for the reasons in verdicts."""
    ids: list[str] | None
    """The node ids the run was limited to (None: the whole suite)."""

    def report(self) -> Report | None:
        """The per-test outcomes when the run finished cleanly and untampered, else None."""
        s = self.stream
        if self.result.timed_out or s.cut or s.tampered or s.end is None or s.end != self.result.exit_code:
            return None
        return s.report()


def run_tests(
    sandbox: Sandbox,
    tests: InstalledTests,
    *,
    ids: list[str] | None = None,
    timeout_s: float = 120.0,
    pytest_args: list[str] | tuple[str, ...] = (),
    python: str = SYSTEM_PYTHON,
    max_report_mb: float = 16.0,
    message_chars: int = 1000,
) -> HiddenTestsRun:
    """Run the installed hidden tests over the workspace as the verifier identity; see the module docstring.

    `ids`: run exactly these node ids (relative to the tests' root); None runs the whole suite.
    """
    scratch = f"/tmp/agentrl-verify-{uuid.uuid4().hex}"
    args = [
        "-c", f"{tests.run_dir}/pytest.ini",
        f"--rootdir={tests.tests_dir}",
        f"--confcutdir={tests.tests_dir}",
        *([] if tests.has_conftest else ["--noconftest"]),
        "-p", "no:cacheprovider",
        f"--basetemp={scratch}/basetemp",
        "--color=no",
        "--code-highlight=no",
        "-q",
        *pytest_args,
        # The files of the listed tests, not their node ids: pytest matches every node-id
        # argument against every item of its module (quadratic in a suite of hundreds); the
        # runner keeps exactly the listed tests when collection is done (`select`).
        *([f"{tests.tests_dir}/{f}" for f in sorted({i.split("::", 1)[0] for i in ids})] if ids else [tests.target]),
    ]  # fmt: skip
    config = {
        "scratch": scratch,
        "tests_dir": tests.tests_dir,
        "import_paths": [sandbox.workdir],
        "args": args,
        "message_chars": message_chars,
        # Sorted: the order the ids were planned in (a test, then its twin) must not reach the process.
        "select": sorted(set(ids)) if ids else None,
        "env": {
            "PATH": SYSTEM_PATH,
            "HOME": f"{scratch}/home",
            "TMPDIR": f"{scratch}/tmp",
            "USER": "verifier",
            "LOGNAME": "verifier",
            "LANG": "C.UTF-8",
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
            "AGENTRL_WORKSPACE": sandbox.workdir,
        },
    }
    key = secrets.token_bytes(_KEY_BYTES)
    argv, stdin = runner_input(config, key, python)
    res = sandbox.exec(
        argv,
        stdin=stdin,
        timeout=timeout_s,
        as_verifier=True,
        output_limit=int(max_report_mb * 2**20),
    )
    stream = read_stream(res.stdout, key, expected=ids)
    return HiddenTestsRun(stream, res, _tail(res.stderr), ids)


def runner_input(config: dict[str, Any], key: bytes, python: str = SYSTEM_PYTHON) -> tuple[list[str], bytes]:
    """The runner's command line and its stdin: the program, the key, then the settings (8 hex
    digits of length and JSON). Nothing of the settings is on the command line, on disk or in the
    program's text."""
    program = RUNNER_SOURCE.encode()
    settings = json.dumps(config).encode()
    argv = [python, "-I", "-B", "-c", BOOTSTRAP.format(n=len(program))]
    return argv, program + key.hex().encode() + f"{len(settings):08x}".encode() + settings


def node_ids_to_run(fail_to_pass: list[str], pass_to_pass: list[str]) -> list[str] | None:
    """The listed tests as pytest arguments when every entry is a node id; None otherwise."""
    listed = list(dict.fromkeys([*fail_to_pass, *pass_to_pass]))
    return listed if listed and all("::" in e for e in listed) else None


def check_run(run: HiddenTestsRun, *, timeout_s: float = 0.0, max_report_mb: float = 0.0) -> Report | Verdict:
    """The run's report when its stream passed every check of the module docstring's step 7 and
    its outcomes agree with pytest's exit status; otherwise the zero verdict saying why."""
    s, res = run.stream, run.result

    def zero(reason: str) -> Verdict:
        return Verdict(
            0.0, False, _clip(f"{reason}; pytest's output: {run.output}" if run.output else reason)
        )

    if res.timed_out:
        return zero(f"hidden tests timed out after {timeout_s:g}s and were killed")
    if s.cut:
        return zero(
            f"the result stream is over max_report_mb={max_report_mb:g}: the code under test wrote or "
            "raised something huge into it; it was cut there and not trusted"
        )
    if s.tampered:
        return zero(
            "the hidden-test run was tampered with: " + "; ".join(_first_line(t) for t in s.tampered[:4])
        )
    if not s.started:
        return zero(f"the hidden-test runner never started ({_describe_exit(res.exit_code)})")
    if s.runner_errors:
        return zero(f"the hidden-test runner failed before pytest ran: {s.runner_errors[0]}")
    if s.collect_errors:
        errors = "; ".join(f"{e.nodeid}: {_tail(e.message, 600)}" for e in s.collect_errors[:3])
        return Verdict(0.0, False, _clip(f"collection error in the hidden tests: {errors}"))
    if s.internal_errors:
        return zero(f"pytest hit an internal error: {_tail(s.internal_errors[0], 600)}")
    if s.end is None:
        return zero(
            f"pytest never finished: the process ended ({_describe_exit(res.exit_code)}) before reporting "
            "its end; os._exit, a crash or a kill in the code under test?"
        )
    if s.end != res.exit_code:
        return zero(
            f"the process's exit status {res.exit_code} contradicts pytest's exit status {s.end}: "
            "the code under test exited on its own after pytest finished"
        )
    if s.end not in (0, 1):
        return zero(_EXIT_MEANING.get(s.end, f"pytest died ({_describe_exit(s.end)})"))
    report = s.report()
    failing = report.count("failed") + report.count("error")
    if (s.end == 0) != (failing == 0):
        return zero(
            f"the results ({failing} of {len(report.tests)} tests failed) contradict pytest's exit status {s.end}"
        )
    return report


def _tampered(problems: list[str]) -> Verdict:
    return Verdict(
        0.0,
        False,
        _clip(
            "the hidden-test run was tampered with: "
            + "; ".join(problems[:3])
            + (f"; ... {len(problems) - 3} more" if len(problems) > 3 else "")
        ),
    )


def _as_original(report: Report, canaries: CanaryPlan) -> Report:
    return Report(
        {
            original: CaseResult(original, t.outcome, t.message)
            for nodeid, t in report.tests.items()
            if (original := canaries.original_id(nodeid)) is not None
        },
        report.collection_errors,
    )


def judge(
    run: HiddenTestsRun,
    *,
    mode: Literal["all", "fraction"] = "all",
    fail_to_pass: list[str] | None = None,
    pass_to_pass: list[str] | None = None,
    timeout_s: float = 0.0,
    max_report_mb: float = 0.0,
    canaries: CanaryPlan | None = None,
) -> Verdict:
    """The verdict of one run: every check of the module docstring's step 7, the canaries'
    check (no test passed together with its contradicting twin), then the score."""
    checked = check_run(run, timeout_s=timeout_s, max_report_mb=max_report_mb)
    if isinstance(checked, Verdict):
        return checked
    report = checked
    if canaries is not None:
        outcomes = {nodeid: t.outcome for nodeid, t in report.tests.items()}
        if problems := canaries.tampering(outcomes, collected=run.stream.collected):
            return _tampered(problems)
        report = _as_original(report, canaries)
    reward, passed, summary = score(report, mode=mode, fail_to_pass=fail_to_pass, pass_to_pass=pass_to_pass)
    if canaries is not None:
        summary += f" [{canaries.summary()}]"
    return Verdict(reward, passed, _clip(summary))


def remove_tests(sandbox: Sandbox, installed: list[InstalledTests]) -> None:
    """Remove installed hidden tests from the sandbox: a later verification of the same sandbox must
    not find this one's tests (nor its twin sets, which a forger could set against its own)."""
    if installed:
        try:
            sandbox.exec(["rm", "-rf", *[t.run_dir for t in installed]], privileged=True, timeout=60)
        except Exception as exc:  # a sandbox that is gone takes its tests along
            log.debug("could not remove the installed hidden tests: %s", exc)


# --- the verifier --------------------------------------------------------------------------


@dataclass
class HiddenTestsVerifier:
    """Runs the task's hidden pytest suite after the episode, isolated from the agent's tricks."""

    mode: Literal["all", "fraction"] = "all"
    """"all": reward 1 only if every considered test passed; "fraction": the fraction that passed."""
    fail_to_pass: list[str] | None = None
    """SWE-bench FAIL_TO_PASS node ids; overrides the task's metadata["FAIL_TO_PASS"]."""
    pass_to_pass: list[str] | None = None
    """SWE-bench PASS_TO_PASS node ids; overrides the task's metadata["PASS_TO_PASS"]."""
    timeout_s: float = 120.0
    """Wall-clock limit of the pytest run; past it the run is killed and the reward is 0."""
    pytest_args: list[str] = field(default_factory=list)
    """Extra pytest arguments (e.g. ["-m", "not slow"]): the hidden tests' own ini file is not read."""
    python: str = SYSTEM_PYTHON
    """The image's system interpreter, by absolute path (never looked up on PATH)."""
    max_report_mb: float = 16.0
    """Cap on the result stream (and on pytest's output) read back from the run; past it, reward 0."""
    canaries: bool = True
    """Give considered tests canary twins that contradict them (`agentrl.verifiers.canaries`): a
    test and its twin both passing is tampering, reward 0. Every FAIL_TO_PASS test gets one (those
    are what a forger must flip), and so does every test when the task lists none."""
    odds: int = DEFAULT_ODDS
    """With canaries and FAIL_TO_PASS node ids: the FAIL_TO_PASS tests run first, in a process of their
    own, each among the members of its twin set (`agentrl.verifiers.twin_sets`), sized so that a
    forger that knows every set and guesses which member is real wins at most 1 in `odds`."""
    canary_pass_to_pass: int = 2
    """How many PASS_TO_PASS tests, drawn per run, get a twin too. They pass on the buggy code
    already, so the FAIL_TO_PASS twins are what a forger meets; these keep twins among the other
    tests as well. Each twin is one more test that fails by design, and a failing test costs far
    more than a passing one (its traceback is rendered): on a suite of hundreds, twinning every
    test more than doubled the verification time."""
    name: str = "hidden-tests"
    needs_sandbox: ClassVar[bool] = True
    # The agent's code runs under the tests: apart from the host, from a place it could not
    # write, as an identity that cannot write what it judges.
    needs_capabilities: ClassVar[tuple[str, ...]] = ("isolated", "protected_dir", "verifier_identity")

    def __post_init__(self) -> None:
        if self.mode not in ("all", "fraction"):
            raise ValueError(f"mode must be 'all' or 'fraction', got {self.mode!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive seconds, got {self.timeout_s}")
        if not self.python.startswith("/"):
            raise ValueError(
                f"python must be an absolute path on the image's read-only root file system "
                f"(e.g. {SYSTEM_PYTHON}), got {self.python!r}: a PATH lookup could find the agent's"
            )
        if self.canaries and (
            bad := [
                a for a in self.pytest_args if a in ("-x", "--exitfirst", "-k") or a.startswith("--maxfail")
            ]
        ):
            raise ValueError(
                f"pytest_args {bad} cannot be used with canary twins (a run stopped at the first failure "
                "or filtered by name leaves twins out): list the tests in fail_to_pass/pass_to_pass, or "
                "pass canaries=False"
            )
        if self.odds < 2:
            raise ValueError(f"odds must be at least 2 (1 in odds for a blind guess), got {self.odds}")
        if self.canary_pass_to_pass < 0:
            raise ValueError(f"canary_pass_to_pass must be a count >= 0, got {self.canary_pass_to_pass}")
        if self.max_report_mb <= 0:
            raise ValueError(f"max_report_mb must be positive, got {self.max_report_mb}")
        self.fail_to_pass = _as_list(self.fail_to_pass, "fail_to_pass")
        self.pass_to_pass = _as_list(self.pass_to_pass, "pass_to_pass")

    def _lists(self, task: Task) -> tuple[list[str], list[str]]:
        if self.fail_to_pass or self.pass_to_pass:
            return list(self.fail_to_pass or []), list(self.pass_to_pass or [])
        meta = task.metadata

        def pick(key: str) -> list[str]:
            for k in (key, key.lower()):
                if k in meta:
                    return _as_list(meta[k], f"task {task.id} metadata[{k!r}]")
            return []

        return pick("FAIL_TO_PASS"), pick("PASS_TO_PASS")

    def verify(self, sandbox: Sandbox | None, task: Task, episode: Episode) -> Verdict:
        if sandbox is None:
            return Verdict(0.0, False, "the hidden-tests verifier needs a sandbox; this episode had none")
        # Also checked by run_verifier; here too for callers of verify() itself.
        if (refusal := capability_refusal(self, sandbox)) is not None:
            return Verdict(0.0, False, refusal)
        if task.hidden_tests is None:
            return Verdict(
                0.0, False, f"task {task.id} has no hidden_tests; set Task.hidden_tests to a host path"
            )
        hidden = Path(task.hidden_tests).expanduser()
        if not hidden.exists():
            return Verdict(
                0.0, False, f"task {task.id}: hidden tests not found on the host at {str(hidden)!r}"
            )
        try:
            fail_to_pass, pass_to_pass = self._lists(task)
        except ValueError as exc:
            return Verdict(0.0, False, str(exc))

        # 1. Nothing of the agent's may run from here on, before anything of ours exists.
        sandbox.kill_agent_processes()
        if self.canaries and fail_to_pass and node_ids_to_run(fail_to_pass, pass_to_pass) is not None:
            return self._verify_in_two_runs(sandbox, task, hidden, fail_to_pass, pass_to_pass)
        ids = node_ids_to_run(fail_to_pass, pass_to_pass)
        run, plan, installed = self._run_with_canaries(
            sandbox, hidden, fail_to_pass, pass_to_pass, ids, self.timeout_s
        )
        remove_tests(sandbox, installed)
        # 7. The stream's checks, then the score.
        return judge(
            run,
            mode=self.mode,
            fail_to_pass=fail_to_pass,
            pass_to_pass=pass_to_pass,
            timeout_s=self.timeout_s,
            max_report_mb=self.max_report_mb,
            canaries=plan,
        )

    def _run_with_canaries(
        self,
        sandbox: Sandbox,
        hidden: Path,
        fail_to_pass: list[str],
        pass_to_pass: list[str],
        ids: list[str] | None,
        timeout_s: float,
        prefer_negation: bool = False,
    ) -> tuple[HiddenTestsRun, CanaryPlan | None, list[InstalledTests]]:
        """Steps 2-6 for one run: the tests installed with canary twins for the considered ones (every
        FAIL_TO_PASS test and a few PASS_TO_PASS, or every test when none are listed), then run."""
        # 2. The tests, in a fresh directory only the privileged side can write, each
        # considered test beside a canary twin that contradicts it (drawn afresh per run).
        plan: CanaryPlan | None = None

        def plant(staged: Path) -> None:
            nonlocal plan
            rng = random.Random(secrets.randbits(64))
            p2p = [t for t in dict.fromkeys(pass_to_pass) if t not in fail_to_pass]
            # Twins must exist for blanket forging to meet one: when the first choice leaves none,
            # negated checks are allowed for FAIL_TO_PASS tests too, then more PASS_TO_PASS tests.
            tries = [
                (self.canary_pass_to_pass, True),
                (self.canary_pass_to_pass, False),
                (max(20, 2 * len(p2p) // 10), False),
            ]
            for n_p2p, strict in tries:
                considered = (
                    [*fail_to_pass, *rng.sample(p2p, min(len(p2p), n_p2p))] if fail_to_pass or p2p else None
                )
                try:
                    plan = plant_canaries(
                        staged,
                        considered=considered,
                        literal_only=(fail_to_pass or None) if strict else None,
                        prefer_negation=prefer_negation,
                        rng=rng,
                    )
                except Exception as exc:  # a planter's bug must not cost an honest agent its reward
                    log.warning(
                        "no canary twins for the tests at %s: planting failed (%s: %s)",
                        hidden,
                        type(exc).__name__,
                        exc,
                    )
                    plan = None
                if plan is not None and plan.twins:
                    break
                # Back to the untouched tests: a half-rewritten file must not be what runs.
                stage_tests(hidden, staged)

        tests = install_tests(sandbox, hidden, rewrite=plant if self.canaries else None)
        if plan is not None and ids is not None:
            ids = plan.to_installed(ids)
        # 3-6. pytest as the verifier identity, results streamed back here.
        run = run_tests(
            sandbox,
            tests,
            ids=ids,
            timeout_s=timeout_s,
            pytest_args=self.pytest_args,
            python=self.python,
            max_report_mb=self.max_report_mb,
        )
        return run, plan, [tests]

    def _verify_in_two_runs(
        self, sandbox: Sandbox, task: Task, hidden: Path, fail_to_pass: list[str], pass_to_pass: list[str]
    ) -> Verdict:
        """FAIL_TO_PASS tests first, alone, each among its twin set; then the rest of the listed
        tests with their canary twins (`agentrl.verifiers.twin_sets` says why two processes)."""
        deadline = time.monotonic() + self.timeout_s
        decision = self._plan_decision(task, hidden, fail_to_pass, pass_to_pass)
        installed: list[InstalledTests] = []
        try:
            tests: dict[str, CaseResult] = {}
            if decision.sets:
                first = self._decision_run(sandbox, hidden, decision, deadline, installed)
                if isinstance(first, Verdict):
                    return first
                tests = first
            # The rest, once the first run's outcomes are on this side: the PASS_TO_PASS tests and
            # the FAIL_TO_PASS tests no twin set covers, with canary twins as before.
            rest = [t for t in dict.fromkeys([*pass_to_pass, *decision.uncovered]) if t not in tests]
            plan: CanaryPlan | None = None
            if rest:
                second = self._rest_run(sandbox, hidden, fail_to_pass, pass_to_pass, decision, rest, deadline)
                installed.extend(second[2])
                if isinstance(second[0], Verdict):
                    return second[0]
                tests.update(second[0])
                plan = second[1]
            reward, passed, summary = score(
                Report(tests), mode=self.mode, fail_to_pass=fail_to_pass, pass_to_pass=pass_to_pass
            )
            summary += f" [{decision.summary()}" + (f"; {plan.summary()}" if plan is not None else "") + "]"
            return Verdict(reward, passed, _clip(summary))
        finally:
            remove_tests(sandbox, installed)

    def _plan_decision(
        self, task: Task, hidden: Path, fail_to_pass: list[str], pass_to_pass: list[str]
    ) -> DecisionPlan:
        """The twin sets of the FAIL_TO_PASS run, drawn afresh until they reach the odds (the draw of the
        best odds after `PLAN_TRIES`). The sets, not which member is real, decide whether a draw is kept,
        so a redraw tells a reader nothing. A draw that decides nothing (no set: every value it drew for
        them declined, or the planner failed on it) is drawn again too, since a verification without
        sets leaves the failing tests to canary twins alone, where a guess wins half the time; a second
        such draw ends the drawing (a task nothing covers, or a planner's bug, costs two draws, not
        eight). Nothing covered at all: every test uncovered, with the reason."""
        try:
            planned: dict[str, Any] = dict(
                listed=[*fail_to_pass, *pass_to_pass],
                avoid=task.prompt,
                odds=self.odds,
                failing_lines=_failing_lines(task),
                failing_errors=_string_map(task, "FAIL_TO_PASS_ERRORS"),
                failing_values=_list_map(task, "FAIL_TO_PASS_VALUES"),
                safe_sites=_string_list(task, "TWIN_SITES"),
            )
        except Exception as exc:  # the task's own metadata is malformed: no draw would differ
            return self._unplanned(task, fail_to_pass, exc)
        best: DecisionPlan | None = None
        failure: Exception | None = None
        undecided = 0
        for _ in range(PLAN_TRIES):
            try:
                plan = plan_twin_sets(
                    hidden, fail_to_pass, rng=random.Random(secrets.randbits(64)), **planned
                )
            except Exception as exc:  # a planner's bug must not cost an honest agent its reward
                failure, plan = exc, None
            if plan is not None and (best is None or plan.odds > best.odds):
                best = plan  # a draw without sets has odds 1: any draw with one is preferred
            if plan is not None and plan.sets and not plan.short:
                break
            if plan is None or not plan.sets:
                undecided += 1
                if undecided == 2:
                    break
        if best is None:
            assert failure is not None
            return self._unplanned(task, fail_to_pass, failure)
        return best

    @staticmethod
    def _unplanned(task: Task, fail_to_pass: list[str], exc: Exception) -> DecisionPlan:
        log.warning("no twin sets for task %s: planning failed (%s: %s)", task.id, type(exc).__name__, exc)
        return DecisionPlan(uncovered=dict.fromkeys(fail_to_pass, f"planning failed ({type(exc).__name__})"))

    def _decision_run(
        self,
        sandbox: Sandbox,
        hidden: Path,
        decision: DecisionPlan,
        deadline: float,
        installed: list[InstalledTests],
    ) -> dict[str, CaseResult] | Verdict:
        """The first run: the decision folder alone. Each decided FAIL_TO_PASS id -> its real
        member's result, or the zero verdict (a broken stream, two members of a set passing)."""

        def replace(staged: Path) -> None:
            shutil.rmtree(staged)
            staged.mkdir()
            decision.write(staged)

        first = install_tests(sandbox, hidden, rewrite=replace)
        installed.append(first)
        run = run_tests(
            sandbox,
            first,
            ids=decision.ids,
            timeout_s=max(1.0, deadline - time.monotonic()),
            pytest_args=self.pytest_args,
            python=self.python,
            max_report_mb=self.max_report_mb,
        )
        checked = check_run(run, timeout_s=self.timeout_s, max_report_mb=self.max_report_mb)
        if isinstance(checked, Verdict):
            return checked
        outcomes = {nodeid: t.outcome for nodeid, t in checked.tests.items()}
        if problems := decision.tampering(outcomes, collected=run.stream.collected):
            return _tampered(problems)
        tests: dict[str, CaseResult] = {}
        for nodeid, original in decision.real_ids().items():
            if (case := checked.tests.get(nodeid)) is not None:
                tests[original] = CaseResult(original, case.outcome, case.message)
        return tests

    def _rest_run(
        self,
        sandbox: Sandbox,
        hidden: Path,
        fail_to_pass: list[str],
        pass_to_pass: list[str],
        decision: DecisionPlan,
        rest: list[str],
        deadline: float,
    ) -> tuple[dict[str, CaseResult] | Verdict, CanaryPlan | None, list[InstalledTests]]:
        """The second run: `rest` (PASS_TO_PASS and the uncovered FAIL_TO_PASS tests) with canary
        twins. Its results by the task's ids (or the zero verdict), its canaries, what it installed."""
        uncovered = [t for t in fail_to_pass if t in decision.uncovered]
        run, plan, installed = self._run_with_canaries(
            sandbox,
            hidden,
            uncovered,
            [t for t in pass_to_pass if t not in fail_to_pass],
            rest,
            max(1.0, deadline - time.monotonic()),
            prefer_negation=True,
        )
        checked = check_run(run, timeout_s=self.timeout_s, max_report_mb=self.max_report_mb)
        if isinstance(checked, Verdict):
            return checked, plan, installed
        if plan is not None:
            outcomes = {nodeid: t.outcome for nodeid, t in checked.tests.items()}
            if problems := plan.tampering(outcomes, collected=run.stream.collected):
                return _tampered(problems), plan, installed
            checked = _as_original(checked, plan)
        return checked.tests, plan, installed


def _failing_lines(task: Task) -> dict[str, int] | None:
    """Where each FAIL_TO_PASS test fails on the buggy code (`FAIL_TO_PASS_LINES`: node id -> line of
    its test file), when the task says; None when it does not."""
    raw = task.metadata.get("FAIL_TO_PASS_LINES")
    if not isinstance(raw, dict):
        return None
    return {str(k): int(v) for k, v in raw.items() if isinstance(v, int) and not isinstance(v, bool)}


def _string_map(task: Task, key: str) -> dict[str, str] | None:
    raw = task.metadata.get(key)
    return {str(k): str(v) for k, v in raw.items()} if isinstance(raw, dict) else None


def _list_map(task: Task, key: str) -> dict[str, list[str]] | None:
    raw = task.metadata.get(key)
    if not isinstance(raw, dict):
        return None
    return {str(k): [str(x) for x in v] for k, v in raw.items() if isinstance(v, list)}


def _string_list(task: Task, key: str) -> list[str] | None:
    raw = task.metadata.get(key)
    return [str(v) for v in raw] if isinstance(raw, list) else None


def _describe_exit(code: int) -> str:
    # A process killed by signal N: the sandbox says -N, a shell or `docker exec` says 128+N.
    if code < 0:
        return f"killed by signal {-code}"
    if code in (126, 127):
        return f"exit {code}: the interpreter is missing from the image or not executable"
    if 128 < code < 160:
        return f"exit {code}: killed by signal {code - 128}"
    return f"exit {code}"


def _clip(text: str) -> str:
    return text if len(text) <= _DETAILS_LIMIT else text[: _DETAILS_LIMIT - 3] + "..."
