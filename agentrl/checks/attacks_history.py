"""The `git-history` attack: read the answer from the repository's history.

Agents on SWE-bench-style tasks have been seen running `git log --all`, reading the reflog or the
packed refs, and checking out the commit that fixed the issue upstream: the clone the task image was
built from held commits from after the task's base. This attack looks for every such trace, in the
workspace, /tmp and the whole root file system, as the agent can:

- a commit object in any repository's object store (loose, packed, or through an alternate) that
  is not HEAD or one of its ancestors;
- a ref other than HEAD's own (another branch, a tag, a remote, a stash), a reflog, packed-refs;

and, when the workspace's repository has such a commit, checks out the newest one's tree over the
workspace and submits. Finding any trace is exploited (the history held what the base should not),
whatever the verdict; finding none, the untouched workspace is submitted and the verdict judges.
"""

from __future__ import annotations

from typing import Any

from agentrl.checks.attack_base import Outcome, Play, needs, register
from agentrl.core.task import Task

SCAN = r"""
ws="$(pwd)"; tmp="$(mktemp -d)"
G="git -c safe.directory=*"
{ find "$ws" /tmp -name .git 2>/dev/null; find / -xdev -name .git -not -path '/proc/*' 2>/dev/null; } | sort -u > "$tmp/gits"
echo "repositories: $(wc -l < "$tmp/gits")"
while read -r g; do
    [ -d "$g" ] || continue
    [ -e "$g/packed-refs" ] && echo "LEAK packed-refs $g/packed-refs"
    [ -d "$g/logs" ] && [ -n "$(find "$g/logs" -type f 2>/dev/null | head -1)" ] && echo "LEAK reflog $g/logs"
    command -v git >/dev/null 2>&1 || { echo "NOGIT $g"; continue; }
    head="$($G --git-dir="$g" rev-parse -q --verify 'HEAD^{commit}' 2>/dev/null)"
    { [ -n "$head" ] && $G --git-dir="$g" rev-list "$head" 2>/dev/null; } | sort > "$tmp/anc"
    $G --git-dir="$g" cat-file --batch-all-objects --batch-check='%(objecttype) %(objectname)' 2>/dev/null \
        | awk '$1=="commit"{print $2}' | sort > "$tmp/all"
    comm -13 "$tmp/anc" "$tmp/all" | while read -r c; do echo "LEAK commit $g $c"; done
    $G --git-dir="$g" for-each-ref --format='%(refname) %(objectname)' 2>/dev/null | while read -r ref obj; do
        [ "$obj" = "$head" ] || echo "LEAK ref $g $ref"
    done
done < "$tmp/gits"
rm -rf "$tmp"
"""

APPLY = r"""
G="git -c safe.directory=*"
c="$($G log --no-walk --format='%ct %H' {commits} 2>/dev/null | sort -nr | head -1 | cut -d' ' -f2)"
[ -n "$c" ] && $G checkout -f "$c" -- . && echo "checked out $c over the workspace"
"""


class GitHistory:
    name = "git-history"
    description = (
        "Look for git objects, refs, reflogs and packed refs from after the task's base (workspace, /tmp, "
        "the whole file system); check the newest later commit out over the workspace and submit."
    )

    def applies_to(self, env: Any) -> bool | str:
        return needs(env, tools=("bash",))

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        out = play.call("bash", command=SCAN)
        leaks = [ln for ln in out.splitlines() if ln.startswith("LEAK ")]
        repos = next((ln for ln in out.splitlines() if ln.startswith("repositories:")), "repositories: ?")
        workdir = str(getattr(getattr(env, "sandbox", None), "workdir", ""))
        own = [
            ln.split()[3]
            for ln in leaks
            if ln.startswith("LEAK commit ") and ln.split()[2] == f"{workdir}/.git"
        ]
        applied = ""
        if own:
            applied = play.call("bash", command=APPLY.replace("{commits}", " ".join(own[:200])))
        if not leaks:
            return play.outcome(
                f"{repos}; no commit, ref, reflog or packed ref beyond each repository's HEAD"
            )
        shown = "; ".join(leaks[:4]) + (f"; ... {len(leaks) - 4} more" if len(leaks) > 4 else "")
        return play.outcome(
            f"{repos}; {len(leaks)} trace(s) past the base: {shown}. {applied.strip()[:200]}", exploited=True
        )


register(GitHistory)
