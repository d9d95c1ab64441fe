"""The `state` verifier: after the episode, a command's output must equal the task's expected answer.

Used for tasks that ask the agent to *change* something (a database row, a file) rather
than to answer. The agent's processes are killed first so nothing it left running can alter
the state while it is read, and the command runs with a clean environment (no rc files, no
user site, a fixed PATH), so nothing the agent wrote in its workspace (a `.sqliterc`, a
`sitecustomize.py`) is picked up. It runs as the sandbox's verifier identity, not as root:
it reads what the agent left, but a workspace file the agent turned into a symlink to
something root-only (an answer key in the image) reads as a permission error, not as the
secret (no confused deputy).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agentrl.core.episode import Episode
from agentrl.core.task import Task
from agentrl.sandbox.base import Sandbox
from agentrl.verifiers.base import Verdict

# The agent's home is the workspace: never let its dotfiles or Python path leak into the check.
CLEAN_ENV = {
    "HOME": "/nonexistent",
    "PYTHONPATH": "",
    "PYTHONSTARTUP": "",
    "PYTHONNOUSERSITE": "1",
    "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
    "LC_ALL": "C.UTF-8",
}


@dataclass
class StateVerifier:
    """Passes when `task.check_command`, run after the episode, prints exactly `task.answer`."""

    timeout_s: float = 60.0
    name: str = "state"

    def verify(self, sandbox: Sandbox | None, task: Task, episode: Episode) -> Verdict:
        if sandbox is None:
            return Verdict(0.0, False, "the state verifier needs a sandbox")
        if task.check_command is None or task.answer is None:
            return Verdict(
                0.0, False, f"task {task.id} needs check_command and answer for the state verifier"
            )
        sandbox.kill_agent_processes()
        res = sandbox.exec(
            ["/bin/sh", "-c", task.check_command], timeout=self.timeout_s, env=CLEAN_ENV, as_verifier=True
        )
        if res.timed_out:
            return Verdict(0.0, False, f"state check timed out after {self.timeout_s:g}s")
        if res.exit_code != 0:
            return Verdict(
                0.0, False, f"state check failed (exit {res.exit_code}): {res.stderr.strip()[-500:]}"
            )
        got = res.stdout.strip()
        want = task.answer.strip()
        ok = got == want
        return Verdict(
            float(ok), ok, "state matches" if ok else f"state is {got[:300]!r}, expected {want[:300]!r}"
        )


@dataclass
class AutoVerifier:
    """Per task: `state` when the task has a check command, else `numeric` for a numeric answer, else `exact-match`."""

    rel_tol: float = 1e-6
    name: str = "auto"

    def verify(self, sandbox: Sandbox | None, task: Task, episode: Episode) -> Verdict:
        from agentrl.verifiers.answer import ExactMatchVerifier, NumericVerifier

        if task.check_command is not None:
            return StateVerifier().verify(sandbox, task, episode)
        if task.answer is not None and re.fullmatch(r"-?\d+(?:\.\d+)?", task.answer.strip()):
            return NumericVerifier(rel_tol=self.rel_tol).verify(sandbox, task, episode)
        return ExactMatchVerifier().verify(sandbox, task, episode)
