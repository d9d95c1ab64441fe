"""The attacks on the hidden-test harness from inside the test process, through env.step, on
docker and bwrap: each scores 0 with the tampering recorded, on pytest-style and unittest-style
hidden tests; and the first three are live (without the canary twins they score 1), so the
twins are what stops them.

The env is test_hidden_tests' "fix mathlib.add" task; the attacks are the audit library's own.
"""

from __future__ import annotations

import pytest

from agentrl.checks.attacks_harness import ATTACKS as HARNESS_ATTACKS
from agentrl.checks.attacks_harness import HarnessEmitter, HarnessGuardFrames, HarnessHookExec
from agentrl.core.task import Task
from tests.verifiers.test_hidden_tests import BUGGY, FIXED, HIDDEN_TESTS, FixFunctionEnv, play

UNITTEST_TESTS = """import unittest

from mathlib import add


class TestAdd(unittest.TestCase):
    def test_small(self):
        self.assertEqual(add(2, 3), 5)

    def test_zero(self):
        self.assertEqual(add(0, 0), 0)
"""
BACKENDS = [
    pytest.param("docker", marks=pytest.mark.docker, id="docker"),
    pytest.param("bwrap", marks=pytest.mark.docker, id="bwrap"),
]


def make_task(tmp_path_factory, tests: str) -> Task:
    hidden = tmp_path_factory.mktemp("hidden")
    (hidden / "test_mathlib.py").write_text(tests)
    return Task(
        id="fix-add/0",
        prompt="Fix mathlib.add, then submit.",
        files={"mathlib.py": BUGGY},
        hidden_tests=str(hidden),
    )


@pytest.fixture(scope="module", params=["pytest-style", "unittest-style"])
def task(request, tmp_path_factory) -> Task:
    if request.param == "pytest-style":
        return make_task(tmp_path_factory, HIDDEN_TESTS)
    task = make_task(tmp_path_factory, UNITTEST_TESTS)
    return task.model_copy(update={"prompt": task.prompt + " (unittest)"})


@pytest.fixture(scope="module", params=BACKENDS)
def env(request, task):
    if request.param == "bwrap":
        request.getfixturevalue("bwrap_path")
    with FixFunctionEnv(task, backend=request.param) as e:
        yield e


def test_controls_the_fix_scores_1_and_the_bug_0(env, task):
    from agentrl.env.agents import tool_call

    fixed, _ = play(env, task, tool_call("write_file", path="mathlib.py", content=FIXED))
    untouched, _ = play(env, task)
    assert (fixed.reward, untouched.reward) == (1.0, 0.0), (fixed.details, untouched.details)
    assert "canary twins" in fixed.details


@pytest.mark.parametrize("attack", HARNESS_ATTACKS, ids=[a.name for a in HARNESS_ATTACKS])
def test_every_harness_attack_scores_0_with_tampering_recorded(env, task, attack):
    out = attack().play(env, task)
    assert out.reward == 0.0 and not out.passed, out.verdict
    if attack.name == "forge-empty-tests" and task.prompt.endswith("(unittest)"):
        # unittest's tests do not go through pytest_pyfunc_call: nothing was emptied, the bug fails.
        assert "not passed" in out.verdict, out.verdict
    else:
        assert "tampered with" in out.verdict, out.verdict


@pytest.mark.docker
@pytest.mark.parametrize(
    "attack", [HarnessHookExec, HarnessGuardFrames, HarnessEmitter], ids=lambda a: a.name
)
def test_without_the_canaries_these_attacks_win(tmp_path_factory, attack):
    """Against the in-process checks alone the attack forges a pass: it is live, and the twins
    (on by default) are what makes it score 0."""
    task = make_task(tmp_path_factory, HIDDEN_TESTS)
    with FixFunctionEnv(task, verifier=("hidden-tests", {"canaries": False})) as env:
        out = attack().play(env, task)
    assert out.reward == 1.0, out.verdict
