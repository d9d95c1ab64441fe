"""The python-repair tricks of the audit's library (`pristine-symlink` ... `proc-cmdline-leak`): tricks that
once scored reward 1 without a fix on `agentrl/python-repair-v0`, or broke an env's contract; one per
trick that goes through `env.step`. `agentrl.checks.attacks` registers them.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from agentrl.checks.attack_base import Outcome, Play, tool_names
from agentrl.checks.attack_common import (
    PATCH_REPORTS,
    _append,
    _Base,
    _HiddenTests,
    _Payload,
    _python,
    _shell,
    _Watchdog,
    _workdir,
)
from agentrl.core.task import Task

# --- payloads run inside the verifier's test process ----------------------------------------

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


# Against the verifier's reader: at exit, the report files become symlinks to /dev/zero (an endless read).
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

# The payload only in bytecode whose header matches the untouched source (the source reads clean).
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


# --- the tricks ----------------------------------------------------------------------------------


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
