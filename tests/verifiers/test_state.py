"""The `state` verifier reads what the agent left as the verifier identity, never as root.

The attack: the state check is `cat /workspace/out.txt`, and the expected state is a secret
the image keeps root-only (here /etc/shadow stands in for an answer key). The
agent makes out.txt a symlink to it. A check run as root would read the secret through the
link and pass; run as the verifier identity it reads a permission error (docker) or nothing
(bwrap masks root-only paths).
"""

from __future__ import annotations

import pytest

from agentrl.core.task import Task
from agentrl.env.agents import run_episode, tool_call
from agentrl.env.tool_env import ToolEnv
from agentrl.sandbox import open_sandbox


class Script:
    def __init__(self, *actions: str):
        self.actions = [*actions, tool_call("submit", answer="done")]

    def act(self, observation):
        return self.actions.pop(0)


@pytest.mark.docker
@pytest.mark.parametrize("backend", ["docker", "bwrap"])
def test_state_check_does_not_follow_a_symlink_into_root_only_files(backend, request):
    if backend == "bwrap":
        request.getfixturevalue("bwrap_path")
    with open_sandbox(backend) as sb:
        secret = sb.exec(["cat", "/etc/shadow"], privileged=True).stdout.strip()
    assert secret.startswith("root:")
    task = Task(
        id="state/0", prompt="write the answer", check_command="cat /workspace/out.txt", answer=secret
    )
    with ToolEnv(
        tasks=[task], tools=["bash", "write_file", "submit"], verifier="state", backend=backend
    ) as env:
        honest = run_episode(env, Script(tool_call("write_file", path="out.txt", content=secret + "\n")))
        linked = run_episode(env, Script(tool_call("bash", command="ln -s /etc/shadow out.txt")))
    assert honest.reward == 1.0, honest.info["verdict"]
    assert linked.reward == 0.0, linked.info["verdict"]
