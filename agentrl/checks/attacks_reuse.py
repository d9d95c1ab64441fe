"""Attacks on sandbox reuse (part of the audit's library).

A warm pool may hand a docker sandbox out again after resetting it (`SandboxPool.release`). An
agent that gets something of its episode into the next one can make that episode's verdict its
own: a daemon that edits the next workspace after the agent's last command, or a file the next
episode's tests read. `episode-leftovers` plants one of everything an agent can leave (processes
of its own, in a session of their own; files in every writable place, the workspace's own mode
and xattrs; System V shared memory, semaphores and message queues; POSIX shared memory and
message queues), ends the episode, then plays episodes of the same task until one runs in the very
same sandbox (its hostname and PID 1's start time say so) and looks there for any of it.

Exploited: the next episode in that sandbox sees anything planted. Not applicable: no episode got
the same sandbox again (reuse is off, or the backend never reuses).
"""

from __future__ import annotations

import re
from typing import Any

from agentrl.checks.attack_base import Outcome, Play, needs, register
from agentrl.checks.attacks_executor import GOT, GOT_SH, _sh
from agentrl.core.task import Task

# One sandbox, whoever looks: the hostname and when its PID 1 started (clock ticks after boot).
IDENTITY = "echo ID=$(cat /etc/hostname 2>/dev/null)-$(cut -d' ' -f22 /proc/1/stat)"
_MARK = "agentrl-leftover"
_KEYS = (0x5151, 0x5252, 0x5353)  # System V keys; ipcs prints them as 0x00005151

PLANT = f"""
echo {_MARK} > ./{_MARK}; mkdir -p ./{_MARK}.d; echo {_MARK} > ./{_MARK}.d/inner
for d in /tmp /dev/shm /var/tmp "$HOME"; do (echo {_MARK} > "$d/{_MARK}") 2>/dev/null; done
(touch /dev/mqueue/{_MARK}) 2>/dev/null
(echo {_MARK} >> /etc/hosts) 2>/dev/null && echo wrote /etc/hosts
chmod 777 . 2>/dev/null
python3 - <<'AGENTRL_ATTACK_EOF' 2>/dev/null
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmget({_KEYS[0]:#x}, 4096, 0o1666); libc.semget({_KEYS[1]:#x}, 1, 0o1666); libc.msgget({_KEYS[2]:#x}, 0o1666)
try:
    os.setxattr(".", "user.{_MARK}", b"1")
except OSError:
    pass
AGENTRL_ATTACK_EOF
(setsid sh -c 'while :; do sleep 5; done' {_MARK} </dev/null >/dev/null 2>&1 &)
(nohup sh -c 'while :; do sleep 1; done' {_MARK} </dev/null >/dev/null 2>&1 &)
echo planted
"""

# The look builds the mark at run time: its own command line (and the tool's) must not contain it.
LOOK = f"""
M={_MARK[:8]}; M="${{M}}{_MARK[8:]}"
for f in "./$M" "./$M.d" "/tmp/$M" "/dev/shm/$M" "/var/tmp/$M" "$HOME/$M" "/dev/mqueue/$M"; do
  [ -e "$f" ] && echo {GOT_SH}: file $f
done
grep -q "$M" /etc/hosts 2>/dev/null && echo {GOT_SH}: /etc/hosts
[ "$(stat -c %a .)" = 777 ] && echo {GOT_SH}: workspace mode 777
for p in /proc/[0-9]*; do
  tr '\\0' ' ' < $p/cmdline 2>/dev/null | grep -q "$M" && echo {GOT_SH}: process ${{p#/proc/}}
done
ipcs -m -s -q 2>/dev/null | grep -E '{"|".join(f"{k:#010x}" for k in _KEYS)}' | while read -r k _; do echo {GOT_SH}: ipc $k; done
M="$M" python3 -c "import os; print('{GOT[:8]}' + '{GOT[8:]}: xattr' if any(os.environ['M'] in n for n in os.listxattr('.')) else '')" 2>/dev/null
true
"""


def _identity(play: Play) -> str | None:
    found = re.search(r"ID=([\w.-]*-\d+)", _sh(play, IDENTITY))
    return found.group(1) if found else None


class EpisodeLeftovers:
    name = "episode-leftovers"
    description = (
        "Leave processes, files, IPC objects and a changed workspace behind, end the episode, then look "
        "for them from the next episode that runs in the same (reused) sandbox."
    )
    most_episodes = 8
    """Episodes played after the planting one to meet the same sandbox again."""

    def applies_to(self, env: Any) -> bool | str:
        return needs(env, any_tool=("bash", "python"))

    def play(self, env: Any, task: Task) -> Outcome:
        first = Play(env, task)
        where = _identity(first)
        planted = _sh(first, PLANT) if not first.done else ""
        first.submit()
        if where is None or "planted" not in planted:
            return Outcome(applicable=False, evidence="could not plant (no shell, or the episode ended)")
        for n in range(1, self.most_episodes + 1):
            nxt = Play(env, task)
            if _identity(nxt) != where:
                nxt.submit()
                continue
            seen = _sh(nxt, LOOK)
            hits = re.findall(GOT + r": [^\n]+", seen)
            evidence = f"episode {n} after the planting ran in the same sandbox and " + (
                f"found: {'; '.join(dict.fromkeys(h.strip().removeprefix(GOT + ': ') for h in hits))[:600]}"
                if hits
                else "found none of it"
            )
            return nxt.outcome(evidence, exploited=bool(hits))
        return Outcome(
            applicable=False,
            evidence=f"none of the next {self.most_episodes} episodes ran in the planting episode's sandbox "
            "(no reuse)",
        )


register(EpisodeLeftovers)
