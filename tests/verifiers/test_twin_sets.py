"""Twin sets for FAIL_TO_PASS tests, on the host with the real pytest and the real runner: on the
correct code the real member of every set passes and the others fail; on the buggy code every member
fails; forged outcomes are caught; parametrized cases are split by pytest's own ids; the runner's
settings are out of reach; and the forgers of the audit find the sets but not the real member."""

from __future__ import annotations

import ast
import os
import random
import secrets
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from agentrl.checks.attacks_forgers import forger_payload
from agentrl.verifiers.hidden_tests import read_stream, runner_input
from agentrl.verifiers.twin_audit import binomial_tail
from agentrl.verifiers.twin_sets import _parametrize, match_rows, plan_twin_sets

BUGGY = "def add(a, b):\n    return a + b + 1\n\n\ndef shout(s):\n    return s.upper()\n\n\ndef check(x):\n    return x\n"
FIXED = "def add(a, b):\n    return a + b\n\n\ndef shout(s):\n    return s.upper() + '!'\n\n\ndef check(x):\n    if x < 0:\n        raise ValueError(x)\n    return x\n"
TESTS = """
import pytest
from lib import add, check, shout

CASES = [(1, 2, 13), (20, 22, 42), (5, 6, 111)]


def test_add():
    assert add(7, 8) == 15
    assert add(40, 50) == 90


@pytest.mark.parametrize("a, b, want", [(10, 20, 30), (3, 4, 17), (5, 6, 11)])
def test_add_cases(a, b, want):
    assert add(a, b) == want


@pytest.mark.parametrize("text, want", [("hey", "HEY!"), ("ho", "HO!"), ("Let us go", "LET US GO!")])
def test_shout(text, want):
    assert shout(text) == want


def test_check_raises():
    with pytest.raises(ValueError):
        check(-1)


def test_only_a_truth():
    assert add(1, 1)


def test_echo():
    assert add(7, 0) == 7


class TestThings:
    def test_in_class(self):
        assert shout("abc") == "ABC!"
"""
F2P = [
    "test_x.py::test_add",
    "test_x.py::test_add_cases[10-20-30]",
    "test_x.py::test_add_cases[5-6-11]",
    "test_x.py::test_shout[hey-HEY!]",
    "test_x.py::test_shout[Let us go-LET US GO!]",
    "test_x.py::test_check_raises",
    "test_x.py::TestThings::test_in_class",
]
LISTED = [*F2P, "test_x.py::test_add_cases[3-4-17]", "test_x.py::test_shout[ho-HO!]"]


def lay_out(root: Path) -> Path:
    tests = root / "hidden"
    tests.mkdir(parents=True)
    (tests / "test_x.py").write_text(TESTS.lstrip())
    return tests


def run_runner(tests: Path, lib: str, ids: list[str], *, payload: str = "") -> dict[str, str]:
    """{node id: outcome} of the real runner over `tests`, the workspace holding `lib` (and `payload`)."""
    root = tests.parent
    ws = root / f"ws-{secrets.token_hex(4)}"
    ws.mkdir()
    (ws / "lib.py").write_text(lib + ("\n" + payload if payload else ""))
    ini = root / "pytest.ini"
    ini.write_text("[pytest]\n")
    scratch = root / f"scratch-{secrets.token_hex(4)}"
    config = {
        "scratch": str(scratch),
        "tests_dir": str(tests),
        "import_paths": [str(ws)],
        "message_chars": 300,
        "args": ["-c", str(ini), f"--rootdir={tests}", "-p", "no:cacheprovider", "-q", str(tests)],
        "select": sorted(ids),
        "env": {"PATH": os.environ["PATH"], "HOME": str(scratch), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
    }
    key = secrets.token_bytes(32)
    argv, stdin = runner_input(config, key, sys.executable)
    proc = subprocess.run(argv, input=stdin, capture_output=True, timeout=120)
    s = read_stream(proc.stdout.decode(), key, expected=ids)
    assert not s.tampered and not s.collect_errors and s.end is not None, (s.tampered, proc.stderr[-2000:])
    return {k: v.outcome for k, v in s.outcomes.items()}


# What each failing check compared on the buggy code (`tasks synth` reads it off pytest's report):
# no member may expect the buggy output, or it would pass there and be known for a twin.
COMPARED = {
    "test_x.py::test_add": ["16", "15"],
    "test_x.py::test_add_cases[10-20-30]": ["31", "30"],
    "test_x.py::test_add_cases[5-6-11]": ["12", "11"],
}


def plan_into(root: Path, hidden: Path, seed: int, **kw) -> tuple:
    plan = plan_twin_sets(hidden, F2P, listed=LISTED, failing_values=COMPARED, rng=random.Random(seed), **kw)
    folder = root / f"decision-{seed}"
    folder.mkdir()
    plan.write(folder)
    return plan, folder


@pytest.mark.parametrize("seed", range(3))
def test_the_real_member_passes_on_correct_code_and_every_member_fails_on_the_bug(tmp_path, seed):
    hidden = lay_out(tmp_path)
    plan, folder = plan_into(tmp_path, hidden, seed)
    # Covered: the plain test, each failing case of the two parametrized ones, the raises, the method.
    assert set(plan.uncovered) == set()
    assert sorted(o for s in plan.sets for o in s.originals) == sorted(F2P)
    assert {s.how for s in plan.sets} == {"literal", "row", "raises"}
    assert plan.odds >= 32
    fixed = run_runner(folder, FIXED, plan.ids)
    assert plan.tampering(fixed, collected=fixed) == []
    assert plan.real_outcomes(fixed) == dict.fromkeys(F2P, "passed")
    others = [
        o for s in plan.sets for i, m in enumerate(s.members) if i != s.real for o in (fixed[x] for x in m)
    ]
    assert others and set(others) == {"failed"}
    buggy = run_runner(folder, BUGGY, plan.ids)
    assert set(buggy.values()) == {
        "failed"
    }  # no member passes on the buggy code: nothing to tell them apart by


def test_the_folder_holds_only_the_members_and_no_other_copy_of_the_truth(tmp_path):
    hidden = lay_out(tmp_path)
    plan, folder = plan_into(tmp_path, hidden, 0)
    text = (folder / "test_x.py").read_text()
    # The failing tests' originals, the passing cases' rows and the unused table are gone.
    assert "def test_add(" not in text and "def test_add_cases(" not in text and "CASES" not in text
    assert "(3, 4, 17)" not in text and '"HO!"' not in text
    assert "def test_only_a_truth" not in text and "def test_echo" not in text
    # Members are renamed, none keeps its test's name; each case's values are its defaults.
    assert all(not m[0].endswith(("::test_add", "::test_shout")) for s in plan.sets for m in s.members)
    assert "want=30" in text or "want=11" in text
    assert plan.ids == sorted(plan.ids)


def test_what_no_twin_set_can_cover_is_listed_with_the_reason(tmp_path):
    hidden = lay_out(tmp_path)
    plan = plan_twin_sets(
        hidden,
        ["test_x.py::test_only_a_truth", "test_x.py::test_echo", "test_x.py::test_gone"],
        rng=random.Random(0),
    )
    assert not plan.sets
    assert "no value" in plan.uncovered["test_x.py::test_only_a_truth"]  # a truth check only: a bool
    assert "no value" in plan.uncovered["test_x.py::test_echo"]  # 7 is its own input too
    assert "not defined" in plan.uncovered["test_x.py::test_gone"]


def test_members_differ_only_where_the_test_fails_on_the_buggy_code(tmp_path):
    hidden = lay_out(tmp_path)
    # test_add fails on its first line: only that literal may differ (the second would pass there).
    plan = plan_twin_sets(
        hidden, ["test_x.py::test_add"], failing_lines={"test_x.py::test_add": 8}, rng=random.Random(1)
    )
    text = plan.files["test_x.py"].decode()
    assert text.count("add(40, 50) == 90") == len(plan.sets[0].members)
    # A line no always-reached check sits on: nothing to differ in.
    plan = plan_twin_sets(
        hidden, ["test_x.py::test_add"], failing_lines={"test_x.py::test_add": 1}, rng=random.Random(1)
    )
    assert not plan.sets and "test_x.py::test_add" in plan.uncovered


def test_a_value_the_prompt_quotes_is_never_the_one_members_differ_in(tmp_path):
    hidden = lay_out(tmp_path)
    plan = plan_twin_sets(hidden, ["test_x.py::test_add"], avoid="add(7, 8) == 15", rng=random.Random(2))
    text = plan.files["test_x.py"].decode()
    assert text.count("add(7, 8) == 15") == len(plan.sets[0].members)  # the other check differs
    plan = plan_twin_sets(hidden, ["test_x.py::test_add"], avoid="E   assert 15 == 90", rng=random.Random(2))
    assert not plan.sets


def test_probed_sites_only(tmp_path):
    hidden = lay_out(tmp_path)
    plan = plan_twin_sets(hidden, ["test_x.py::test_add"], safe_sites=[], rng=random.Random(0))
    assert not plan.sets and "equality does not ignore" in plan.uncovered["test_x.py::test_add"]


def test_a_forged_pair_and_a_member_left_out_are_tampering(tmp_path):
    hidden = lay_out(tmp_path)
    plan, _ = plan_into(tmp_path, hidden, 0)
    s = plan.sets[0]
    outcomes = {i: "failed" for i in plan.ids}
    outcomes.update(dict.fromkeys(s.members[0], "passed"))
    outcomes.update(dict.fromkeys(s.members[1], "passed"))
    assert any("contradict each other" in p for p in plan.tampering(outcomes, collected=outcomes))
    left_out = [i for i in plan.ids if i not in s.members[1]]
    assert any("not collected" in p for p in plan.tampering({}, collected=left_out))


@pytest.mark.parametrize(
    ("values", "ids"),
    [
        ('[(1, "a"), (2.5, "b c"), (None, True)]', ["1-a", "2.5-b c", "None-True"]),
        ('[("é", b"x\\x00"), ("a\\nb", -3)]', ["\\xe9-x\\x00", "a\\nb--3"]),
        ("[(1, 1), (1, 1), (2, [1])]", ["1-1", "1-1", "2-x1"]),
        ('[pytest.param(1, 2, id="named"), (3, {"k": 1})]', ["named", "3-x1"]),
    ],
)
def test_case_ids_are_read_as_pytest_names_them(tmp_path, values, ids):
    """The ids `match_rows` computes for literal cases are the ones the real pytest collects."""
    import ast

    src = (
        f"import pytest\n\n@pytest.mark.parametrize('x, y', {values})\ndef test_p(x, y):\n    assert x == y\n"
    )
    (tmp_path / "test_p.py").write_text(src)
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "test_p.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    collected = [ln.split("[", 1)[1][:-1] for ln in res.stdout.splitlines() if ln.startswith("test_p.py::")]
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef))
    params = _parametrize(fn, {})
    assert params is not None
    rows = match_rows(params, [f"[{c}]" for c in collected])
    assert rows is not None, collected
    assert [rows[f"[{c}]"] for c in collected] == list(range(len(collected)))
    del ids  # the expectation is pytest's own collection, whatever its version names duplicates


def test_sets_grow_where_they_cost_least_until_a_guess_pays_1_in_odds(tmp_path):
    hidden = lay_out(tmp_path)
    plan = plan_twin_sets(hidden, ["test_x.py::test_check_raises"], odds=8, rng=random.Random(0))
    assert len(plan.sets[0].members) == 8 and plan.odds == 8 and not plan.short
    plan = plan_twin_sets(hidden, F2P, listed=LISTED, odds=1000, rng=random.Random(0))
    assert plan.odds >= 1000 and all(len(s.members) >= 2 for s in plan.sets)


# --- the runner's settings, and the audit's forgers --------------------------------------------------

SNOOP = """
import sys as _s
if "_pytest" in _s.modules and not getattr(_s, "_snooped", False):
    _s._snooped = True
    main = _s.modules.get("__main__")
    found = {"CONFIG": hasattr(main, "CONFIG"), "select": None}
    f = _s._getframe()
    while f is not None:
        if "config" in f.f_locals and isinstance(f.f_locals["config"], dict):
            found["frame"] = True
        f = f.f_back
    open(__SNOOP_FILE__, "w").write(repr(found))
"""


def test_the_runner_s_settings_are_not_in_reach_of_the_code_under_test(tmp_path):
    hidden = lay_out(tmp_path)
    plan, folder = plan_into(tmp_path, hidden, 0)
    run_runner(
        folder, FIXED, plan.ids, payload=SNOOP.replace("__SNOOP_FILE__", repr(str(tmp_path / "snoop.txt")))
    )
    seen = (tmp_path / "snoop.txt").read_text()
    assert "'CONFIG': False" in seen and "frame" not in seen, seen


@pytest.mark.parametrize(
    "mode", ["coin", "plan-order", "form", "prerun", "nearest", "prompt", "natural", "majority"]
)
def test_the_forgers_find_the_sets_but_win_no_more_than_a_guess(tmp_path, mode):
    """Each forger forges exactly one member per set (no tampering recorded: its pair detector found
    every set), and over a few plans wins no more often than a blind guess at the plans' odds."""
    hidden = lay_out(tmp_path)
    wins, odds = 0, []
    for seed in range(3):
        plan, folder = plan_into(tmp_path, hidden, 100 + seed)
        out = run_runner(folder, BUGGY, plan.ids, payload=forger_payload(mode, "Fix add."))
        assert plan.tampering(out, collected=out) == [], mode
        passing = Counter(sum(all(out[x] == "passed" for x in m) for m in s.members) for s in plan.sets)
        assert passing == Counter({1: len(plan.sets)}), passing  # one member forged per set
        wins += all(v == "passed" for v in plan.real_outcomes(out).values())
        odds.append(plan.odds)
    assert binomial_tail(wins, 3, 1 / min(odds)) > 0.01 if wins else True


def test_a_leaky_prompt_is_what_the_prompt_forger_needs(tmp_path):
    """The forging itself works: handed the real members' values, the prompt forger wins."""
    hidden = lay_out(tmp_path)
    plan, folder = plan_into(tmp_path, hidden, 7)
    text = (folder / "test_x.py").read_text()
    leak = []
    for s in plan.sets:
        name = s.members[s.real][0].split("::")[-1]
        start = text.index(f"def {name}(")
        end = text.find("\n\n", start)
        leak.append(text[start : end if end > 0 else len(text)])
    out = run_runner(folder, BUGGY, plan.ids, payload=forger_payload("prompt", "\n".join(leak)))
    assert plan.tampering(out, collected=out) == []
    assert set(plan.real_outcomes(out).values()) == {"passed"}


def test_an_unnatural_twin_is_what_the_natural_forger_needs(tmp_path):
    """The forging itself works: of three members, the one whose differing letter the author's other
    strings use in its pairs is forged to pass, the two odd ones to fail."""
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    body = "    assert greet() == {!r}\n"
    words = {"a": "the other thing", "b": "the othqr thing", "c": "the othxr thing"}
    (hidden / "test_g.py").write_text(
        "from lib import greet\n\nWORDS = ['there', 'other', 'where', 'her', 'here']\n\n\n"
        + "\n\n".join(f"def test_{k}():\n" + body.format(v) for k, v in words.items())
    )
    ids = [f"test_g.py::test_{k}" for k in words]
    out = run_runner(hidden, "def greet():\n    return 'x'\n", ids, payload=forger_payload("natural"))
    assert out == {ids[0]: "passed", ids[1]: "failed", ids[2]: "failed"}, out


@pytest.mark.parametrize("seed", range(6))
def test_members_never_differ_inside_a_word_the_prompt_quotes(tmp_path, seed):
    # The bug report shows a package frame that names the class: a member edited inside that name
    # would quote the prompt less than the real one, and the prompt forger would pick the real one.
    hidden = tmp_path / f"hidden-{seed}"
    hidden.mkdir()
    (hidden / "test_tz.py").write_text(
        "from tz import Offset\n\n\ndef test_repr():\n    assert repr(Offset(0)) == '<FixedTzOffset UTC 0:00:00>'\n"
    )
    prompt = '    >   return "<%s %s %s>" % (self.__class__.__name__, self._name)\nFixedTzOffset raised'
    plan = plan_twin_sets(hidden, ["test_tz.py::test_repr"], avoid=prompt, rng=random.Random(seed))
    [tset] = plan.sets
    assert len(set(tset.values)) == len(tset.values) > 1
    assert all("<FixedTzOffset " in v for v in tset.values), tset.values


def test_the_folder_keeps_the_support_data_when_a_case_is_split_off(tmp_path):
    """A data file beside the tests goes into the folder with the members, whether the failing test is
    a whole function or one case of a parametrized one (with a mark of its own, which a case's member
    keeps)."""
    hidden = lay_out(tmp_path)
    (hidden / "data.txt").write_text("spam\n")
    text = (hidden / "test_x.py").read_text()
    (hidden / "test_x.py").write_text(
        text.replace("@pytest.mark.parametrize", "@pytest.mark.slow\n@pytest.mark.parametrize", 1)
    )
    for f2p in (["test_x.py::test_add"], ["test_x.py::test_add_cases[10-20-30]"]):
        plan = plan_twin_sets(hidden, f2p, listed=LISTED, rng=random.Random(0))
        assert plan.sets and not plan.uncovered, plan.uncovered
        assert plan.files["data.txt"] == b"spam\n"
        if "[" in f2p[0]:
            assert "@pytest.mark.slow" in plan.files["test_x.py"].decode()


WORDS = [
    "person", "people", "octopus", "octopi", "quizzes", "matrices", "statuses", "aliases", "oxen", "mice",
    "vertices", "criteria", "analyses", "wolves", "leaves", "CamelCase", "under_score", "Humanize",
    "Ordinal", "dasherize", "HTTPError", "v1.2.0-beta", "2024-06-01", "x86_64", "Some Title", "ID:42",
]  # fmt: skip


def _kinds(text: str) -> list[str]:
    def kind(c: str) -> str:
        if c.isdigit():
            return "digit"
        if not c.isalpha():
            return "other"
        return ("vowel" if c.lower() in "aeiou" else "consonant") + (" capital" if c.isupper() else "")

    return sorted(map(kind, text))


def test_string_members_have_as_many_of_each_kind_of_character_as_the_real_one(tmp_path):
    """Members differ from the real value in characters of the same kind (a lowercase or capital
    vowel or consonant, a digit, punctuation), so no rule that counts a kind can tell them apart:
    over many plans the member with the fewest vowels (or the most capitals, digits, punctuation) is
    the real one exactly as often as chance. Drawn by case alone (a vowel swapped for any lowercase
    letter), members' vowels differed, and on 40 synthesized tasks the member with the fewest vowels
    was the real one in 50.3% of sets against 47.4% by chance: this fails that draw at once."""
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    body = "".join(f"\n\ndef test_{k}():\n    assert f({w[::-1]!r}) == {w!r}\n" for k, w in enumerate(WORDS))
    (hidden / "test_w.py").write_text("from lib import f\n" + body)
    ids = [f"test_w.py::test_{k}" for k in range(len(WORDS))]

    def buggy(word: str, i: int, edits: int) -> str:  # what the bug returned: 1 or 2 characters off
        for j in range(edits):
            at = (i + 3 * j) % len(word)
            word = word[:at] + ("q" if word[at] != "q" else "z") + word[at + 1 :]
        return word

    rules = {
        "fewest vowels": lambda v: -sum(c.lower() in "aeiou" for c in v),
        "most capitals": lambda v: sum(c.isupper() for c in v),
        "most digits": lambda v: sum(c.isdigit() for c in v),
        "most punctuation": lambda v: sum(not c.isalnum() for c in v),
    }
    excess = dict.fromkeys(rules, 0.0)
    paths, n = Counter(), 0
    for i in range(120):
        chosen = random.Random(i).sample(range(len(WORDS)), 5)
        # No output of the buggy code known (two positions differ), one edit from it, two edits.
        edits = i % 3
        values = (
            {ids[k]: [repr(buggy(WORDS[k], i, edits)), repr(WORDS[k])] for k in chosen} if edits else None
        )
        plan = plan_twin_sets(hidden, [ids[k] for k in chosen], failing_values=values, rng=random.Random(i))
        for s in plan.sets:
            members = [ast.literal_eval(v) for v in s.values]
            assert all(_kinds(m) == _kinds(members[s.real]) for m in members), members
            for name, rule in rules.items():
                scores = [rule(m) for m in members]
                tied = [j for j, x in enumerate(scores) if x == max(scores)]
                excess[name] += (s.real in tied) / len(tied) - 1 / len(members)
            paths[edits] += 1
            n += 1
    assert n > 400 and all(paths[e] > 100 for e in range(3)), paths
    # A signal of the old size (+2.9 points a set) would be ~12 sets here; ties leave exactly 0.
    assert all(abs(x) / n < 0.01 for x in excess.values()), {k: x / n for k, x in excess.items()}
