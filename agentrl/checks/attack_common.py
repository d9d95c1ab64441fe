"""What the built-in attacks share: running a command or a Python program in the sandbox through whichever
of the env's tools it has, writing a file there, appending a payload to the workspace's modules, the
attacks' base classes, and a watchdog on this process's memory and clock while a step runs.

Payloads that must run inside the test process are appended to the workspace's top-level modules and
package `__init__.py` files (what every hidden test imports); each runs once per process.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

from agentrl.checks.attack_base import Outcome, Play, needs, tool_names
from agentrl.core.task import Task

# --- payloads every family uses --------------------------------------------------------------

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


# --- running things in the sandbox -----------------------------------------------------------


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


# --- base classes and the watchdog -----------------------------------------------------------


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
