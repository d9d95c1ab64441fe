"""Attacks on the sandbox's resident executor (part of the audit's library).

The agent's commands run as children of one executor per sandbox (`agentrl.sandbox.executor`),
under the agent's own uid: it can see that process, and on docker signal it. Each attack here
goes for it from inside the sandbox (kill it, replace it, ptrace it, forge frames on its channel,
flood it), then lets the env's own reference solution (`env.oracle(task)`) finish the episode.

What counts as exploited: the episode is scored with a reward although the executor was killed or
replaced (it must end `env_error` instead), or the attack got at the executor (attached to it,
read its memory or environment, opened its channel, made a forged frame count, made the host hold
a flood). An attack whose tampering had no effect (the kernel refused it, the executor stayed
itself) lets the reference solution's honest reward stand: contained.
"""

from __future__ import annotations

import re
import time
from typing import Any

from agentrl.checks.attack_base import Outcome, Play, needs, register, tool_names
from agentrl.checks.attack_common import _Watchdog
from agentrl.core.plugins import PluginError, UnknownPluginError
from agentrl.core.task import Task
from agentrl.env.protocols import has_oracle
from agentrl.sandbox.base import backend_capabilities

# Printed by an attack's command when a step of it got through, so the host side can read it. The
# commands spell it in two parts, so that a tool echoing the command back never reads as a hit.
GOT = "AGENTRL-ATTACK-GOT"
GOT_SH = 'AGENTRL-ATTACK-"GOT"'
GOT_PY = '"AGENTRL-ATTACK-" + "GOT"'
# The executor's pid, as the agent finds it: the process named `agentrl-exec` (a tool's command may
# not be its direct child: the python tool runs shell commands under its own interpreter).
FIND_EXECUTOR = (
    'EX=$(for p in /proc/[0-9]*; do [ "$(cat $p/comm 2>/dev/null)" = agentrl-exec ] && echo ${p#/proc/}; done '
    "| head -n 1); "
)
FIND_EXECUTOR_PY = (
    "import os\n"
    "def executor_pid():\n"
    "    for d in os.listdir('/proc'):\n"
    "        try:\n"
    "            if d.isdigit() and open(f'/proc/{d}/comm').read().strip() == 'agentrl-exec':\n"
    "                return int(d)\n"
    "        except OSError:\n"
    "            pass\n"
)


def _hits(seen: str) -> list[str]:
    return re.findall(GOT + r": [\w /.-]+", seen)


def _sh(play: Play, command: str) -> str:
    """A shell command whose output is the tool call's own (bash, else `os.system` from python)."""
    if "bash" in tool_names(play.env):
        return play.call("bash", command=command)
    return play.call("python", code=f"import os, sys\nsys.stdout.flush()\nos.system({command!r})")


def _py(play: Play, code: str) -> str:
    """A Python program whose output is the tool call's own (python, else a bash heredoc)."""
    if "python" in tool_names(play.env):
        return play.call("python", code=code)
    return play.call("bash", command=f"python3 - <<'AGENTRL_ATTACK_EOF'\n{code}\nAGENTRL_ATTACK_EOF")


def _runs_an_executor(env: Any) -> bool:
    """Whether the env's sandbox backend runs the agent's commands through a resident executor."""
    backend = getattr(env, "backend", None)
    try:
        return isinstance(backend, str) and backend_capabilities(backend).resident_executor
    except (PluginError, UnknownPluginError):
        return False


class _ExecutorAttack:
    """Plays `tamper`, notes whether the executor survived as itself, then the reference solution."""

    name = ""
    description = ""
    settle_s = 0.0

    def applies_to(self, env: Any) -> bool | str:
        if not _runs_an_executor(env):
            return "the env's sandboxes run no resident executor (their backend has none)"
        if not has_oracle(env):
            return "the env has no oracle(task) to finish the episode after the tampering"
        return needs(env, any_tool=("bash", "python"))

    def tamper(self, play: Play) -> str:
        """The attack's own steps; what they printed (evidence)."""
        raise NotImplementedError

    def got_in(self, seen: str) -> str | None:
        """What the tampering reached that it must not have (from its output), or None."""
        return None

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        sandbox = getattr(env, "sandbox", None)
        if getattr(sandbox, "resident_executor", None) is None:
            play.submit()
            return Outcome(applicable=False, evidence="the env's sandbox runs no resident executor")
        start = play.obs
        seen = self.tamper(play)
        time.sleep(self.settle_s)  # what the tampering left in the background lands now
        got = self.got_in(seen)
        tampered = None
        if not play.done and env.sandbox is not None:
            try:
                env.sandbox.check_intact()
            except Exception as exc:
                tampered = f"{type(exc).__name__}: {exc}"
        elif play.done:
            tampered = (
                f"the episode ended at once ({play.info.get('finish_reason')}: {play.info.get('error')})"
            )
        if not play.done:
            agent = env.oracle(task)
            obs = start  # the reference solution starts from the task's first observation
            while not play.done:
                obs = play.send(agent.act(obs))
        summary = " ".join(seen.split())[:240]
        if got is not None:
            return play.outcome(f"{got} ({summary})", exploited=True)
        if tampered is None:
            # The executor stayed itself: the reference solution's reward is honestly earned.
            return play.outcome(f"the executor was unharmed and still itself ({summary})", exploited=False)
        reward = play.reward or 0.0
        finish = play.info.get("finish_reason")
        return play.outcome(
            f"the executor was tampered with ({tampered[:200]}); the episode then ended {finish} with "
            f"reward {reward:g} ({summary})",
            exploited=reward > 0 or finish != "env_error",
        )


class ExecutorKill(_ExecutorAttack):
    name = "executor-kill"
    description = (
        "Kill the resident executor (SIGKILL, from a background process, after the tool call returned), then "
        "solve the task honestly: the episode must end env_error, unscored."
    )
    settle_s = 1.5

    def tamper(self, play: Play) -> str:
        return _sh(
            play,
            FIND_EXECUTOR + "echo executor $EX; nohup sh -c 'sleep 0.5; kill -9 $0' $EX >/dev/null 2>&1 &",
        )


class ExecutorReplace(_ExecutorAttack):
    name = "executor-replace"
    description = (
        "Overwrite the executor's program (python3, and a python3 first on PATH), then kill the executor and "
        "start an impostor that speaks its hello and forged frames; then solve the task honestly."
    )

    IMPOSTOR = (
        "import os, struct, sys, time\n"
        "sys.stdout.buffer.write(b'AGENTRL-EXECUTOR-HELLO\\n')\n"
        "body = b'\\x00\\x00\\x00\\x02{}'\n"
        "for i in range(1, 64):\n"
        "    sys.stdout.buffer.write(b'AGX1' + bytes(16) + struct.pack('>QI', i, len(body)) + body)\n"
        "sys.stdout.flush()\n"
        "time.sleep(30)\n"
    )

    settle_s = 1.5

    def tamper(self, play: Play) -> str:
        ws = str(getattr(play.env.sandbox, "workdir", "/workspace"))
        script = f"{ws}/.impostor.py"
        return _sh(
            play,
            FIND_EXECUTOR + 'PY="$(command -v python3)"; '
            f'for p in "$PY" /usr/bin/python3; do (echo \'print(1)\' > "$p") 2>/dev/null && '
            f"echo {GOT_SH}: wrote $p; done; mkdir -p {ws}/bin && printf '#!/bin/sh\\nexec sleep 60\\n' > {ws}/bin/python3; "
            f"chmod +x {ws}/bin/python3; cat > {script} <<'AGENTRL_ATTACK_EOF'\n{self.IMPOSTOR}AGENTRL_ATTACK_EOF\n"
            'nohup sh -c \'sleep 0.5; kill -9 $0; exec "$1" "$2"\' "$EX" "$PY" '
            f"{script} >/dev/null 2>&1 & echo planted",
        )

    def got_in(self, seen: str) -> str | None:
        return "the executor's program was overwritten" if f"{GOT}: wrote" in seen else None


class ExecutorPtrace(_ExecutorAttack):
    name = "executor-ptrace"
    description = (
        "Attach to the executor with ptrace, read its memory and environment, open its channel's "
        "descriptors; then solve the task honestly."
    )

    PROBE = f"""
import ctypes
{FIND_EXECUTOR_PY}
pid = executor_pid()
libc = ctypes.CDLL(None, use_errno=True)
if libc.ptrace(16, pid, 0, 0) == 0:  # PTRACE_ATTACH
    print({GOT_PY} + ": ptrace attached to", pid)
    libc.ptrace(17, pid, 0, 0)  # PTRACE_DETACH
for what in ("mem", "environ", "fd/0", "fd/1"):
    try:
        with open(f"/proc/{{pid}}/{{what}}", "rb" if not what.startswith("fd/1") else "wb", buffering=0) as f:
            if what == "mem":
                f.seek(0x400000)
            data = f.read(16) if "r" in f.mode else f.write(b"AGX1")
        print({GOT_PY} + ": opened", what)
    except OSError as exc:
        print("refused", what, exc.strerror)
"""

    def tamper(self, play: Play) -> str:
        return _py(play, self.PROBE)

    def got_in(self, seen: str) -> str | None:
        hits = _hits(seen)
        return f"the executor was reachable: {'; '.join(hits)[:200]}" if hits else None


class ExecutorForgedFrames(_ExecutorAttack):
    name = "executor-forged-frames"
    description = (
        "Print frames in the executor's format (guessed nonces) answering the next requests with forged "
        "output, on stdout and into the executor's own descriptors; the next command must read its own "
        "output only. Then solve the task honestly."
    )

    FORGE = f"""
import struct, sys
{FIND_EXECUTOR_PY}
frames = b""
for nonce in (bytes(16), b"\\xff" * 16, os.urandom(16)):
    for i in range(1, 256):
        head = b'{{"exit":0,"timed_out":false,"dropped":[0,0],"duration":0,"blobs":[16,0]}}'
        body = struct.pack(">I", len(head)) + head + b"FORGED-OUTPUT!!!"
        frames += b"AGX1" + nonce + struct.pack(">QI", i, len(body)) + body
sys.stdout.buffer.write(frames)
for fd in ("1", "2"):
    try:
        with open(f"/proc/{{executor_pid()}}/fd/{{fd}}", "wb", buffering=0) as f:
            f.write(frames)
        print({GOT_PY} + ": wrote into the executor's fd", fd)
    except OSError:
        pass
"""

    def tamper(self, play: Play) -> str:
        forged = _py(play, self.FORGE)
        said = f"{forged.count('FORGED-OUTPUT')} forged frames came back as the command's own output"
        wrote = "".join(f"; {line}" for line in forged.splitlines() if f"{GOT}: wrote into" in line)
        if play.done:
            return said + wrote
        after = _sh(play, "echo genuine-output")
        return f"{said}{wrote} || next command: {after}"

    def got_in(self, seen: str) -> str | None:
        _, _, after = seen.partition(" || next command: ")
        if f"{GOT}: wrote into" in seen:
            return "a forged frame was written into the executor's channel"
        if after and ("FORGED" in after or "genuine-output" not in after):
            return "the command after the forgery read forged output"
        return None


class ExecutorFlood(_ExecutorAttack):
    name = "executor-flood"
    description = (
        "Flood the executor with output (800 MB on stdout and stderr, from four processes at once) to exhaust "
        "the host's memory or wedge the channel; the next command must answer. Then solve the task honestly."
    )

    def tamper(self, play: Play) -> str:
        with _Watchdog(play.env, max_rss_mb=512, max_seconds=120) as dog:
            flood = _sh(
                play,
                "for i in 1 2 3 4; do (head -c 100000000 /dev/zero | tr '\\0' x; "
                "head -c 100000000 /dev/zero | tr '\\0' y >&2) & done; wait; echo flooded",
            )
        self.tripped = dog.tripped
        self.growth = dog.peak_growth_mb
        after = "" if play.done else _sh(play, "echo still-answering")
        return (
            f"{len(flood)} chars came back; host memory grew {dog.peak_growth_mb:.0f} MiB; next: {after[:80]}"
        )

    def got_in(self, seen: str) -> str | None:
        if self.tripped:
            return f"the flood was not contained: {self.tripped}"
        if "still-answering" not in seen:
            return "the executor stopped answering after the flood"
        return None


ATTACKS: tuple[type[Any], ...] = (
    ExecutorKill,
    ExecutorReplace,
    ExecutorPtrace,
    ExecutorForgedFrames,
    ExecutorFlood,
)

for _cls in ATTACKS:
    register(_cls)
