"""The readers' audit of a task's twin sets: a reader of the run's files that picks the real member
more often than a guess marks the task; one at chance does not; the audit is the same on every run."""

from __future__ import annotations

import random

from agentrl.verifiers.twin_audit import ALPHA, PLANS, READERS, audit_task, binomial_tail, reader_audit
from agentrl.verifiers.twin_plan import DecisionPlan, TwinSet

LETTERS = "bcdfghjklmnpqrstvwxz"
CHARACTERS = LETTERS + "0123456789AE"  # 32


def _plan(values: list[str], real: int, folder: str) -> DecisionPlan:
    """A plan of one string set of these members, its folder holding `folder` as a string constant."""
    s = TwinSet(
        originals=("test_x.py::test_a",),
        members=tuple((f"test_x.py::test_{i}",) for i in range(len(values))),
        real=real,
        how="literal",
        values=tuple(repr(v) for v in values),
    )
    return DecisionPlan(sets=[s], files={"test_x.py": f"X = {folder!r}\n".encode()})


def test_a_reader_that_sees_the_real_members_pairs_in_the_folder_marks_the_task():
    # The folder repeats the real value's pairs (as a test's own input does, once per member): the
    # natural reader picks it in every plan, where a guess among 32 would once in 32.
    def draw(rng: random.Random) -> DecisionPlan:
        twins = rng.sample([f"ab{x}{y}" for x in LETTERS for y in LETTERS if (x, y) != ("c", "d")], 31)
        values = ["abcd", *twins]
        rng.shuffle(values)
        return _plan(values, values.index("abcd"), "abcd abcd bcd")

    audit = reader_audit(draw)
    assert audit.plans == PLANS
    assert audit.wins["natural"] == PLANS
    assert abs(audit.blind - PLANS / 32) < 1e-9
    assert audit.tails["natural"] < ALPHA and audit.leaks and not audit.fit
    assert "natural" in audit.reason() and f"{PLANS:.1f} of {PLANS} plans" in audit.reason()
    assert set(audit.as_dict()["wins"]) == set(READERS)


def test_a_reader_with_nothing_to_go_on_wins_what_a_guess_wins():
    # Members alike but for one letter, nothing in the folder about any of them, the real one at a
    # random place: every reader meets ties and wins 1 in 32, as a guess does.
    def draw(rng: random.Random) -> DecisionPlan:
        values = [f"ab{c}d" for c in rng.sample(CHARACTERS, 32)]
        return _plan(values, rng.randrange(32), "nothing here")

    audit = reader_audit(draw)
    assert audit.plans == PLANS
    for name in READERS:
        assert abs(audit.wins[name] - audit.blind) < 1e-9
    assert not audit.leaks and audit.fit


def test_a_majority_of_members_sharing_the_real_characters_marks_the_task():
    # Members drawn near the real value share its characters: at each place the real one's is the
    # commonest, and the member holding both is the real one.
    def draw(rng: random.Random) -> DecisionPlan:
        real = "pq"
        twins = [f"p{c}" for c in "bcdfghjk"] + [f"{c}q" for c in "bcdfghjk"]
        twins += [f"{a}{b}" for a, b in zip("bcdfghjklmnrstvw", "wvtsrnmlkjhgfdcb", strict=True)]
        values = [real, *twins][:32]
        rng.shuffle(values)
        return _plan(values, values.index(real), "")

    audit = reader_audit(draw)
    assert audit.wins["majority"] == PLANS and audit.leaks


def test_sets_that_fall_short_of_the_odds_are_not_counted():
    def draw(rng: random.Random) -> DecisionPlan:
        return _plan(["abcd", "abxd"], 0, "abcd")  # 1 in 2: never used as it is

    audit = reader_audit(draw)
    assert audit.plans == 0 and audit.drawn == PLANS and not audit.leaks
    assert audit.short and not audit.fit and f"only 0 of {PLANS} draws" in audit.reason()


def test_a_task_whose_draws_reach_the_odds_less_than_half_the_time_is_not_fit():
    # A verification draws again where a draw falls short; a task that needs many redraws is left out.
    def draw(rng: random.Random, reach: float) -> DecisionPlan:
        n = 32 if rng.random() < reach else 4
        values = [f"ab{c}d" for c in rng.sample(CHARACTERS, n)]
        return _plan(values, rng.randrange(n), "nothing here")

    rarely = reader_audit(lambda rng: draw(rng, 0.25))
    assert rarely.short and not rarely.fit and not rarely.leaks
    assert 0 < rarely.plans < PLANS / 2 and rarely.as_dict()["short"]
    mostly = reader_audit(lambda rng: draw(rng, 0.9))
    assert mostly.plans >= PLANS / 2 and mostly.fit


def test_the_binomial_tail():
    assert binomial_tail(0, 20, 1 / 32) == 1.0
    assert abs(binomial_tail(1, 1, 0.5) - 0.5) < 1e-12
    assert abs(binomial_tail(4, 20, 1 / 32) - 0.00309) < 1e-5  # 4 wins in 20 at 1 in 32 stands out
    assert binomial_tail(2, 20, 1 / 32) > 0.1


def test_a_task_whose_expected_string_its_own_code_spells_out_is_marked(tmp_path):
    """Planned from hidden tests as a verification plans them: the expected value is the test's format
    filled in, the format in every member's code; the natural reader finds the real member."""
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "test_fmt.py").write_text(
        'from lib import fill\n\n\ndef test_fill():\n    assert fill("hello {}", "world") == "hello world"\n'
    )
    first = audit_task(hidden, ["test_fmt.py::test_fill"])
    second = audit_task(hidden, ["test_fmt.py::test_fill"])
    assert first.as_dict() == second.as_dict()  # the same plans on every run
    assert first.plans > 0 and first.leaks, first.as_dict()
