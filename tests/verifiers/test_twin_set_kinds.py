"""Twin sets for the shapes a class-based suite's failing tests take: a test a base class defines
(run under each subclass's node id), a test with a helper defined in it, `assert raises(E, f)`, and
an element of an expected container (`== D({...})`), drawn as near to the buggy output as the real
one is. Each plan runs through the real runner: the real member passes on the correct code, every
member fails on the buggy code."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from agentrl.verifiers.twin_sets import plan_twin_sets
from agentrl.verifiers.twin_sites import _Site
from agentrl.verifiers.twin_values import _nears_at
from tests.verifiers.test_twin_sets import run_runner

BUGGY = (
    "def bump(d):\n    return {k: v + 11 for k, v in d.items()}\n\n\n"
    "def check(x):\n    return x\n\n\n"
    "def pair(x):\n    return [x, x]\n"
)
FIXED = (
    "def bump(d):\n    return {k: v + 10 for k, v in d.items()}\n\n\n"
    "def check(x):\n    if x < 0:\n        raise ValueError(x)\n    return x\n\n\n"
    "def pair(x):\n    return [x, x * 10]\n"
)
TESTS = """
from lib import bump, check, pair


def raises(err, fn):
    try:
        fn()
        return False
    except err:
        return True


class Mapping(dict):
    pass


class TestPlain:
    D = dict

    def test_bump(self):
        D = self.D
        assert bump(D({"a": 7})) == D({"a": 17})


class TestMapping(TestPlain):
    D = Mapping


def test_with_a_helper():
    def twice(x):
        return x * 2

    assert bump({"k": twice(4)}) == {"k": 18}


def test_raises_helper():
    assert raises(ValueError, lambda: check(-5))


def test_pair():
    assert pair(6) == [6, 60]
"""
PLAIN, INHERITED = "test_k.py::TestPlain::test_bump", "test_k.py::TestMapping::test_bump"
# What each failing check compared on the buggy code, as `tasks synth` reads it off pytest's report.
COMPARED = {
    PLAIN: ["{'a': 18}", "{'a': 17}"],
    INHERITED: ["{'a': 18}", "{'a': 17}"],
    "test_k.py::test_with_a_helper": ["{'k': 19}", "{'k': 18}"],
}


def lay_out(root: Path) -> Path:
    tests = root / "hidden"
    tests.mkdir(parents=True)
    (tests / "test_k.py").write_text(TESTS.lstrip())
    return tests


def decide(tmp_path: Path, f2p: list[str], seed: int, **kw):
    hidden = tmp_path / "hidden" if (tmp_path / "hidden").exists() else lay_out(tmp_path)
    kw.setdefault("failing_values", COMPARED)
    plan = plan_twin_sets(hidden, f2p, rng=random.Random(seed), **kw)
    folder = tmp_path / f"decision-{seed}"
    folder.mkdir()
    plan.write(folder)
    return plan, folder


def assert_decides(plan, folder: Path, f2p: list[str]) -> None:
    assert plan.uncovered == {} and sorted(o for s in plan.sets for o in s.originals) == sorted(f2p)
    fixed = run_runner(folder, FIXED, plan.ids)
    assert plan.tampering(fixed, collected=fixed) == []
    assert plan.real_outcomes(fixed) == dict.fromkeys(f2p, "passed")
    twins = [fixed[x] for s in plan.sets for i, m in enumerate(s.members) if i != s.real for x in m]
    assert twins and set(twins) == {"failed"}
    buggy = run_runner(folder, BUGGY, plan.ids)
    assert set(buggy.values()) == {"failed"}  # no member passes on the bug: none stands out there


@pytest.mark.parametrize("seed", range(2))
def test_a_test_a_base_class_defines_is_one_set_run_under_each_class(tmp_path, seed):
    plan, folder = decide(tmp_path, [PLAIN, INHERITED], seed)
    [s] = plan.sets
    assert s.originals == (PLAIN, INHERITED) and s.how == "literal"
    assert sorted(s.values) == ["17", "19"] and s.linked  # reflected about the buggy output, 18
    assert {m[0].split("::")[1] for m in s.members} == {"TestPlain"}
    assert {m[1].split("::")[1] for m in s.members} == {"TestMapping"}
    text = (folder / "test_k.py").read_text()
    assert "def test_bump(" not in text and text.count('== D({"a": ') == len(s.members)
    assert_decides(plan, folder, [PLAIN, INHERITED])


def test_only_the_subclass_failing_is_decided_under_its_own_id(tmp_path):
    plan, folder = decide(tmp_path, [INHERITED], 0)
    assert all(m[0].startswith("test_k.py::TestMapping::") for m in plan.sets[0].members)
    assert_decides(plan, folder, [INHERITED])


def test_a_method_no_class_of_the_file_defines_is_listed(tmp_path):
    hidden = lay_out(tmp_path)
    plan = plan_twin_sets(hidden, ["test_k.py::TestMapping::test_gone"], rng=random.Random(0))
    assert not plan.sets and "not defined" in plan.uncovered["test_k.py::TestMapping::test_gone"]


def test_a_helper_defined_in_the_test_does_not_hide_its_checks(tmp_path):
    # The helper's `return` leaves the helper, not the test: the check after it is always reached.
    plan, folder = decide(tmp_path, ["test_k.py::test_with_a_helper"], 0)
    assert plan.sets[0].values[plan.sets[0].real] == "18"
    assert_decides(plan, folder, ["test_k.py::test_with_a_helper"])


def test_assert_raises_helper_is_decided_by_what_is_raised(tmp_path):
    plan, folder = decide(tmp_path, ["test_k.py::test_raises_helper"], 0)
    [s] = plan.sets
    assert s.how == "raises" and s.values[s.real] == "ValueError" and len(s.members) >= 2
    assert_decides(plan, folder, ["test_k.py::test_raises_helper"])


def test_a_container_element_is_drawn_as_near_to_the_buggy_output_as_the_real_one(tmp_path):
    f2p = ["test_k.py::test_pair"]
    # The buggy output [6, 6]: the element that differs is reflected about 6 (60 and -48 would
    # cross zero: none), so with a known output only an element it got wrong may differ ...
    plan, _ = decide(tmp_path, f2p, 0, failing_values={f2p[0]: ["[6, 6]", "[6, 60]"]})
    assert not plan.sets
    # ... and where its output is wrong but near, twins are its mirror image (one guess of two).
    plan, folder = decide(tmp_path, f2p, 1, failing_values={f2p[0]: ["[6, 59]", "[6, 60]"]})
    [s] = plan.sets
    assert sorted(s.values) == ["58", "60"] and s.linked
    # With no output to be near to, a progression with the real value at a random rank.
    plan, folder = decide(tmp_path, f2p, 2, failing_values={})
    assert "60" in plan.sets[0].values and len(plan.sets[0].values) >= 2
    assert_decides(plan, folder, f2p)


def site(value: object, path: tuple, whole: object) -> _Site:
    return _Site("literal", None, repr(value), value, 9, 1, path=path, whole=whole)  # type: ignore[arg-type]


def test_an_element_s_place_in_the_buggy_output():
    whole = {"a": [1, 2], "b": 3}
    # It differs there: near-miss rules on the element and the buggy one.
    assert _nears_at(site(2, ("a", 1), whole), [{"a": [1, 5], "b": 3}, whole]) == [2, 5]
    # It agrees there: the real member would be the nearest; never used.
    assert _nears_at(site(3, ("b",), whole), [{"a": [1, 5], "b": 3}, whole]) is None
    # Nothing there (no key, not a container, another type): as far from every member.
    assert _nears_at(site(3, ("b",), whole), [{"a": [1, 5]}, whole]) == []
    assert _nears_at(site(3, ("b",), whole), [None, whole]) == []
    assert _nears_at(site(3, ("b",), whole), [{"b": "3"}, whole]) == []
    # What was compared is not this container: unknown, never used.
    assert _nears_at(site(3, ("b",), whole), [{"x": 1}, {"y": 2}]) is None
    assert _nears_at(site(3, ("b",), whole), []) == []
