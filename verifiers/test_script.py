"""The `test-script` verifier: Harbor's contract, run where the agent cannot reach it.

    ToolEnv(..., verifier=("test-script", {"timeout_s": 120}))

A Harbor task's verifier is a folder, `tests/`, whose `test.sh` judges the container the agent
left and writes its reward to `/logs/verifier/reward.txt` (one number) or `reward.json`
(`{"reward": 1.0, ...}`). This verifier runs that contract after the episode:

1. The agent's processes are killed (nothing of the agent's runs from here on).
2. The task's tests folder (`task.hidden_tests`, a host folder) is copied, privileged, to
   `/verifier/tests`, and a fresh `/verifier/logs` is made; a task image (`agentrl.sandbox.images`)
   has `/tests` and `/logs` as links to them. Neither existed during the episode, and the agent
   (uid 1000) can write neither.
3. `test.sh` runs as the sandbox's verifier identity (docker: uid 2000, not the agent, not root),
   in the workspace, with the task's verifier env, bounded by the task's `[verifier].timeout_sec`.
4. The reward is read back from `/verifier/logs/verifier/`, at most 64 KiB, as a number: never
   from the script's output, which whatever the script runs can print.

What it does not cover: what `test.sh` itself runs is trusted to judge. A script that imports or
runs the agent's code (pytest over the workspace) lets that code write the reward file as the
verifier identity could; that is Harbor's own trust model (there the verifier is root). For pytest
suites, the `hidden-tests` verifier decides outside the test process and plants canary twins.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from agentrl.core.episode import Episode
from agentrl.core.task import Task
from agentrl.sandbox.base import PROTECTED_DIR, Sandbox, SandboxError
from agentrl.verifiers.base import Verdict, capability_refusal

TESTS_DIR = f"{PROTECTED_DIR}/tests"
LOGS_DIR = f"{PROTECTED_DIR}/logs"
REWARD_DIR = f"{LOGS_DIR}/verifier"
_REWARD_BYTES = 64 * 1024
_PREPARE = (
    f"rm -rf {TESTS_DIR} && "
    f"if [ -e {LOGS_DIR} ] || [ -L {LOGS_DIR} ]; then "
    f"n=0; while [ -e {LOGS_DIR}.old$n ]; do n=$((n + 1)); done; "
    f"mv {LOGS_DIR} {LOGS_DIR}.old$n && {{ rm -rf {LOGS_DIR}.old$n 2>/dev/null || true; }}; fi && "
    f"mkdir {LOGS_DIR} && chmod 1777 {LOGS_DIR}"
)
_DETAILS = 1500


def _tail(text: str, n: int = 600) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


def parse_reward(name: str, data: bytes) -> float:
    """The reward in `reward.txt` (one number) or `reward.json` (`{"reward": x}`, or one number
    among its values); ValueError with the reason otherwise."""
    text = data.decode("utf-8", "replace").strip()
    if name.endswith(".json"):
        obj = json.loads(text)
        if isinstance(obj, int | float) and not isinstance(obj, bool):
            value = float(obj)
        elif isinstance(obj, dict) and isinstance(obj.get("reward"), int | float):
            value = float(obj["reward"])
        elif isinstance(obj, dict) and len(obj) == 1 and isinstance(next(iter(obj.values())), int | float):
            value = float(next(iter(obj.values())))
        else:
            raise ValueError('reward.json must hold {"reward": <number>} (or a single number)')
    else:
        if not text:
            raise ValueError("reward.txt is empty")
        value = float(text.split()[0])
    if not math.isfinite(value):
        raise ValueError(f"the reward is not a finite number ({value})")
    return value


@dataclass
class TestScriptVerifier:
    """Runs the task's test script after the episode as the verifier identity; the reward comes from
    the reward file it writes under /logs/verifier (Harbor's verifier contract)."""

    __test__: ClassVar[bool] = False  # not a pytest test class, whatever its name says

    script: str = "test.sh"
    """The script in the tests folder that judges the episode."""
    timeout_s: float = 600.0
    """Wall-clock limit of the script when the task names none (`metadata["verifier_timeout_s"]`,
    Harbor's `[verifier].timeout_sec`); past it, reward 0."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables for the script (the task's `metadata["verifier_env"]` adds to them)."""
    name: str = "test-script"
    needs_sandbox: ClassVar[bool] = True
    needs_capabilities: ClassVar[tuple[str, ...]] = ("isolated", "protected_dir", "verifier_identity")

    def task_timeout_s(self, task: Task) -> float:
        value = task.metadata.get("verifier_timeout_s")
        return float(value) if isinstance(value, int | float) and value > 0 else self.timeout_s

    def verify(self, sandbox: Sandbox | None, task: Task, episode: Episode) -> Verdict:
        if sandbox is None:
            return Verdict(0.0, False, "the test-script verifier needs a sandbox; this episode had none")
        if (refusal := capability_refusal(self, sandbox)) is not None:
            return Verdict(0.0, False, refusal)
        tests = Path(task.hidden_tests).expanduser() if task.hidden_tests else None
        if tests is None or not (tests / self.script).is_file():
            return Verdict(
                0.0, False, f"task {task.id}: no tests folder with {self.script} (hidden_tests={tests})"
            )
        timeout = self.task_timeout_s(task)
        # 1. Nothing of the agent's runs from here on.
        sandbox.kill_agent_processes()
        # 2. The tests, and a fresh log folder, where only root writes. The folder must be writable
        # by the verifier identity, so a verification leaves it world-writable (sticky): in a
        # sandbox verified twice (the audit's answer probes) the agent may have left files there.
        # Root (no capabilities) cannot delete what others made in it, but owns it, so it moves the
        # old one aside whole; what it cannot remove stays there, unread.
        res = sandbox.exec(["/bin/sh", "-c", _PREPARE], privileged=True, timeout=60)
        if not res.ok:
            return Verdict(0.0, False, f"could not prepare {LOGS_DIR}: {_tail(res.stderr)}")
        with tempfile.TemporaryDirectory(prefix="agentrl-test-script-") as stage:
            staged = Path(stage, "tests")
            shutil.copytree(tests, staged, symlinks=True)
            for path in [staged, *staged.rglob("*")]:
                if not path.is_symlink():
                    path.chmod(0o755 if path.is_dir() or path.name.endswith(".sh") else 0o644)
            try:
                sandbox.copy_in(staged, TESTS_DIR, privileged=True)
            except (OSError, SandboxError) as exc:
                return Verdict(0.0, False, f"could not copy the tests in: {exc}")
        # 3. The script, as the verifier identity, in the workspace.
        env = {
            "HOME": "/tmp/agentrl-verifier-home",
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "PYTHONDONTWRITEBYTECODE": "1",
            **self.env,
            **{str(k): str(v) for k, v in dict(task.metadata.get("verifier_env") or {}).items()},
        }
        run = (
            f'umask 022 && mkdir -p -m 0755 {REWARD_DIR} "$HOME" && '
            f"if command -v bash >/dev/null; then exec bash {TESTS_DIR}/{self.script}; "
            f"else exec sh {TESTS_DIR}/{self.script}; fi"
        )
        out = sandbox.exec(["/bin/sh", "-c", run], as_verifier=True, timeout=timeout, env=env)
        said = _tail(out.stdout + ("\n" + out.stderr if out.stderr.strip() else ""))
        if out.timed_out:
            return Verdict(
                0.0, False, f"{self.script} timed out after {timeout:g}s and was killed; output: {said}"
            )
        # 4. The reward file, read back bounded.
        for name in ("reward.txt", "reward.json"):
            try:
                data = sandbox.read_file(f"{REWARD_DIR}/{name}", max_bytes=_REWARD_BYTES)
            except FileNotFoundError:
                continue
            except (OSError, SandboxError) as exc:
                return Verdict(
                    0.0, False, f"/logs/verifier/{name} could not be read ({type(exc).__name__}): not trusted"
                )
            try:
                reward = parse_reward(name, data)
            except ValueError as exc:
                return Verdict(0.0, False, f"/logs/verifier/{name} holds no reward: {exc}")
            details = f"reward {reward:g} from /logs/verifier/{name} ({self.script} exit {out.exit_code})"
            return Verdict(reward, reward >= 1.0, details[:_DETAILS])
        return Verdict(
            0.0,
            False,
            f"{self.script} wrote no /logs/verifier/reward.txt or reward.json (exit {out.exit_code}); output: {said}"[
                :_DETAILS
            ],
        )
