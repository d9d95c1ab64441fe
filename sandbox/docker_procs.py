"""Who runs in a docker sandbox's container, and how a timed-out command's processes are found and killed.

The users of its execs (the agent, root without capabilities, the verifier), the marker of the keep-alive
process no killer may pick, and the killers: `exec_tree` chooses a timed-out exec's processes on the host
(`agentrl.sandbox.hostkill` freezes and signals them), `KILLER` makes the same choice inside the container
when the host cannot reach its cgroup, and `KILL_ALL_OF_UID` is the last resort before the container itself.
"""

from __future__ import annotations

from agentrl.sandbox.base import AGENT_UID, VERIFIER_UID
from agentrl.sandbox.hostkill import Proc

AGENT_USER = f"{AGENT_UID}:{AGENT_UID}"
ROOT_USER = "0:0"
# Neither root nor the agent: it reads the agent's (world-readable) workspace, cannot read the
# image's root-only files, and cannot write the workspace (0755, uid 1000) or /verifier (root's).
VERIFIER_USER = f"{VERIFIER_UID}:{VERIFIER_UID}"
# Every exec's processes inherit `EXEC_MARKER` (value: a fresh uuid per exec); on timeout the
# killer finds the command's whole tree by it, including children that left its session.
# Set on the keep-alive process only, so that no killer ever picks it.
KEEPALIVE_MARKER = "AGENTRL_KEEPALIVE"
KEEPALIVE_ENTRY = f"{KEEPALIVE_MARKER}=1".encode()

# The in-container fallback of `DockerSandbox._kill_tree` (the host cannot reach the container's cgroup).
# Runs inside the container, as the user of the timed-out exec (only that user may signal its
# processes: root here has no CAP_KILL). It stops, then kills, every process that carries the
# exec's marker, every descendant of one, and every orphan (re-parented to PID 1) that started
# during the exec: the last catches daemons that also scrubbed their environment (`env -i`).
# It repeats until a scan finds nothing, so processes forked during a round die in the next.
# A process whose leader thread exited reads as a zombie, but forks on in its other threads:
# it counts as alive, and its environment is read through one of them.
KILLER = r"""
import os, signal, sys, time
marker = ("AGENTRL_EXEC=" + sys.argv[1]).encode()
keep = b"AGENTRL_KEEPALIVE=1"
hz = os.sysconf("SC_CLK_TCK")
with open("/proc/uptime") as f:
    since = (float(f.read().split()[0]) - float(sys.argv[2]) - 1.0) * hz
me, uid = os.getpid(), os.getuid()

def scan():
    procs = {}
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) in (1, me):
            continue
        try:
            if os.stat("/proc/" + d).st_uid != uid:
                continue
            with open("/proc/" + d + "/stat", "rb") as f:
                st = f.read()
            rest = st[st.rindex(b")") + 2:].split()
            tasks = os.listdir("/proc/" + d + "/task")
            if rest[0] == b"Z" and len(tasks) < 2:
                continue
            env = []
            for where in ["/proc/" + d] + ["/proc/" + d + "/task/" + t for t in tasks]:
                try:
                    with open(where + "/environ", "rb") as f:
                        data = f.read()
                except OSError:
                    continue
                if data:
                    env = data.split(b"\0")
                    break
            if keep in env:
                continue
            procs[int(d)] = (int(rest[1]), int(rest[19]), marker in env)
        except (OSError, ValueError, IndexError):
            pass
    hit = {p for p, (pp, t, m) in procs.items() if m or (pp == 1 and t >= since)}
    grew = True
    while grew:
        grew = False
        for p, (pp, t, m) in procs.items():
            if p not in hit and pp in hit:
                hit.add(p)
                grew = True
    return hit

for _ in range(200):
    hit = scan()
    if not hit:
        sys.exit(0)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for p in hit:
            try:
                os.kill(p, sig)
            except OSError:
                pass
    time.sleep(0.005)
sys.exit(1)
"""

# Only shell built-ins (no fork once it runs): `kill -9 -1` as uid $1 reaches exactly that
# user's processes (PID 1 and the keep-alive are root's; the kernel spares the caller). Its exit
# status cannot say whether any are left (root's processes count as found), so /proc is scanned
# for live processes of uid $1. Exit 1: some were still alive after every round. Never run as
# root: `kill -1` there would take the keep-alive, and the container, with it.
KILL_ALL_OF_UID = """
n=0
while [ $n -lt 50 ]; do
  n=$((n+1))
  kill -9 -1 2>/dev/null
  left=0
  for d in /proc/[0-9]*; do
    [ "${d#/proc/}" = "$$" ] && continue
    state=
    while read -r key value rest; do
      case "$key" in
        State:) state=$value ;;
        Uid:) [ "$value" = "$1" ] && [ "$state" != Z ] && left=1; break ;;
      esac
    done < "$d/status" 2>/dev/null
  done
  [ $left = 0 ] && exit 0
done
exit 1
"""


def exec_tree(procs: list[Proc], needle: bytes, uid: int, since: float, init_pid: int) -> set[int]:
    """`KILLER`'s choice, made on the host: of `uid`'s processes (the keep-alive never), those
    carrying the exec's marker `needle`, orphans of PID 1 started since `since` (clock ticks),
    and every descendant of either."""
    mine = {p.pid: p for p in procs if p.uid == uid and KEEPALIVE_ENTRY not in p.environ()}
    hit = {
        pid
        for pid, p in mine.items()
        if needle in p.environ() or (p.ppid == init_pid and p.start_ticks >= since)
    }
    grew = True
    while grew:
        grew = False
        for pid, p in mine.items():
            if pid not in hit and p.ppid in hit:
                hit.add(pid)
                grew = True
    return hit
