"""The hidden-tests verifier against a fork bomb in the code under test: reward 0, on time.

The agent's module forks for ever when the hidden tests import it. Through `env.step`, on docker
and bwrap, the submit step must end within the verifier's timeout plus `MARGIN_S` (a bound, not
a speed target) with reward 0 for the timeout, and leave no process of the bomb on the host.
"""

from __future__ import annotations

import subprocess
import time
import uuid

import pytest

from agentrl.core.task import Task
from agentrl.env.agents import tool_call
from agentrl.env.tool_env import ToolEnv
from agentrl.sandbox import Limits

TIMEOUT_S = 5.0
MARGIN_S = 5.0
LIMITS = Limits(memory_mb=512, cpus=1.0, pids=256, disk_mb=32)

FIXED = "def add(a, b):\n    return a + b\n"
HIDDEN_TESTS = "from mathlib import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
# Names itself (the process name, inherited by every fork) so the host's table can be searched.
BOMB = """
import os
with open("/proc/self/comm", "w") as f:
    f.write({name!r})
while True:
    try:
        os.fork()
    except OSError:
        pass
"""


class BombEnv(ToolEnv):
    instructions = "Fix mathlib.add, then submit."

    def __init__(self, task: Task, **kwargs):
        super().__init__(
            tasks=[task],
            tools=["write_file", "submit"],
            verifier=("hidden-tests", {"timeout_s": TIMEOUT_S}),
            max_turns=5,
            limits=LIMITS,
            use_pool=False,
            **kwargs,
        )


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Task:
    hidden = tmp_path_factory.mktemp("hidden")
    (hidden / "test_mathlib.py").write_text(HIDDEN_TESTS)
    return Task(
        id="bomb/0",
        prompt="mathlib.add subtracts. Fix it.",
        files={"mathlib.py": "def add(a, b):\n    return a - b\n"},
        hidden_tests=str(hidden),
    )


def host_processes_named(name: str) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pid=,stat=,comm="], capture_output=True, text=True, check=True)
    return [
        line for line in ps.stdout.splitlines() if line.split()[-1] == name and "Z" not in line.split()[1]
    ]


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.parametrize("backend", ["docker", "bwrap"])
def test_fork_bomb_imported_by_the_hidden_tests_scores_0_within_the_verifier_timeout(backend, task, request):
    if backend == "bwrap":
        request.getfixturevalue("bwrap_path")  # fails loudly when bubblewrap is missing
    name = f"bomb{uuid.uuid4().hex[:11]}"  # at most 15 characters: a process name's limit
    with BombEnv(task, backend=backend) as env:
        env.reset(options={"task": task})
        enforcement = getattr(env.sandbox, "enforcement", None)
        if enforcement is not None and "NOT" in enforcement.pids:
            pytest.fail(f"this sandbox enforces no pids limit ({enforcement.pids}); no bomb is run")
        env.step(tool_call("write_file", path="mathlib.py", content=FIXED + BOMB.format(name=name)))
        t0 = time.monotonic()
        _, reward, terminated, _, info = env.step(tool_call("submit", answer="done"))
        elapsed = time.monotonic() - t0
    verdict = info["verdict"]
    assert terminated and reward == 0.0, verdict
    assert f"timed out after {TIMEOUT_S:g}s" in verdict.details, verdict.details
    assert elapsed < TIMEOUT_S + MARGIN_S, f"a {TIMEOUT_S:g}s verifier timeout took {elapsed:.1f}s"
    deadline = time.monotonic() + 2.0
    while (left := host_processes_named(name)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"{len(left)} processes of the bomb outlived the episode on the host: {left[:5]}"
