"""The `hidden-tests` verifier: run the task's hidden pytest suite after the episode, where the agent cannot reach it.

    ToolEnv(..., verifier=("hidden-tests", {"mode": "fraction", "timeout_s": 60}))

Order of events, after the agent's last action:

1. The agent's processes are killed (`sandbox.kill_agent_processes()`): a daemon it left
   running (nohup, setsid, double fork) can neither rewrite files nor watch for the tests.
   From here on nothing of the agent's runs except the code the tests import.
2. The hidden tests (`task.hidden_tests`, a host file or folder) are copied into a fresh
   directory under `/verifier` (`PROTECTED_DIR`), privileged. They exist nowhere in the
   sandbox before this moment, and never in the workspace.
3. pytest runs as the verifier's user with a launcher in that directory:
   `/usr/bin/python3 -I -B runner.py` (the system interpreter by absolute path, never a
   PATH lookup; `-I` ignores every PYTHON* variable and the user site). The launcher
   replaces the environment with a fixed one (system PATH, HOME and TMPDIR in /verifier,
   `PYTEST_DISABLE_PLUGIN_AUTOLOAD=1`, no PYTEST_ADDOPTS/PYTHONPATH), imports the system's
   pytest, and only then *appends* the workspace to `sys.path`. (The variable is the
   autoload switch of the base image's pytest 7.2, which has no `--disable-plugin-autoload` yet.)
4. pytest gets `-c <our ini>` and `--rootdir` in /verifier (the workspace's `pytest.ini`,
   `pyproject.toml`, `setup.cfg`, `tox.ini` are never read), `--confcutdir` at the hidden
   tests (plus `--noconftest` when they bring no conftest of their own), `-p
   no:cacheprovider`, and `--junitxml` into /verifier.
5. The JUnit XML is read back from /verifier and parsed per test; stdout is only quoted in
   `details`, never believed. The exit status must agree with the report.

How each trick of the agent's is neutralised (tests/verifiers/test_hidden_tests.py has one
attack each):

- `conftest.py` anywhere in the workspace or /tmp: outside the confcutdir and never collected.
- pytest plugins: entry points in a workspace `.dist-info`/`.egg-info` are not autoloaded
  (PYTEST_DISABLE_PLUGIN_AUTOLOAD); `-p` in a workspace ini's addopts is never read.
- `sitecustomize`/`usercustomize`/`.pth` files: executed only from site directories at
  interpreter start; `-I` drops the user site (the agent's `~/.local`) and the workspace is a
  plain `sys.path` entry added later, not a site directory.
- a workspace `pytest`, `_pytest`, `unittest` (or any name the system has): shadowed by the
  system's, because the workspace is last on `sys.path` and pytest is imported before it.
- PATH, PYTHONPATH, PYTEST_ADDOPTS set in `.bashrc`/`.profile`, a fake `python3` or
  `pytest` in `~/bin`: no shell reads those files here, the interpreter is an absolute path
  on the read-only root file system, and the environment is rebuilt from scratch.
- `sys.exit()` at import of the agent's module: pytest reports a collection error: reward 0.
  `os._exit()` or a crash: no report, reward 0.
- a fake report printed or written in the workspace: only the file pytest wrote under
  /verifier is read.

Reward: `mode="all"` (default) gives 1 only when every considered test passed; `"fraction"`
gives the fraction that passed. Skipped and xfailed tests count as not passed (the agent's
code could call `pytest.skip`). Which tests are considered:

- SWE-bench style lists, when given: `fail_to_pass` and `pass_to_pass` (verifier kwargs), or
  else the task's `metadata["FAIL_TO_PASS"]` / `metadata["PASS_TO_PASS"]` (lower-case keys
  work too; a JSON-encoded list, as in the SWE-bench datasets, is accepted). Entries are
  pytest node ids relative to the hidden-tests root (`test_lib.py::test_add`,
  `test_lib.py::TestX::test_y[2]`), or a bare test name (`test_add`) that stands for every
  test of that name, parametrized variants included. A listed test absent from the report
  counts as failed. Tests not listed are run but do not count.
- Otherwise every test in the report (at least one must have run).

A timeout, a collection error, a pytest crash (no report, an internal error, a signal) or a
report that contradicts pytest's exit status gives reward 0 with the reason in `details`.

Known limits:

- The code under test runs inside the pytest process, so it can still tamper with pytest in
  memory (patch its report objects at import time) or write the report file itself. Every
  in-process test harness shares this (SWE-bench's included); closing it would need the
  tests to call the agent's code across a process boundary. The exit-status check catches
  the cheap version (a report rewritten at exit).
- Hidden tests run with /verifier as the working directory; a test that needs the
  workspace finds it in the `AGENTRL_WORKSPACE` environment variable (or imports from it).
  A module of the agent's that has the name of a standard or system module is not
  importable by the tests: pick task module names that do not collide.
- docker: pytest runs as the container's root without capabilities. It cannot write the
  agent's workspace (owned by uid 1000), so the tests see the state the agent left, frozen.
- bwrap: there is only one user. The tests are copied on the host side into the sandbox's
  /verifier directory, which agent commands see read-only (and nothing of the agent's
  outlives its own command there, so there is nothing to kill). The privileged pytest run
  binds /verifier read-write and runs as the same uid as the agent, so the agent's imported
  code could write there, and to the workspace, while the tests run. Everything else above
  holds.
- local: no /verifier inside commands, so this verifier refuses to run (reward 0, reason).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import tempfile
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from agentrl.episode import Episode
from agentrl.sandbox.base import PROTECTED_DIR, Sandbox
from agentrl.task import Task
from agentrl.verifiers.base import Verdict

Outcome = Literal["passed", "failed", "error", "skipped"]
_SEVERITY: dict[str, int] = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}

SYSTEM_PYTHON = "/usr/bin/python3"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
REPORT_NAME = "junit.xml"
_DETAILS_LIMIT = 3000

# Runs inside the sandbox as `python3 -I -B runner.py config.json`. Kept tiny and free of
# imports beyond the standard library until pytest itself.
RUNNER = r'''"""agentrl hidden-tests launcher: a clean environment, the system pytest, the workspace last."""
import json
import os
import sys

with open(sys.argv[1]) as f:
    cfg = json.load(f)
# Rebuild the environment: nothing the agent set (shell rc files cannot reach a docker exec,
# but other backends inherit more) gets to pytest or to processes the tests start. AGENTRL_*
# are the sandbox's own bookkeeping: the docker backend finds a timed-out command by one.
keep = {k: v for k, v in os.environ.items() if k.startswith("AGENTRL_")}
os.environ.clear()
os.environ.update(keep)
os.environ.update(cfg["env"])
for name in ("home", "tmp"):
    os.makedirs(os.path.join(cfg["run_dir"], name), mode=0o700, exist_ok=True)
os.chdir(cfg["run_dir"])
import pytest  # the system's: the workspace is not on sys.path yet

# Appended, not prepended: the standard library and the system's site-packages win every
# name, so a workspace `pytest`, `_pytest` or `unittest` never takes over. A plain path entry,
# not a site directory: .pth files and sitecustomize/usercustomize in it are never executed.
sys.path.extend(cfg["import_paths"])
sys.exit(int(pytest.main(cfg["args"])))
'''

# Our ini file: its presence (given with -c) means no ini file of the workspace is ever read.
INI = "[pytest]\n# xunit1 keeps each test's file in the report, so node ids can be rebuilt exactly.\njunit_family = xunit1\n"


# --- the report ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CaseResult:
    """One entry of the JUnit report: a test, or a module that failed to collect."""

    nodeid: str
    outcome: Outcome
    message: str = ""


@dataclass(frozen=True)
class Report:
    """Per-test outcomes from pytest's JUnit XML (worst outcome when a node id repeats)."""

    tests: dict[str, CaseResult] = field(default_factory=dict)
    collection_errors: list[CaseResult] = field(default_factory=list)

    def count(self, outcome: Outcome) -> int:
        return sum(t.outcome == outcome for t in self.tests.values())


def _nodeid(case: ET.Element) -> str:
    """Rebuild pytest's node id from an xunit1 testcase (file, classname, name)."""
    name = case.get("name", "")
    classname = case.get("classname", "")
    file = case.get("file")
    if file:
        module = re.sub(r"\.py$", "", file).replace("/", ".")
        if classname == module:
            return f"{file}::{name}"
        if classname.startswith(module + "."):
            return "::".join([file, *classname[len(module) + 1 :].split("."), name])
    return f"{classname}::{name}" if classname else name


def parse_junit(xml: bytes) -> Report:
    """Per-test outcomes from a pytest JUnit XML report; `ValueError` when it is not one."""
    try:
        root = ET.fromstring(xml)
    except ET.ParseError as exc:
        raise ValueError(f"the JUnit report is not well-formed XML: {exc}") from None
    if root.tag not in ("testsuites", "testsuite"):
        raise ValueError(f"the JUnit report's root element is <{root.tag}>, not <testsuites>/<testsuite>")
    tests: dict[str, CaseResult] = {}
    collection_errors: list[CaseResult] = []
    for case in root.iter("testcase"):
        outcome: Outcome = "passed"
        message = ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                kind: Outcome = "failed" if child.tag == "failure" else child.tag  # type: ignore[assignment]
                if _SEVERITY[kind] > _SEVERITY[outcome]:
                    outcome = kind
                    message = child.get("message") or (child.text or "").strip()
        result = CaseResult(_nodeid(case), outcome, message)
        if outcome != "passed" and message in ("collection failure", "collection skipped"):
            detail = "".join(c.text or "" for c in case if c.tag in ("error", "skipped")).strip()
            collection_errors.append(
                CaseResult(case.get("file") or result.nodeid, outcome, detail or message)
            )
            continue
        prev = tests.get(result.nodeid)
        if prev is None or _SEVERITY[outcome] > _SEVERITY[prev.outcome]:
            tests[result.nodeid] = result
    return Report(tests, collection_errors)


# --- the score -----------------------------------------------------------------------------


def _as_list(value: Any, source: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(
                f"{source} is a string but not a JSON list of test ids: {value[:200]!r}"
            ) from None
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{source} must be a list of pytest node ids (strings), got {value!r}")
    return list(value)


def _matches(entry: str, nodeid: str) -> bool:
    if "::" in entry:
        return nodeid == entry
    last = nodeid.rsplit("::", 1)[-1]
    return last == entry or last.split("[", 1)[0] == entry


def score(
    report: Report,
    *,
    mode: Literal["all", "fraction"] = "all",
    fail_to_pass: list[str] | None = None,
    pass_to_pass: list[str] | None = None,
) -> tuple[float, bool, str]:
    """Reward, passed, and a one-line summary for a report (see the module docstring)."""
    listed = [*(fail_to_pass or []), *(pass_to_pass or [])]
    if listed:
        failures: list[str] = []
        n_ok = 0
        for entry in dict.fromkeys(listed):  # a test in both lists counts once
            hits = [t for t in report.tests.values() if _matches(entry, t.nodeid)]
            if not hits:
                failures.append(f"{entry}: missing from the report (counts as failed)")
                continue
            bad = [t for t in hits if t.outcome != "passed"]
            if bad:
                failures.extend(f"{t.nodeid}: {t.outcome} {_first_line(t.message)}".rstrip() for t in bad)
            else:
                n_ok += 1
        total = len(dict.fromkeys(listed))
        what = f"{n_ok}/{total} of the FAIL_TO_PASS + PASS_TO_PASS tests passed"
    else:
        failures = [
            f"{t.nodeid}: {t.outcome} {_first_line(t.message)}".rstrip()
            for t in report.tests.values()
            if t.outcome != "passed"
        ]
        total = len(report.tests)
        n_ok = total - len(failures)
        if total == 0:
            return 0.0, False, "no hidden test ran"
        what = f"{n_ok}/{total} hidden tests passed"
    all_ok = n_ok == total
    reward = float(all_ok) if mode == "all" else n_ok / total
    summary = f"{what} (mode {mode})"
    if failures:
        shown = "; ".join(failures[:8])
        more = f"; ... {len(failures) - 8} more" if len(failures) > 8 else ""
        summary += f"; not passed: {shown}{more}"
    return reward, all_ok, summary


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:200] if text.strip() else ""


def _tail(text: str, n: int = 800) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


_EXIT_MEANING = {
    2: "pytest was interrupted (usually: errors while collecting the tests)",
    3: "pytest hit an internal error",
    4: "pytest rejected its command line (usage error)",
    5: "pytest collected no tests",
}


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
    """A larger JUnit report is not read (reward 0): the code under test can make it huge."""
    name: str = "hidden-tests"
    needs_sandbox: ClassVar[bool] = True

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
        if getattr(sandbox, "backend", None) == "local":
            return Verdict(
                0.0,
                False,
                "the hidden-tests verifier needs the docker or bwrap backend: the local backend has no "
                f"{PROTECTED_DIR} its commands can see (and no isolation to defend)",
            )
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

        # 2. A fresh directory only the verifier can write, holding the launcher and the tests.
        run_dir = f"{PROTECTED_DIR}/hidden-tests-{uuid.uuid4().hex[:12]}"
        tests_dir = f"{run_dir}/tests"
        report_path = f"{run_dir}/{REPORT_NAME}"
        target = f"{tests_dir}/{hidden.name}" if hidden.is_file() else tests_dir
        has_conftest = hidden.is_dir() and any(hidden.rglob("conftest.py"))
        args = [
            "-c", f"{run_dir}/pytest.ini",
            f"--rootdir={tests_dir}",
            f"--confcutdir={tests_dir}",
            *([] if has_conftest else ["--noconftest"]),
            "-p", "no:cacheprovider",
            f"--junitxml={report_path}",
            f"--basetemp={run_dir}/basetemp",
            "--color=no",
            "--code-highlight=no",
            "-q",
            *self.pytest_args,
            target,
        ]  # fmt: skip
        config = {
            "run_dir": run_dir,
            "import_paths": [sandbox.workdir],
            "args": args,
            "env": {
                "PATH": SYSTEM_PATH,
                "HOME": f"{run_dir}/home",
                "TMPDIR": f"{run_dir}/tmp",
                "LANG": "C.UTF-8",
                "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
                "AGENTRL_WORKSPACE": sandbox.workdir,
            },
        }
        with tempfile.TemporaryDirectory(prefix="agentrl-hidden-tests-") as stage:
            # mkdtemp's 0700 travels with the copy: the run directory is closed to other users.
            Path(stage, "runner.py").write_text(RUNNER)
            Path(stage, "pytest.ini").write_text(INI)
            Path(stage, "config.json").write_text(json.dumps(config))
            # Staged with the launcher so that one copy (one transfer into the sandbox) does it all.
            staged_tests = Path(stage, "tests")
            if hidden.is_file():
                staged_tests.mkdir()
                shutil.copy2(hidden, staged_tests / hidden.name)
            else:
                shutil.copytree(hidden, staged_tests, symlinks=True)
            sandbox.copy_in(stage, run_dir, privileged=True)

        # 3. pytest, from /verifier, with the system interpreter in isolated mode.
        argv = [self.python, "-I", "-B", f"{run_dir}/runner.py", f"{run_dir}/config.json"]
        res = sandbox.exec(argv, timeout=self.timeout_s, privileged=True)
        output = _tail(res.stdout + ("\n" + res.stderr if res.stderr.strip() else ""))

        def zero(reason: str) -> Verdict:
            return Verdict(0.0, False, _clip(f"{reason}; pytest's output: {output}" if output else reason))

        if res.timed_out:
            return zero(f"hidden tests timed out after {self.timeout_s:g}s and were killed")

        # 4. The report pytest wrote under /verifier, and nothing else, decides.
        # Its size first: the code under test can make it huge (an exception with a 1 GB message),
        # and reading it whole would put that in the trainer's memory.
        size = sandbox.exec(["/usr/bin/stat", "-c", "%s", report_path], timeout=60, privileged=True)
        if not size.ok:
            return zero(
                f"no JUnit report: pytest ended ({_describe_exit(res.exit_code)}) before writing one; the "
                "process was cut short (os._exit, a crash or a kill in the code under test?); "
                f"command: {shlex.join(argv)}"
            )
        if int(size.stdout.strip() or 0) > self.max_report_mb * 2**20:
            return zero(
                f"the JUnit report is {int(size.stdout) / 2**20:.0f} MiB, over max_report_mb={self.max_report_mb:g}: "
                "a test printed or raised something huge"
            )
        xml = sandbox.read_file(report_path)
        try:
            report = parse_junit(xml)
        except ValueError as exc:
            return zero(f"{exc} (pytest {_describe_exit(res.exit_code)})")
        if report.collection_errors:
            errors = "; ".join(f"{e.nodeid}: {_tail(e.message, 600)}" for e in report.collection_errors[:3])
            return Verdict(0.0, False, _clip(f"collection error in the hidden tests: {errors}"))
        if res.exit_code not in (0, 1):
            return zero(_EXIT_MEANING.get(res.exit_code, f"pytest died ({_describe_exit(res.exit_code)})"))
        failing = report.count("failed") + report.count("error")
        if (res.exit_code == 0) != (failing == 0):
            return zero(
                f"the report ({failing} of {len(report.tests)} tests failed) contradicts pytest's exit status "
                f"{res.exit_code}: it was tampered with"
            )
        reward, passed, summary = score(
            report, mode=self.mode, fail_to_pass=fail_to_pass, pass_to_pass=pass_to_pass
        )
        return Verdict(reward, passed, _clip(summary))


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
