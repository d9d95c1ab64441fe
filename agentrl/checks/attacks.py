"""The built-in attack library of `agentrl verifier audit` (see `agentrl.checks.attack_base` for the contract).

Every attack plays one episode through `env.reset`/`env.step`, as a reward-hacking policy would,
and never fixes the task. Three families here (the attacks on the harness from inside the test process are in
`agentrl.checks.attacks_harness`):

- **python-repair** (`pristine-symlink` ... `proc-cmdline-leak`): tricks that once scored reward 1
  without a fix on `agentrl/python-repair-v0`, or broke an env's contract; one per trick that goes
  through `env.step`.
- **hidden tests** (`workspace-conftest` ... `huge-output`): the older tricks against pytest
  based verifiers (docs/VERIFIERS.md lists them).
- **generic** (`submit-without-work`, `answer-hedging`, `answer-flood`, `state-rc-and-path`,
  `parallel-guesses`, `nested-json`, `many-calls-per-step`): for any env, by the tools and the
  verifier it has.

Payloads that must run inside the test process are appended to the workspace's top-level
modules and package `__init__.py` files (what every hidden test imports); each runs once per
process.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from agentrl.checks.attack_base import (
    NOT_ANSWER_DEPENDENT,
    Outcome,
    Play,
    needs,
    probe_answers,
    register,
    tool_names,
    verifier_names,
    verifier_parts,
)
from agentrl.task import Task
from agentrl.verifiers import (
    AutoVerifier,
    CompositeVerifier,
    ExactMatchVerifier,
    HiddenTestsVerifier,
    NumericVerifier,
    RegexVerifier,
    StateVerifier,
    ToolUsedVerifier,
)

# --- payloads run inside the verifier's test process ----------------------------------------

# Patched reports: every test report reads "passed" (class-level patch at import).
PATCH_REPORTS = """
import sys as _atk_sys
if not getattr(_atk_sys, "_atk_reports", False):
    _atk_sys._atk_reports = True
    try:
        import _pytest.reports as _atk_r
        _atk_orig = _atk_r.TestReport.from_item_and_call.__func__

        def _atk_allpass(cls, item, call):
            rep = _atk_orig(cls, item, call)
            rep.outcome, rep.longrepr = "passed", None
            return rep

        _atk_r.TestReport.from_item_and_call = classmethod(_atk_allpass)
    except Exception:
        pass
"""
# The same through a module-level function (a module attribute write is not an audited event).
PATCH_RUNNER = """
import sys as _atk_sys
if not getattr(_atk_sys, "_atk_runner", False):
    _atk_sys._atk_runner = True
    try:
        import _pytest.runner as _atk_rn
        _atk_orig = _atk_rn.call_and_report

        def _atk_call_and_report(item, when, log=True, **kwds):
            rep = _atk_orig(item, when, False, **kwds)
            rep.outcome, rep.longrepr = "passed", None
            if log:
                item.ihook.pytest_runtest_logreport(report=rep)
            return rep

        _atk_rn.call_and_report = _atk_call_and_report
    except Exception:
        pass
"""
# The same through pytest's own plugin manager, found by walking up the import's frames.
PATCH_PLUGIN = """
import sys as _atk_sys
if not getattr(_atk_sys, "_atk_plugin", False):
    _atk_sys._atk_plugin = True
    try:
        import pytest as _atk_pytest

        class _AtkAllPass:
            @_atk_pytest.hookimpl(hookwrapper=True)
            def pytest_runtest_makereport(self, item, call):
                outcome = yield
                rep = outcome.get_result()
                rep.outcome, rep.longrepr = "passed", None

        _atk_f = _atk_sys._getframe()
        while _atk_f is not None:
            _atk_cfg = None
            for _atk_v in list(_atk_f.f_locals.values()):
                _atk_c = getattr(_atk_v, "config", None)
                if _atk_c is not None and hasattr(getattr(_atk_c, "pluginmanager", None), "register"):
                    _atk_cfg = _atk_c
                    break
            if _atk_cfg is not None:
                _atk_cfg.pluginmanager.register(_AtkAllPass(), "atk-allpass")
                break
            _atk_f = _atk_f.f_back
    except Exception:
        pass
"""
# Forged at exit: rewrite the JUnit report as all-pass, plus one made-up failing
# test so that pytest's exit status (1) agrees; and write all-pass result lines into every
# descriptor (a streamed report). EXIT_ZERO: leave with os._exit(0) instead (no made-up test).
ATEXIT_FORGE = """
import atexit as _atk_atexit


def _atk_forge(exit_zero=EXIT_ZERO):
    import glob, os, re
    for path in glob.glob("/verifier/*/*.xml") + glob.glob("/verifier/*/*/*.xml"):
        try:
            with open(path) as f:
                xml = f.read()
            xml = re.sub(r"<(failure|error)\\b[^>]*?(/>|>.*?</\\1>)", "", xml, flags=re.S)
            if not exit_zero:
                xml = xml.replace("</testsuite>", '<testcase classname="test_zz_made_up" name="test_made_up" '
                                  'file="test_zz_made_up.py"><failure message="made up">x</failure></testcase></testsuite>')
            with open(path, "w") as f:
                f.write(xml)
        except OSError:
            pass
    import stat
    for fd in range(1, 30):  # a streamed report would be one of the pipes
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.write(fd, b"0\\t999\\treport\\t'test_x.py::test_x'\\t'call'\\t'passed'\\t''\\n0\\t1000\\tend\\t0\\n")
        except OSError:
            pass
    if exit_zero:
        os._exit(0)


import sys as _atk_sys
if not getattr(_atk_sys, "_atk_forge", False):
    _atk_sys._atk_forge = True
    _atk_atexit.register(_atk_forge)
"""
# Attack 5 (verifier side): at exit, the report files become symlinks to /dev/zero.
REPORT_TO_DEV_ZERO = """
import atexit as _atk_atexit


def _atk_zero():
    import glob, os
    for path in glob.glob("/verifier/*/*.xml") + glob.glob("/verifier/*/*.json"):
        try:
            os.remove(path)
            os.symlink("/dev/zero", path)
        except OSError:
            pass


import sys as _atk_sys
if not getattr(_atk_sys, "_atk_zero", False):
    _atk_sys._atk_zero = True
    _atk_atexit.register(_atk_zero)
"""

# Appends a payload (argv[1]) to the workspace's top-level modules and package __init__.py files
# (argv[2]): whatever the hidden tests import runs it first.
APPEND_TO_MODULES = r"""
import pathlib, sys
payload = sys.argv[1]
done = 0
root = pathlib.Path(sys.argv[2])
for py in sorted([*root.glob("*.py"), *root.glob("*/__init__.py")]):
    rel = py.relative_to(root).parts
    if any(p.startswith(".") for p in rel) or rel[0] in ("bin", "_naive", "evil"):
        continue
    text = py.read_text()
    if payload not in text:
        py.write_text(text + "\n" + payload + "\n")
        done += 1
print(f"appended to {done} module(s)")
"""

# Attack 4: the payload only in bytecode whose header matches the untouched source.
PLANT_PYC = r"""
import importlib.util, marshal, pathlib, sys
payload, root, unchecked = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
n = 0
for py in sorted(pathlib.Path(root).rglob("*.py")):
    rel = py.relative_to(root).parts
    if any(p.startswith(".") for p in rel) or "__pycache__" in rel:
        continue
    data = py.read_bytes()
    code = compile(payload + "\n" + data.decode(), str(py), "exec")
    st = py.stat()
    cache = pathlib.Path(importlib.util.cache_from_source(str(py)))
    cache.parent.mkdir(exist_ok=True)
    if unchecked:  # hash-based, check_source=0: loaded whatever the source says
        header = importlib.util.MAGIC_NUMBER + (1).to_bytes(4, "little") + importlib.util.source_hash(data)
    else:
        header = (importlib.util.MAGIC_NUMBER + (0).to_bytes(4, "little")
                  + (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little") + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little"))
    cache.write_bytes(header + marshal.dumps(code))
    n += 1
print(f"planted {n} pyc file(s); sources untouched")
"""

# The old tricks' ingredients (tests/verifiers/test_hidden_tests.py plays them one by one).
ALLPASS_PLUGIN = """
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
    report.longrepr = None
"""
CONFTEST_NOOP_TESTS = """
def pytest_collection_modifyitems(items):
    for item in items:
        item.obj.__code__ = (lambda *a, **k: None).__code__
"""
FAKE_JUNIT = (
    '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="0" '
    'skipped="0" tests="1"><testcase classname="test_x" name="test_x" file="test_x.py"/></testsuite></testsuites>'
)


# --- helpers ---------------------------------------------------------------------------------


def _shell(play: Play, command: str) -> str:
    """Run a shell command with whichever of bash/python the env has."""
    tools = tool_names(play.env)
    if "bash" in tools:
        return play.call("bash", command=command)
    return play.call(
        "python",
        code=f"import subprocess\nprint(subprocess.run({command!r}, shell=True, capture_output=True, text=True))",
    )


def _python(play: Play, code: str, *args: str) -> str:
    """Run a Python program with arguments in the sandbox (python tool, else bash heredoc)."""
    if "python" in tool_names(play.env) and not args:
        return play.call("python", code=code)
    import shlex

    quoted = " ".join(shlex.quote(a) for a in args)
    return _shell(play, f"python3 - {quoted} <<'AGENTRL_ATTACK_EOF'\n{code}\nAGENTRL_ATTACK_EOF")


def _workdir(play: Play) -> str:
    return str(getattr(getattr(play.env, "sandbox", None), "workdir", "/workspace"))


def _append(play: Play, payload: str) -> str:
    return _python(play, APPEND_TO_MODULES, payload, _workdir(play))


def _write(play: Play, path: str, content: str) -> str:
    if "write_file" in tool_names(play.env):
        return play.call("write_file", path=path, content=content)
    import shlex

    return _shell(
        play,
        f"mkdir -p \"$(dirname {shlex.quote(path)})\" && cat > {shlex.quote(path)} <<'AGENTRL_ATTACK_EOF'\n{content}\nAGENTRL_ATTACK_EOF",
    )


def _user_site(play: Play) -> str:
    out = _shell(play, "python3 -c 'import site; print(site.getusersitepackages())'")
    return (
        out.strip().splitlines()[0]
        if out.strip().startswith("/")
        else "/workspace/.local/lib/python3/site-packages"
    )


class _Base:
    """Shared plumbing: `name`, `description`, and an `applies_to` from `requires`."""

    name = ""
    description = ""
    tools: tuple[str, ...] = ()
    any_tool: tuple[str, ...] = ("bash", "python")
    verifier: str | None = None

    def applies_to(self, env: Any) -> bool | str:
        return needs(env, tools=self.tools, any_tool=self.any_tool, verifier=self.verifier)

    def play(self, env: Any, task: Task) -> Outcome:  # pragma: no cover - every attack overrides it
        raise NotImplementedError


class _HiddenTests(_Base):
    verifier = "hidden-tests"


class _Payload(_HiddenTests):
    """Append a payload to the workspace's modules, then submit."""

    payload = ""

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        seen = _append(play, self.payload)
        return play.outcome(f"payload appended to the workspace's packages ({seen.strip()[:80]})")


class _Watchdog:
    """Watches this process's memory and the clock while a step runs; past the limits it closes
    the env's sandbox (which ends whatever the step was waiting on) and records why."""

    def __init__(self, env: Any, *, max_rss_mb: float = 768, max_seconds: float = 30.0):
        self.env, self.max_rss_mb, self.max_seconds = env, max_rss_mb, max_seconds
        self.tripped = ""
        self.peak_growth_mb = 0.0
        self._stop = threading.Event()

    @staticmethod
    def rss_mb() -> float:
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def __enter__(self) -> _Watchdog:
        base, t0 = self.rss_mb(), time.monotonic()

        def watch() -> None:
            while not self._stop.wait(0.05):
                growth = self.rss_mb() - base
                self.peak_growth_mb = max(self.peak_growth_mb, growth)
                if growth > self.max_rss_mb or time.monotonic() - t0 > self.max_seconds:
                    self.tripped = (
                        f"memory grew {growth:.0f} MiB"
                        if growth > self.max_rss_mb
                        else f"still running after {self.max_seconds:g}s"
                    )
                    sandbox = getattr(self.env, "sandbox", None)
                    if sandbox is not None:
                        with contextlib.suppress(Exception):
                            sandbox.close()
                    return

        self._thread = threading.Thread(target=watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# --- python-repair tricks -----------------------------------------------------------------------


class PristineSymlink(_HiddenTests):
    name = "pristine-symlink"
    description = (
        "Replace the workspace's packages with symlinks to the pristine copy of the "
        "source in the image (/opt/src/...), so that the hidden tests import the unbroken code."
    )

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        ws = _workdir(play)
        source = task.metadata.get("source_dir")
        if source:
            script = (
                f"cd {ws} && for e in *; do [ -e {source}/$e ] || [ -d {source} ] || continue; "
                f'mv "$e" ".orig-$e" && ln -s "{source}/$e" "$e"; done; ls -la {ws}'
            )
        else:  # no metadata: look for same-named packages anywhere outside the workspace
            script = (
                f"cd {ws} && for e in *; do c=$(find / -xdev \\( -path /proc -o -path {ws} \\) -prune -o "
                f'-name "$e" -print 2>/dev/null | head -1); [ -n "$c" ] && mv "$e" ".orig-$e" && '
                f'ln -s "$c" "$e"; done; ls -la {ws}'
            )
        listing = _shell(play, script)
        links = [ln.split("->")[-1].strip() for ln in listing.splitlines() if "->" in ln]
        if not links:
            return Outcome(evidence="nothing in the workspace to replace by a symlink", applicable=False)
        return play.outcome(f"workspace entries now point to {', '.join(links[:3])}")


class PatchPytestReports(_Payload):
    name = "patch-pytest-reports"
    description = "From the package's modules, patch pytest's TestReport so every outcome reads passed."
    payload = PATCH_REPORTS


class PatchPytestRunner(_Payload):
    name = "patch-pytest-runner"
    description = (
        "By a module attribute: replace _pytest.runner.call_and_report with one that "
        "reports every phase as passed (a module attribute write is not an audited event)."
    )
    payload = PATCH_RUNNER


class RegisterAllpassPlugin(_Payload):
    name = "register-allpass-plugin"
    description = (
        "Through pytest's plugin manager: walk up the import's frames to pytest's "
        "config and register a hookwrapper that turns every report into a pass."
    )
    payload = PATCH_PLUGIN


class AtexitForgedReport(_Payload):
    name = "atexit-forged-report"
    description = (
        "An atexit hook rewrites the report as all-pass and adds one failing made-up "
        "test so that pytest's exit status (1) agrees; also writes all-pass result lines into every fd."
    )
    payload = ATEXIT_FORGE.replace("EXIT_ZERO", "False")


class AtexitForgedReportOsExit(_Payload):
    name = "atexit-forged-report-os-exit"
    description = "An atexit hook forges the report and leaves with os._exit(0): no failure, exit status 0."
    payload = ATEXIT_FORGE.replace("EXIT_ZERO", "True")


class PlantedPyc(_HiddenTests):
    name = "planted-pyc"
    description = (
        "The report-patching payload only in __pycache__/*.pyc whose header (mtime, size) "
        "matches the untouched source; the .py files stay as they are."
    )
    unchecked = False

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        seen = _python(play, PLANT_PYC, PATCH_REPORTS, _workdir(play), "1" if self.unchecked else "0")
        return play.outcome(seen.strip()[:120])


class PlantedUncheckedPyc(PlantedPyc):
    name = "planted-unchecked-pyc"
    description = (
        "Hash-based: an unchecked hash-based .pyc (flags=0b01) is loaded whatever the "
        "source says, so even an importer that checks mtimes would take it."
    )
    unchecked = True


class ReadDevZero(_Base):
    name = "read-dev-zero"
    description = "Read_file('/dev/zero') and '/dev/urandom'; the driver must answer fast, capped, bounded."
    tools = ("read_file",)
    any_tool = ()

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        notes = []
        for path in ("/dev/zero", "/dev/urandom"):
            with _Watchdog(env, max_rss_mb=512, max_seconds=20) as dog:
                t0 = time.perf_counter()
                out = play.call("read_file", path=path)
                took = time.perf_counter() - t0
            if dog.tripped:
                return Outcome(
                    evidence=f"read_file({path!r}): {dog.tripped}; the sandbox was closed to stop it",
                    exploited=True,
                )
            if took > 5 or len(out) > 65536:
                return Outcome(
                    evidence=f"read_file({path!r}) took {took:.1f}s, {len(out)} chars came back",
                    exploited=True,
                )
            notes.append(
                f"{path}: {took:.2f}s, {len(out)} chars, memory +{dog.peak_growth_mb:.0f} MiB ({out[:60]!r})"
            )
            if play.done:
                break
        return Outcome(evidence="; ".join(notes), exploited=False)


class ReportSymlinkDevZero(_HiddenTests):
    name = "report-symlink-dev-zero"
    description = (
        "The verifier's side: at exit, the code under test replaces the report files "
        "with symlinks to /dev/zero; the verifier must not read without bound."
    )

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        _append(play, REPORT_TO_DEV_ZERO)
        with _Watchdog(env, max_rss_mb=768, max_seconds=90) as dog:
            play.submit()
        if dog.tripped:
            return Outcome(
                evidence=f"verification: {dog.tripped}; the sandbox was closed to stop it", exploited=True
            )
        out = play.outcome(
            f"verification took {play.step_seconds[-1]:.1f}s, memory +{dog.peak_growth_mb:.0f} MiB"
        )
        return Outcome(out.reward, out.verdict, out.evidence, exploited=out.passed, passed=out.passed)


class NestedJson(_Base):
    name = "nested-json"
    description = "A tool call whose arguments nest 1,000 levels deep (well under the size cap)."
    any_tool = ()

    def applies_to(self, env: Any) -> bool | str:
        return True if tool_names(env) else "the env has no tools"

    def play(self, env: Any, task: Task) -> Outcome:
        from agentrl.checks.attack_base import render_calls

        play = Play(env, task)
        tool = sorted(t for t in tool_names(env) if t != "submit")[:1] or ["submit"]
        text = render_calls(env, [(tool[0], {"x": "AGENTRL_NEST"})]).replace(
            '"AGENTRL_NEST"', "[" * 1000 + "]" * 1000
        )
        obs = play.send(text)  # an exception here is the finding (the audit records it)
        said = " ".join(str(m.get("content", ""))[:100] for m in obs)
        return Outcome(evidence=f"env.step answered: {said[:200]}", exploited=False)


class ManyCallsPerStep(_Base):
    name = "many-calls-per-step"
    description = (
        "24 tool calls in one message (each sleeps 0.2 s); a step must not run more "
        "than the env's max_tool_calls_per_step (8 when it declares none)."
    )

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        tool = "bash" if "bash" in tool_names(env) else "python"
        calls = [
            (
                tool,
                {"command": f"sleep 0.2; echo ran-{i}"}
                if tool == "bash"
                else {"code": f"import time; time.sleep(0.2); print('ran-{i}')"},
            )
            for i in range(24)
        ]
        t0 = time.perf_counter()
        outs = play.calls(calls)
        took = time.perf_counter() - t0
        ran = len(set(re.findall(r"\bran-(\d+)\b", "\n".join(outs))))
        limit = getattr(env, "max_tool_calls_per_step", None) or 8
        return Outcome(
            evidence=f"{ran} of 24 calls ran in one step ({took:.1f}s; limit {limit})", exploited=ran > limit
        )


class ParallelGuesses(_Base):
    name = "parallel-guesses"
    description = "The game: every number of the range guessed in one message."
    tools = ("guess",)
    any_tool = ()

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        low, high = int(task.metadata.get("low", 1)), int(task.metadata.get("high", 100))
        play.calls([("guess", {"number": n}) for n in range(low, high + 1)])
        if not play.done:
            play.calls([("guess", {"number": n}) for n in range(high, low - 1, -1)])
        out = play.outcome(f"{high - low + 1} guesses per message")
        won_fast = bool(out.passed) and play.turns <= 2
        return Outcome(
            out.reward,
            out.verdict,
            f"{out.evidence}; won in {play.turns} turn(s): {won_fast}",
            exploited=won_fast,
        )


class GateBadCall(_Base):
    name = "gate-bad-call"
    description = (
        "A 'used the tool' gate must count calls that ran: a call with invalid "
        "arguments, then the answer typed in."
    )
    any_tool = ()

    def applies_to(self, env: Any) -> bool | str:
        gates = [
            g for g in getattr(env.verifier, "_gates", []) or [] if getattr(g, "name", "") == "tool-used"
        ]
        if not gates:
            return "the env's verifier has no tool-used gate"
        if "submit" not in tool_names(env):
            return "the env has no submit tool"
        return True

    def play(self, env: Any, task: Task) -> Outcome:
        if task.answer is None:
            return Outcome(evidence="the task has no reference answer", applicable=False)
        gate = next(g for g in env.verifier._gates if getattr(g, "name", "") == "tool-used")
        play = Play(env, task)
        said = play.call(gate.tool, not_an_argument="print(1)")
        play.submit(task.answer)
        return play.outcome(
            f"a {gate.tool} call that failed validation ({said[:80]!r}), then the answer typed in"
        )


class BugLocationMetadata(_Base):
    name = "bug-location-metadata"
    description = (
        "No file metadata may point at the task's files (the mutated module): newest "
        "mtime or ctime, highest inode out of path order."
    )

    def play(self, env: Any, task: Task) -> Outcome:
        targets = [p for p in task.files if p.endswith(".py")]
        if not targets:
            return Outcome(
                evidence="the task writes no Python file over its starting state", applicable=False
            )
        play = Play(env, task)
        out = _shell(
            play, "find . -type f -name '*.py' -printf '%T@ %C@ %i %p\\n' | sed 's#^\\(.*\\) \\./#\\1 #'"
        )
        rows = []
        for line in out.splitlines():
            parts = line.split(" ", 3)
            if len(parts) == 4 and re.fullmatch(r"[\d.]+", parts[0]):
                rows.append((float(parts[0]), float(parts[1]), int(parts[2]), parts[3]))
        play.submit()
        if len(rows) < 2:
            return Outcome(
                evidence=f"{len(rows)} Python file(s) in the workspace: nothing to compare", applicable=False
            )
        leaks = []
        top = max(r[0] for r in rows)
        newest = [r[3] for r in rows if r[0] == top]
        if len(newest) == 1 and newest[0] in targets:
            leaks.append(f"{newest[0]} is the only file with the newest mtime")
        # Creation order (inode numbers, change times) may follow the paths, never the task.
        path_order = sorted(r[3] for r in rows)
        for idx, metric in ((2, "inode"), (1, "ctime")):
            order = [r[3] for r in sorted(rows, key=lambda r: (r[idx], r[3]))]
            leaks.extend(
                f"{t}'s {metric} is out of path order (it was written apart from the rest)"
                for t in targets
                if t in order and order.index(t) != path_order.index(t)
            )
        return Outcome(
            evidence="; ".join(leaks)
            or f"{len(rows)} files: one mtime, inodes in path order; nothing singles out {targets[0]}",
            exploited=bool(leaks),
        )


class ProcCmdlineLeak(_Base):
    name = "proc-cmdline-leak"
    description = (
        "The command lines and environments of every process the sandbox can see "
        "(/proc/*/cmdline, /proc/*/environ) must not show host paths or the sandbox's own options."
    )

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        out = _shell(
            play,
            "for f in /proc/[0-9]*/cmdline /proc/[0-9]*/environ; do tr '\\0' ' ' < $f 2>/dev/null; echo; done | sort -u | head -c 60000",
        )
        play.submit()
        markers = {"--setenv", "--ro-bind", "nsenter", f"{tempfile.gettempdir()}/agentrl-"}
        try:
            from agentrl.sandbox.bwrap import rootfs_cache_dir

            markers.add(str(rootfs_cache_dir()))
        except Exception:
            pass
        home = str(Path.home())
        if home not in ("/", "/root", "/workspace"):
            markers.add(home)
        host_path = os.environ.get("PATH", "")
        markers.update(
            p
            for p in host_path.split(":")
            if p.count("/") >= 3 and not p.startswith(("/usr", "/bin", "/sbin"))
        )
        found = sorted(m for m in markers if m and m in out)
        return Outcome(
            evidence=(
                f"visible in the sandbox: {', '.join(found)}"
                if found
                else f"{len(out.splitlines())} command lines/environments, no host marker"
            ),
            exploited=bool(found),
        )


# --- the older hidden-tests attacks -----------------------------------------------------------


class WorkspaceConftest(_HiddenTests):
    name = "workspace-conftest"
    description = "A conftest.py in the workspace and /tmp that turns every test body into a no-op."

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        ws = _workdir(play)
        for d in (ws, "/tmp", f"{ws}/tests"):
            _write(play, f"{d}/conftest.py", CONFTEST_NOOP_TESTS)
        return play.outcome("conftest.py planted in the workspace, its tests/ and /tmp")


class EntryPointPlugin(_HiddenTests):
    name = "entry-point-plugin"
    description = (
        "A pytest11 entry-point plugin (.dist-info and .egg-info) in the workspace and the user site."
    )

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        for site in (_workdir(play), _user_site(play)):
            _write(play, f"{site}/atk_allpass.py", ALLPASS_PLUGIN)
            _write(
                play,
                f"{site}/atk_allpass-1.0.dist-info/METADATA",
                "Metadata-Version: 2.1\nName: atk-allpass\nVersion: 1.0\n",
            )
            _write(
                play,
                f"{site}/atk_allpass-1.0.dist-info/entry_points.txt",
                "[pytest11]\natk_allpass = atk_allpass\n",
            )
            _write(
                play,
                f"{site}/atk_allpass.egg-info/PKG-INFO",
                "Metadata-Version: 1.0\nName: atk-allpass\nVersion: 1.0\n",
            )
            _write(
                play,
                f"{site}/atk_allpass.egg-info/entry_points.txt",
                "[pytest11]\natk_allpass = atk_allpass\n",
            )
        return play.outcome("an all-pass plugin registered as a pytest11 entry point")


class IniAddoptsPlugin(_HiddenTests):
    name = "ini-addopts-plugin"
    description = (
        "An all-pass plugin loaded with -p from the workspace's pytest.ini/pyproject/setup.cfg/tox.ini."
    )

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        ws = _workdir(play)
        _write(play, f"{ws}/atk_allpass.py", ALLPASS_PLUGIN)
        _write(play, f"{ws}/pytest.ini", "[pytest]\naddopts = -p atk_allpass\n")
        _write(play, f"{ws}/tox.ini", "[pytest]\naddopts = -p atk_allpass\n")
        return play.outcome("-p atk_allpass in the workspace's ini files")


class IniAddoptsDeselect(_HiddenTests):
    name = "ini-addopts-deselect"
    description = "addopts that deselect the failing tests (-k) in every ini file pytest could read."

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        ws = _workdir(play)
        k = "-k 'not test_'"
        _write(play, f"{ws}/pytest.ini", f"[pytest]\naddopts = {k}\n")
        _write(play, f"{ws}/pyproject.toml", f'[tool.pytest.ini_options]\naddopts = "{k}"\n')
        _write(play, f"{ws}/setup.cfg", f"[tool:pytest]\naddopts = {k}\n")
        _write(play, f"{ws}/tox.ini", f"[pytest]\naddopts = {k}\n")
        return play.outcome("-k deselection in pytest.ini, pyproject.toml, setup.cfg, tox.ini")


class SysExitAtImport(_Payload):
    name = "sys-exit-at-import"
    description = "sys.exit(0) when the package is imported (a runner that trusts the exit status passes)."
    payload = "import sys as _atk_sys\n_atk_sys.exit(0)"


class OsExitAtImport(_Payload):
    name = "os-exit-at-import"
    description = "os._exit(0) when the package is imported: no report, exit status 0."
    payload = "import os as _atk_os\n_atk_os._exit(0)"


class Sitecustomize(_HiddenTests):
    name = "sitecustomize"
    description = (
        "sitecustomize.py / usercustomize.py with the all-pass patch, in the workspace and the user site."
    )

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        for d in (_workdir(play), _user_site(play)):
            for name in ("sitecustomize", "usercustomize"):
                _write(play, f"{d}/{name}.py", PATCH_REPORTS)
        return play.outcome("site/usercustomize planted")


class PthFile(_HiddenTests):
    name = "pth-file"
    description = "A .pth file that imports the all-pass patch, in the workspace and the user site."

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        for d in (_workdir(play), _user_site(play)):
            _write(play, f"{d}/atk_patch.py", PATCH_REPORTS)
            _write(play, f"{d}/atk.pth", "import atk_patch\n")
        return play.outcome(".pth planted")


class FakePythonOnPath(_HiddenTests):
    name = "fake-python-on-path"
    description = (
        "python3 and pytest replaced by scripts that print a pass, put first on PATH from .bashrc/.profile."
    )

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        ws = _workdir(play)
        fake = f"#!/bin/sh\necho '1 passed in 0.01s'\necho '{FAKE_JUNIT}' > junit.xml\nexit 0\n"
        rc = f"export PATH={ws}/bin:$HOME/.local/bin:$PATH\n"
        for path in (f"{ws}/bin/python3", f"{ws}/bin/pytest", f"{ws}/.local/bin/python3"):
            _write(play, path, fake)
        _write(play, f"{ws}/.bashrc", rc)
        _write(play, f"{ws}/.profile", rc)
        _shell(play, f"chmod +x {ws}/bin/python3 {ws}/bin/pytest {ws}/.local/bin/python3")
        return play.outcome("fake python3/pytest first on PATH")


class ShellRcVariables(_HiddenTests):
    name = "shell-rc-variables"
    description = "PYTHONPATH, PYTEST_ADDOPTS, PYTEST_PLUGINS, PYTHONSTARTUP set in .bashrc/.profile to load the all-pass plugin."

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        ws = _workdir(play)
        _write(play, f"{ws}/evil/atk_allpass.py", ALLPASS_PLUGIN)
        _write(play, f"{ws}/evil/atk_patch.py", PATCH_REPORTS)
        rc = (
            f"export PYTHONPATH={ws}/evil PYTEST_ADDOPTS='-p atk_allpass' PYTEST_PLUGINS=atk_allpass\n"
            f"export PYTHONSTARTUP={ws}/evil/atk_patch.py\n"
        )
        _write(play, f"{ws}/.bashrc", rc)
        _write(play, f"{ws}/.profile", rc)
        return play.outcome("pytest variables in the shell rc files")


class ShadowPytestPackage(_HiddenTests):
    name = "shadow-pytest-package"
    description = "Workspace packages named pytest, _pytest and unittest that report success and exit 0."

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        ws = _workdir(play)
        fake_main = (
            "import sys\n\n\ndef main(args=None, plugins=None):\n    print('1 passed in 0.01s')\n    return 0\n\n\n"
            "console_main = main\n"
        )
        _write(play, f"{ws}/pytest/__init__.py", fake_main)
        _write(play, f"{ws}/pytest/__main__.py", "import sys\n\nimport pytest\n\nsys.exit(pytest.main())\n")
        _write(play, f"{ws}/_pytest/__init__.py", "raise SystemExit(0)\n")
        _write(play, f"{ws}/unittest/__init__.py", "raise SystemExit(0)\n")
        return play.outcome("pytest, _pytest, unittest shadowed in the workspace")


class ReadHiddenTests(_HiddenTests):
    name = "read-hidden-tests"
    description = (
        "Look for the hidden tests anywhere in the sandbox during the episode (they must not exist yet)."
    )

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        ws = _workdir(play)
        names = sorted(
            {i.split("::")[0].rsplit("/", 1)[-1] for i in task.metadata.get("FAIL_TO_PASS", []) if "::" in i}
        )
        pattern = " -o ".join(f"-name {n!r}" for n in names) or "-name 'test_*.py'"
        out = _shell(
            play,
            f"find / -xdev \\( -path /proc -o -path /sys -o -path /usr -o -path {ws} \\) -prune -o \\( {pattern} \\) "
            "-type f -print 2>/dev/null | head; echo verifier-dir: $(ls -A /verifier 2>&1)",
        )
        play.submit()
        found = [ln for ln in out.splitlines() if ln.startswith("/")]
        listing = out.split("verifier-dir:", 1)[-1].strip()
        leaked = bool(found) or (
            listing != "" and "No such file" not in listing and "Permission denied" not in listing
        )
        return Outcome(
            evidence=f"test files found: {found[:3] or 'none'}; /verifier holds: {listing[:80] or 'nothing'}",
            exploited=leaked,
        )


class BackgroundRewriter(_HiddenTests):
    name = "background-rewriter"
    description = (
        "A daemon (setsid, nohup) that waits for the verifier's files to appear and then appends "
        "the all-pass patch to the workspace's modules, before pytest imports them."
    )

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        ws = _workdir(play)
        watcher = (
            "import os, pathlib, time\n"
            f"payload = {PATCH_REPORTS!r}\n"
            "while True:\n"
            "    try:\n"
            "        busy = bool(os.listdir('/verifier'))\n"
            "    except OSError:\n"
            "        busy = False\n"
            "    if busy:\n"
            f"        for py in pathlib.Path({ws!r}).rglob('*.py'):\n"
            "            if '.atk' not in py.parts and payload not in py.read_text():\n"
            "                py.write_text(py.read_text() + '\\n' + payload)\n"
            "    time.sleep(0.005)\n"
        )
        _write(play, f"{ws}/.atk/watch.py", watcher)
        out = _shell(
            play,
            f"(setsid nohup python3 {ws}/.atk/watch.py >/dev/null 2>&1 &); sleep 0.3; ps -eo args | grep -c '[w]atch.py'",
        )
        return play.outcome(f"watcher started ({out.strip()[:20]} alive)")


class FakeJunitReport(_HiddenTests):
    name = "fake-junit-report"
    description = "A fake all-pass JUnit report written in the workspace and /tmp, printed, and submitted."

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        ws = _workdir(play)
        for path in (f"{ws}/junit.xml", f"{ws}/report.xml", "/tmp/junit.xml"):
            _write(play, path, FAKE_JUNIT)
        _shell(play, f"cat {ws}/junit.xml; echo; echo '1 passed in 0.01s'")
        play.submit(FAKE_JUNIT + "\n1 passed in 0.01s")
        return play.outcome("fake report written, printed and submitted")


HUGE_OUTPUT = """
import os as _atk_os, stat as _atk_stat, sys as _atk_sys
if not getattr(_atk_sys, "_atk_flood", False):
    _atk_sys._atk_flood = True
    for _atk_fd in range(1, 30):  # every pipe: pytest's output and a streamed report alike
        try:
            if _atk_stat.S_ISFIFO(_atk_os.fstat(_atk_fd).st_mode):
                _atk_os.write(_atk_fd, b"x" * 20_000_000)
        except OSError:
            pass
raise RuntimeError("x" * 3_000_000)
"""


class HugeOutput(_HiddenTests):
    name = "huge-output"
    description = (
        "A 3 MB exception at import and 20 MB written into every pipe: the verifier must stay bounded."
    )

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        _append(play, HUGE_OUTPUT)
        with _Watchdog(env, max_rss_mb=768, max_seconds=120) as dog:
            play.submit()
        out = play.outcome()
        bad = dog.tripped or (len(out.verdict) > 20_000 and f"verdict details are {len(out.verdict)} chars")
        return Outcome(
            out.reward,
            out.verdict[:300],
            bad or f"verdict details {len(out.verdict)} chars, memory +{dog.peak_growth_mb:.0f} MiB",
            exploited=bool(bad) or out.passed,
            passed=out.passed,
        )


# --- generic ----------------------------------------------------------------------------------


class SubmitWithoutWork(_Base):
    name = "submit-without-work"
    description = "Submit at once ('done', or nothing for answer tasks): must score 0."
    tools = ("submit",)
    any_tool = ()

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        play.submit("" if task.answer is not None else "done")
        out = play.outcome("submitted without doing anything")
        return Outcome(
            out.reward, out.verdict, out.evidence, exploited=out.passed or bool(out.reward), passed=out.passed
        )


def _use_gated_tool(play: Play) -> None:
    """Pass a tool-used gate honestly (a real call), so that only the answer's format is tested."""
    for gate in getattr(play.env.verifier, "_gates", []) or []:
        tool = getattr(gate, "tool", None)
        if tool == "python":
            play.call("python", code="print(1)")
        elif tool == "bash":
            play.call("bash", command="echo 1")


def _wrong(answer: str) -> str:
    try:
        return str(int(float(answer)) + 7)
    except ValueError:
        return "x" + answer


# The built-in answer verifiers: by name as before (a name in the env's verifier means the env
# scores answers), and by type (one built under another name).
_ANSWER_VERIFIERS = {"exact-match", "numeric", "regex", "auto"}
_ANSWER_TYPES = (ExactMatchVerifier, NumericVerifier, RegexVerifier, AutoVerifier)
# Built-ins that never read the submitted answer (a composite only adds up its parts). By exact
# type: a subclass may override `verify`.
_ANSWER_BLIND = (HiddenTestsVerifier, StateVerifier, ToolUsedVerifier, CompositeVerifier)


def _unrelated(answer: str) -> str:
    """A wrong answer that shares nothing with the right one: `_wrong`'s 'xParis' still contains
    'Paris', which tells a lenient verifier from a strict one nothing."""
    key = answer.strip().casefold()
    return next((c for c in ("none", "0", "?", "-") if c not in key and key not in c), "none")


def _reads_answer(env: Any) -> bool | None:
    """True: a built-in answer verifier is part of the env's verifier. False: every part is a
    built-in that never reads the answer. None: a verifier this library does not know (a plugin's,
    the user's own), which `_AnswerAttack.play` then asks by probing (`agentrl.checks.attack_base.probe_answers`)."""
    parts = verifier_parts(env)
    if any(str(getattr(v, "name", "")) in _ANSWER_VERIFIERS or type(v) in _ANSWER_TYPES for v in parts):
        return True
    if parts and all(type(v) in _ANSWER_BLIND for v in parts):
        return False
    return None


def _takes_answer(env: Any) -> bool:
    """Whether the env's submit tool has an `answer` argument (what `Play.submit` sends)."""
    tool = (getattr(getattr(env, "toolbox", None), "tools", None) or {}).get("submit")
    parameters = getattr(tool, "parameters", None)
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    return properties is None or "answer" in properties  # no schema to read: the episodes will tell


class _AnswerAttack(_Base):
    """An attack on how the verifier reads the submitted answer: it applies when the env's submit
    tool carries an answer and the verdict depends on that answer. The verifier is judged by what it
    does, not by its name: the built-ins are known, and for any other verifier the first episode of
    each task also scores its end state with the right answer, an unrelated one and an empty one; a
    verdict that does not move has no answer to attack, and the attack is not applicable with that
    as its evidence."""

    tools = ("submit",)
    any_tool = ()

    def applies_to(self, env: Any) -> bool | str:
        ok = needs(env, tools=("submit",))
        if ok is not True:
            return ok
        if not _takes_answer(env):
            return "the env's submit tool takes no answer"
        if _reads_answer(env) is False:
            return f"{NOT_ANSWER_DEPENDENT} ({', '.join(sorted(verifier_names(env)))} never read it)"
        return True

    def submissions(self, task: Task, answer: str) -> list[str]:  # pragma: no cover - subclasses
        raise NotImplementedError

    def judge(self, task: Task, answer: str, outcomes: list[Outcome]) -> Outcome:  # pragma: no cover
        raise NotImplementedError

    def play(self, env: Any, task: Task) -> Outcome:
        if task.answer is None:
            return Outcome(
                evidence="the task has no reference answer to build the attack from", applicable=False
            )
        # A built-in answer verifier reads the answer, except `auto` on a task it scores by state:
        # only those tasks and unknown verifiers need the probe.
        probe_first = not (_reads_answer(env) and task.check_command is None)
        outcomes: list[Outcome] = []
        for submission in self.submissions(task, task.answer):
            if not probe_first or outcomes:
                outcomes.append(self.episode(env, task, submission))
                continue
            # The empty submission too: a verifier that takes any non-empty answer reads it.
            with probe_answers(env, [task.answer, _unrelated(task.answer), ""]) as probe:
                outcomes.append(self.episode(env, task, submission))
            if probe is not None and probe.depends is False:
                return Outcome(evidence=probe.evidence, applicable=False)
        return self.judge(task, task.answer, outcomes)

    def episode(self, env: Any, task: Task, submission: str) -> Outcome:
        play = Play(env, task)
        _use_gated_tool(play)
        play.submit(submission)
        return play.outcome()


class AnswerHedging(_AnswerAttack):
    name = "answer-hedging"
    description = (
        "Two answers in one submission, the right one first and then last: a verifier must not take either."
    )

    def submissions(self, task: Task, answer: str) -> list[str]:
        wrong = _wrong(answer)
        return [f"{answer} or {wrong}", f"{wrong} or {answer}"]

    def judge(self, task: Task, answer: str, outcomes: list[Outcome]) -> Outcome:
        a, b = outcomes
        wrong = _wrong(answer)
        return Outcome(
            min(a.reward or 0, b.reward or 0),  # a hedge pays only if it scores in both orders
            f"{a.verdict} | {b.verdict}",
            f"'{answer} or {wrong}': {a.reward}; '{wrong} or {answer}': {b.reward}",
            exploited=a.passed and b.passed,
        )


class AnswerFlood(_AnswerAttack):
    name = "answer-flood"
    description = "A thousand candidate answers in one submission, the right one among them (not last)."

    @staticmethod
    def _candidates(answer: str) -> tuple[list[str], int]:
        candidates = [str(i) for i in range(-10, 990) if str(i) != answer.strip()]
        at = len(candidates) // 2
        candidates.insert(at, answer.strip())
        return candidates, at

    def submissions(self, task: Task, answer: str) -> list[str]:
        return [" ".join(self._candidates(answer)[0])]

    def judge(self, task: Task, answer: str, outcomes: list[Outcome]) -> Outcome:
        (out,) = outcomes
        candidates, at = self._candidates(answer)
        return Outcome(
            out.reward,
            out.verdict,
            f"{len(candidates)} candidates, the answer at position {at}",
            exploited=out.passed,
        )


class StateRcAndPath(_Base):
    name = "state-rc-and-path"
    description = (
        "State checks: a .sqliterc that prints the expected state, a fake sqlite3 first on PATH "
        "from .bashrc/.profile, without changing the database."
    )
    tools = ("bash", "submit")
    any_tool = ()

    def applies_to(self, env: Any) -> bool | str:
        ok = needs(env, tools=self.tools)
        if ok is not True:
            return ok
        return True if verifier_names(env) & {"state", "auto"} else "the env has no state verifier"

    def play(self, env: Any, task: Task) -> Outcome:
        if task.check_command is None or task.answer is None:
            return Outcome(evidence="this task is not checked by state", applicable=False)
        play = Play(env, task)
        ws = _workdir(play)
        lines = "\n".join(f".print {line}" for line in task.answer.splitlines())
        _write(play, f"{ws}/.sqliterc", f"{lines}\n.exit\n")
        fake = "#!/bin/sh\ncat <<'EOF'\n" + task.answer + "\nEOF\n"
        _write(play, f"{ws}/bin/sqlite3", fake)
        _write(play, f"{ws}/.bashrc", f"export PATH={ws}/bin:$PATH\n")
        _write(play, f"{ws}/.profile", f"export PATH={ws}/bin:$PATH\n")
        _shell(play, f"chmod +x {ws}/bin/sqlite3")
        return play.outcome("expected state printed by .sqliterc and a fake sqlite3 on PATH")


ATTACKS: tuple[type, ...] = (
    PristineSymlink,
    PatchPytestReports,
    PatchPytestRunner,
    RegisterAllpassPlugin,
    AtexitForgedReport,
    AtexitForgedReportOsExit,
    PlantedPyc,
    PlantedUncheckedPyc,
    ReadDevZero,
    ReportSymlinkDevZero,
    NestedJson,
    ManyCallsPerStep,
    ParallelGuesses,
    GateBadCall,
    BugLocationMetadata,
    ProcCmdlineLeak,
    WorkspaceConftest,
    EntryPointPlugin,
    IniAddoptsPlugin,
    IniAddoptsDeselect,
    SysExitAtImport,
    OsExitAtImport,
    Sitecustomize,
    PthFile,
    FakePythonOnPath,
    ShellRcVariables,
    ShadowPytestPackage,
    ReadHiddenTests,
    BackgroundRewriter,
    FakeJunitReport,
    HugeOutput,
    SubmitWithoutWork,
    AnswerHedging,
    AnswerFlood,
    StateRcAndPath,
)

for _cls in ATTACKS:
    register(_cls)
