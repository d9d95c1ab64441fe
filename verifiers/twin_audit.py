"""Whether a task's twin sets hold against a reader of the run's files: many plans drawn on the host,
each read by the forgers that need no more than the decision folder, scored against a blind guess.

Twin members differ in one value, drawn so that the real one is no likelier than a twin to read
naturally by a model of the hidden tests' characters (`twin_values._members`). That holds against a
reader with the same model. A reader with another one can do better where the real value is a word
or repeats its own code: every member copies its test, so the strings there (the format
`"hello {}"` beside the expected `"hello world"`, the input `"ChildToy"` beside `"child_toys"`) are in
the folder once per member, and members drawn by how natural they read share the real value's
likelier characters. Two readers are played here, each on the folder alone, as a payload in the test
process could: *natural* (the member whose characters where the members differ make the pairs the
folder's strings hold most often, its own occurrence left out) and *majority* (the member whose
characters there the most members share). A task where either picks the real member of every set
more often than a blind guess at the plan's odds would (a binomial tail under `ALPHA`) is not fit
for training: `tasks synth` leaves it out and says why. So is a task whose draws reach the target odds
less than half the time (`REACH`): a verification draws again where a draw falls short, a bounded
number of times, and the readers are scored on the draws that reach the odds, as it uses them.
"""

from __future__ import annotations

import ast
import math
import random
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.verifiers.twin_plan import DecisionPlan, TwinSet
from agentrl.verifiers.twin_values import _own_pairs

READERS = ("natural", "majority")
"""The forgers `reader_audit` plays, in its report's order."""

PLANS = 20
"""Plans drawn per task: enough that a reader right 4 times in 20 at odds 1 in 32 stands out."""

ALPHA = 0.005
"""The binomial tail under which a reader's wins are not luck (0.01 over the two readers)."""

REACH = 0.5
"""The least share of draws that must reach the target odds for a task to be fit."""


@dataclass
class ReaderAudit:
    """A task's plans as the readers saw them."""

    plans: int = 0
    """Plans drawn that reach the target odds (a verification draws again where one falls short)."""
    drawn: int = 0
    """Plans drawn in all."""
    blind: float = 0.0
    """Whole plans a blind guess wins, expected (the sum of 1 / odds)."""
    wins: dict[str, float] = field(default_factory=dict)
    """Whole plans each reader wins, expected (its ties broken at random)."""
    tails: dict[str, float] = field(default_factory=dict)
    """Per reader, the chance of that many wins or more by guessing."""

    @property
    def leaks(self) -> bool:
        return any(p < ALPHA for p in self.tails.values())

    @property
    def short(self) -> bool:
        """The draws reach the target odds too rarely (`REACH`) for a verification to count on it."""
        return self.plans < REACH * self.drawn

    @property
    def fit(self) -> bool:
        """Fit for training: the draws usually reach the odds, and no reader beats a guess."""
        return not self.short and not self.leaks

    def reason(self) -> str:
        """One line for `tasks synth`'s report: why the task is not fit."""
        if self.short:
            return f"its twin sets reach the target odds in only {self.plans} of {self.drawn} draws"
        name = min(self.tails, key=lambda k: self.tails[k])
        return (
            f"a reader of the run's files ({name}) picks the real member of every set in "
            f"{self.wins[name]:.1f} of {self.plans} plans, where a blind guess would in {self.blind:.1f}"
        )

    def as_dict(self) -> dict:
        return {
            "plans": self.plans,
            "drawn": self.drawn,
            "short": self.short,
            "blind": round(self.blind, 3),
            "wins": {k: round(v, 3) for k, v in self.wins.items()},
            "tails": {k: float(f"{v:.3g}") for k, v in self.tails.items()},
            "leaks": self.leaks,
        }


def reader_audit(draw: Callable[[random.Random], DecisionPlan], *, plans: int = PLANS) -> ReaderAudit:
    """Draw `plans` plans with `draw` (fixed seeds: the audit of a task is the same on every run)
    and play the readers on each (`READERS`)."""
    out = ReaderAudit(wins=dict.fromkeys(READERS, 0.0))
    for k in range(plans):
        plan = draw(random.Random(k))
        out.drawn += 1
        if not plan.sets or plan.odds < plan.target_odds:
            continue
        out.plans += 1
        out.blind += 1 / plan.odds
        counts = _folder_pairs(plan.files)
        for name in READERS:
            out.wins[name] += _plan_win(plan, name, counts)
    p = out.blind / out.plans if out.plans else 0.0
    out.tails = {name: binomial_tail(math.floor(w + 1e-9), out.plans, p) for name, w in out.wins.items()}
    return out


def audit_task(hidden: Path, fail_to_pass: list[str], *, plans: int = PLANS, **planned: Any) -> ReaderAudit:
    """`reader_audit` over the plans a verification of this task would draw: `planned` are
    `plan_twin_sets`'s keyword arguments (`listed`, `avoid`, `odds`, `failing_lines`, ...), `rng` aside."""
    from agentrl.verifiers.twin_sets import plan_twin_sets

    return reader_audit(lambda rng: plan_twin_sets(hidden, fail_to_pass, rng=rng, **planned), plans=plans)


def _folder_pairs(files: Mapping[str, bytes]) -> Counter:
    """What the decision folder's string constants are made of, every occurrence counted."""
    out: Counter = Counter()
    for rel, content in files.items():
        if not rel.endswith(".py"):
            continue
        try:
            tree = ast.parse(content)
        except (SyntaxError, ValueError):
            continue
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str):
                out.update(_own_pairs(n.value))
    return out


def _strings(s: TwinSet) -> tuple[list[str], list[int]] | None:
    """A set's members as strings of one length and the places they differ at, else None."""
    try:
        values = [ast.literal_eval(v) for v in s.values]
    except (ValueError, SyntaxError):
        return None
    if not values or not all(isinstance(v, str) for v in values) or len({len(v) for v in values}) != 1:
        return None
    return values, [k for k in range(len(values[0])) if len({v[k] for v in values}) > 1]


def _scores(name: str, values: list[str], differ: list[int], counts: Counter) -> list[float]:
    if name == "majority":
        column = [Counter(v[k] for v in values) for k in differ]
        return [sum(c[v[k]] for c, k in zip(column, differ, strict=True)) for v in values]
    out = []
    for v in values:
        own, t = _own_pairs(v), f"\x02{v}\x03"
        out.append(
            sum(
                math.log1p(max(0, counts[key] - own[key]))
                for k in differ
                for key in (t[k : k + 2], t[k + 1 : k + 3])
            )
        )
    return out


def _plan_win(plan: DecisionPlan, name: str, counts: Counter) -> float:
    """The chance the reader picks the real member of every set (a set it cannot read: a guess)."""
    read = 1.0
    guessed = 1  # the members of the sets read, whose guesses `plan.odds` holds
    for s in plan.sets:
        found = _strings(s)
        if found is None:
            continue
        values, differ = found
        scores = _scores(name, values, differ, counts)
        top = max(scores)
        tied = [i for i, x in enumerate(scores) if x >= top - 1e-9]
        read *= (s.real in tied) / len(tied)
        guessed *= len(values)
    return read * guessed / plan.odds


def binomial_tail(wins: int, n: int, p: float) -> float:
    """P(X >= wins) for X ~ Binomial(n, p)."""
    if wins <= 0:
        return 1.0  # exactly, not a float sum of every term
    return min(1.0, sum(math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(wins, n + 1)))
