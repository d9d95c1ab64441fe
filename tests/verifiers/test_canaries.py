"""Canary twins, on the host with the real pytest: on correct code every test passes and every
canary fails; a forger that empties the tests or flips their failures is caught; names, order
and node ids map back to the task's own."""

from __future__ import annotations

import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agentrl.verifiers.canaries import CanaryPlan, plant_canaries

LIB = "def add(a, b):\n    return a + b\n\n\ndef words(s):\n    return s.split()\n"
TESTS = {
    "test_lib.py": '''
        import pytest
        from lib import add, words


        def test_add():
            # a comment the twin keeps too
            assert add(2, 3) == 5


        def test_negative():
            assert add(-2, -3) == -5


        def test_float():
            assert add(0.5, 0.25) == pytest.approx(0.75)
            assert add(1.5, 1.0) == 2.5


        def test_words():
            """A docstring is not an assertion."""
            assert words("a b") == ["a", "b"]
            assert "b" in words("a b")


        def test_truthy():
            assert add(1, 1)


        @pytest.mark.parametrize("a, b, want", [(1, 2, 3), (2, 2, 4)])
        def test_param(a, b, want):
            assert add(a, b) == want


        def test_raises_only():
            with pytest.raises(TypeError):
                add(1, "x")


        class TestClass:
            def test_method(self):
                assert add(1, 2) != 4
                assert add(1, 2) is not None


        class TestChild(TestClass):
            pass
        ''',
    "test_unit.py": """
        import unittest

        from lib import add


        class TestAdd(unittest.TestCase):
            def test_equal(self):
                self.assertEqual(add(2, 2), 4)

            def test_true(self):
                self.assertTrue(add(2, 2) == 4)

            def test_in(self):
                self.assertIn(add(1, 1), [2, 3])
        """,
}


def lay_out(root: Path, lib: str = LIB) -> Path:
    (root / "src").mkdir(parents=True)
    (root / "src" / "lib.py").write_text(lib)
    tests = root / "tests"
    tests.mkdir()
    for name, text in TESTS.items():
        (tests / name).write_text(textwrap.dedent(text).lstrip())
    return tests


def run_pytest(root: Path, *extra: str, ids: list[str] | None = None) -> dict[str, str]:
    """{node id relative to tests/: outcome} from a real pytest run."""
    tests = root / "tests"
    args = [f"tests/{i}" for i in ids] if ids else ["tests"]
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-q", "-p", "no:cacheprovider", *extra, *args],
        cwd=root,
        env={"PYTHONPATH": str(root / "src"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    out: dict[str, str] = {}
    for line in res.stdout.splitlines():
        m = re.match(r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) tests/(\S+)", line)
        if m:
            out[m.group(2)] = {
                "PASSED": "passed",
                "XPASS": "passed",
                "SKIPPED": "skipped",
                "XFAIL": "skipped",
            }.get(m.group(1), "failed")
    assert out, res.stdout + res.stderr
    assert tests.is_dir()
    return out


@pytest.mark.parametrize("seed", range(4))
def test_on_correct_code_every_test_passes_and_every_canary_fails(tmp_path, seed):
    tests = lay_out(tmp_path)
    plan = plant_canaries(tests, rng=random.Random(seed))
    outcomes = run_pytest(tmp_path)
    assert plan.tampering(outcomes, collected=outcomes) == []
    canaries = {n: o for n, o in outcomes.items() if plan.original_id(n) is None}
    real = plan.to_original(outcomes)
    assert canaries and set(canaries.values()) == {"failed"}
    assert set(real.values()) == {"passed"}
    # Every test is back under its own node id, inherited and parametrized ones included.
    assert "test_lib.py::TestChild::test_method" in real
    assert {"test_lib.py::test_param[1-2-3]", "test_lib.py::test_param[2-2-4]"} <= set(real)
    assert "test_unit.py::TestAdd::test_in" in real
    # One twin per test that has a top-level assertion; the raises-only test has none.
    assert plan.uncovered == ["test_lib.py::test_raises_only"]
    assert len(real) == len(outcomes) - len(canaries)


def test_every_kind_of_contradiction_is_used(tmp_path):
    hows: set[str] = set()
    for seed in range(12):
        root = tmp_path / str(seed)
        plan = plant_canaries(lay_out(root), rng=random.Random(seed))
        hows |= {t.how for t in plan.twins}
    assert hows == {"literal", "comparison", "negation", "unittest"}


def test_buggy_code_fails_without_being_called_tampering(tmp_path):
    tests = lay_out(tmp_path, lib=LIB.replace("a + b", "a - b"))
    plan = plant_canaries(tests, rng=random.Random(1))
    outcomes = run_pytest(tmp_path)
    assert plan.tampering(outcomes) == []
    assert plan.to_original(outcomes)["test_lib.py::test_add"] == "failed"


FORGERS = {
    # Every test body emptied: every test and every canary passes.
    "empty-bodies": (
        "import _pytest.python, _pytest.unittest\n"
        "_pytest.python.Function.runtest = _pytest.unittest.TestCaseFunction.runtest = lambda self: None\n"
    ),
    # Every failure flipped into a pass when the report is made.
    "flip-failures": (
        "import pytest\n\n@pytest.hookimpl(hookwrapper=True)\n"
        "def pytest_runtest_makereport(item, call):\n"
        "    outcome = yield\n    rep = outcome.get_result()\n    rep.outcome, rep.longrepr = 'passed', None\n"
    ),
}


@pytest.mark.parametrize("forger", sorted(FORGERS))
def test_a_blanket_forger_passes_twins_and_is_caught(tmp_path, forger):
    tests = lay_out(tmp_path, lib=LIB.replace("a + b", "a - b"))
    plan = plant_canaries(tests, rng=random.Random(2))
    (tests / "conftest.py").write_text(FORGERS[forger])
    outcomes = run_pytest(tmp_path)
    assert set(plan.to_original(outcomes).values()) == {"passed"}  # the forgery "worked"...
    problems = plan.tampering(outcomes)
    assert problems and all("canary twin both passed" in p for p in problems)  # ...and is caught


def test_names_and_order_do_not_say_which_twin_is_real(tmp_path):
    kept_name = placed_first = 0
    n = 40
    for seed in range(n):
        root = tmp_path / str(seed)
        tests = lay_out(root)
        plan = plant_canaries(tests, considered=["test_lib.py::test_add"], rng=random.Random(seed))
        (twin,) = plan.twins
        kept_name += twin.real == "test_lib.py::test_add"
        text = (tests / "test_lib.py").read_text()
        real_name, canary_name = twin.real.rsplit("::", 1)[1], twin.canary.rsplit("::", 1)[1]
        placed_first += text.index(f"def {real_name}(") < text.index(f"def {canary_name}(")
        # The twin is the test's own text: its comment, and the other name drawn like a test's.
        assert text.count("# a comment the twin keeps too") == 2
        assert re.fullmatch(r"test_add_[a-z]+", real_name if canary_name == "test_add" else canary_name)
    assert 8 < kept_name < n - 8 and 8 < placed_first < n - 8


def test_considered_ids_select_tests_and_map_to_installed_ones(tmp_path):
    tests = lay_out(tmp_path)
    considered = ["test_lib.py::test_add", "test_lib.py::test_param", "test_words"]
    plan = plant_canaries(tests, considered=considered, rng=random.Random(3))
    assert {t.original for t in plan.twins} == {
        "test_lib.py::test_add",
        "test_lib.py::test_param",
        "test_lib.py::test_words",
    }
    ids = plan.to_installed(["test_lib.py::test_add", "test_lib.py::test_param[1-2-3]"])
    assert len(ids) == 4
    outcomes = run_pytest(tmp_path, ids=ids)
    assert set(outcomes) == set(ids)
    assert plan.to_original(outcomes) == {
        "test_lib.py::test_add": "passed",
        "test_lib.py::test_param[1-2-3]": "passed",
    }


def test_a_canary_left_out_of_collection_is_tampering():
    plan = CanaryPlan()
    from agentrl.verifiers.canaries import Twin

    plan.twins.append(Twin("t.py::test_a", "t.py::test_a_more", "t.py::test_a", "literal"))
    assert plan.tampering({"t.py::test_a_more": "passed"}, collected=["t.py::test_a_more"])
    assert not plan.tampering(
        {"t.py::test_a_more": "passed", "t.py::test_a": "failed"},
        collected=["t.py::test_a_more", "t.py::test_a"],
    )


def test_a_file_that_does_not_parse_is_left_alone(tmp_path):
    (tmp_path / "test_broken.py").write_text("def test_x(:\n")
    plan = plant_canaries(tmp_path)
    assert plan.twins == [] and (tmp_path / "test_broken.py").read_text() == "def test_x(:\n"


def test_an_inherited_test_listed_under_its_subclass_gets_a_twin(tmp_path):
    tests = lay_out(tmp_path)
    plan = plant_canaries(tests, considered=["test_lib.py::TestChild::test_method"], rng=random.Random(4))
    ids = plan.to_installed(["test_lib.py::TestChild::test_method"])
    assert len(ids) == 2 and all(i.startswith("test_lib.py::TestChild::") for i in ids)
    outcomes = run_pytest(tmp_path, ids=ids)
    assert plan.to_original(outcomes) == {"test_lib.py::TestChild::test_method": "passed"}
    assert plan.tampering(outcomes, collected=outcomes) == []


# Valid test files that once broke planting or made honest code look forged.
TRICKY = {
    "early-return": "def test_a():\n    try:\n        import no_such_module_x\n    except ImportError:\n        return\n    assert no_such_module_x.x == 1\n",
    "form-feed": "import os\n\x0c\ndef test_a():\n    x = 1\n    assert x == 1\n",
    "unicode-digit": "def test_a():\n    assert 'm' + '\u00b2' == 'm\u00b2'\n",
    "named-params": (
        "def pytest_generate_tests(metafunc):\n"
        "    if metafunc.function.__name__ in PARAMS:\n"
        "        metafunc.parametrize('x', PARAMS[metafunc.function.__name__])\n\n\n"
        "PARAMS = {'test_a': [1, 2]}\n\n\n"
        "def test_a(x):\n    assert x + 0 == x\n"
    ),
    "one-shot-params": (
        "import pytest\n\nCASES = zip([1, 2], [2, 4])\n\n\n"
        "@pytest.mark.parametrize('a, b', CASES)\ndef test_double(a, b):\n    assert a * 2 == b\n"
    ),
    "latin-1": "# -*- coding: latin-1 -*-\ndef test_a():\n    assert 'caf\u00e9'.upper() == 'CAF\u00c9'\n",
    "crlf-no-final-newline": "def test_a():\r\n    assert 1 + 1 == 2\r\n\r\ndef test_b():\r\n    assert [1] == [1]",
}


@pytest.mark.parametrize("case", sorted(TRICKY))
def test_tricky_files_still_parse_and_honest_runs_are_never_tampering(tmp_path, case):
    encoding = "latin-1" if case == "latin-1" else "utf-8"
    for seed in range(6):
        root = tmp_path / str(seed)
        (root / "src").mkdir(parents=True)
        (root / "tests").mkdir()
        (root / "tests" / "test_t.py").write_bytes(TRICKY[case].encode(encoding))
        plan = plant_canaries(root / "tests", rng=random.Random(seed))
        outcomes = run_pytest(root)
        assert plan.tampering(outcomes, collected=outcomes) == [], (case, seed)
        assert all(o == "passed" for n, o in plan.to_original(outcomes).items()), (case, seed, outcomes)
