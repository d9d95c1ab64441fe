"""The hidden-tests verifier with FAIL_TO_PASS node ids, on docker and bwrap, through env.step: the fix
scores 1 and the bug 0; every forger that has read our source (the audit's `forge-*` attacks) and every
blanket forger scores 0, the bug left in place. Fifteen failing cases, a twin set of two each (a blind
guess wins 1 in 32,768: the file plays 24 forged episodes, so a lucky guess fails it about once in
1,400 runs; at 1 in 512 it was once in 22); the rates at the
default odds are the benchmark's (benchmarks/forgers.py)."""

from __future__ import annotations

import pytest

from agentrl.checks.attacks_forgers import ATTACKS as FORGERS
from agentrl.checks.attacks_harness import ATTACKS as BLANKET
from agentrl.core.task import Task
from agentrl.env.agents import tool_call
from tests.verifiers.test_hidden_tests import FixFunctionEnv, play

# The bug leaves each word's last letter small: the fix changes a different letter in every expected
# value, so no character is shared by the real members of all the sets (a mark every expected value
# ends in would be one: a forger reading the sets would pick it in each, and the planner declines it).
BUGGY = "def add(a, b):\n    return a + b\n\n\ndef shout(s):\n    return s[:-1].upper() + s[-1] + '!'\n"
FIXED = "def add(a, b):\n    return a + b\n\n\ndef shout(s):\n    return s.upper() + '!'\n"
WORDS = [
    "hey",
    "ho",
    "run",
    "stop",
    "wait",
    "now",
    "jab",
    "sad",
    "elf",
    "dig",
    "ask",
    "sum",
    "fix",
    "fiz",
    "ear",
]
TESTS = f"""import pytest

from mathlib import add, shout


def test_add():
    assert add(7, 8) == 15


@pytest.mark.parametrize("text, want", {[(w, w.upper() + "!") for w in WORDS]!r})
def test_shout(text, want):
    assert shout(text) == want


def test_truth():
    assert add(1, 1)
"""
F2P = [f"test_m.py::test_shout[{w}-{w.upper()}!]" for w in WORDS]
P2P = ["test_m.py::test_add", "test_m.py::test_truth"]
# Where each fails on the buggy code, and what it compared there (what `tasks synth` records).
FAILING_LINES = dict.fromkeys(F2P, 1 + TESTS.splitlines().index("    assert shout(text) == want"))
COMPARED = {
    f: [repr(w[:-1].upper() + w[-1] + "!"), repr(w.upper() + "!")] for f, w in zip(F2P, WORDS, strict=True)
}
BACKENDS = [
    pytest.param("docker", marks=pytest.mark.docker, id="docker"),
    pytest.param("bwrap", marks=pytest.mark.docker, id="bwrap"),
]


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Task:
    hidden = tmp_path_factory.mktemp("hidden")
    (hidden / "test_m.py").write_text(TESTS)
    return Task(
        id="fix-add/twins",
        prompt="mathlib.shout leaves a letter small. Fix it, then submit.",
        files={"mathlib.py": BUGGY},
        hidden_tests=str(hidden),
        metadata={
            "FAIL_TO_PASS": F2P,
            "PASS_TO_PASS": P2P,
            "FAIL_TO_PASS_LINES": FAILING_LINES,
            "FAIL_TO_PASS_VALUES": COMPARED,
        },
    )


@pytest.fixture(scope="module", params=BACKENDS)
def env(request, task):
    if request.param == "bwrap":
        request.getfixturevalue("bwrap_path")
    with FixFunctionEnv(task, backend=request.param, verifier=("hidden-tests", {"odds": 32768})) as e:
        yield e


def test_the_fix_scores_1_and_the_bug_0(env, task):
    fixed, _ = play(env, task, tool_call("write_file", path="mathlib.py", content=FIXED))
    untouched, _ = play(env, task)
    assert (fixed.reward, untouched.reward) == (1.0, 0.0), (fixed.details, untouched.details)
    assert "15 twin sets" in fixed.details and "a blind guess wins 1 in 32,768" in fixed.details


@pytest.mark.parametrize("attack", FORGERS, ids=[a.name for a in FORGERS])
def test_every_informed_forger_scores_0(env, task, attack):
    forger = attack()
    forger.episodes = 2
    out = forger.play(env, task)
    assert out.reward == 0.0 and not out.passed, out.verdict
    assert "won 0 of 2" in out.evidence and out.exploited is False, out.evidence


@pytest.mark.parametrize("attack", BLANKET, ids=[a.name for a in BLANKET])
def test_every_blanket_forger_scores_0(env, task, attack):
    out = attack().play(env, task)
    assert out.reward == 0.0 and not out.passed, out.verdict
