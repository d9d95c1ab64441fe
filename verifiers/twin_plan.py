"""A twin-set plan: the sets of the FAIL_TO_PASS run, which member of each is real, and how to read
the run's outcomes. `agentrl.verifiers.twin_sets` makes one (`plan_twin_sets`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_ODDS = 32


@dataclass(frozen=True)
class TwinSet:
    """One failing test (or case) and its members. `real` never leaves the host."""

    originals: tuple[str, ...]
    """The task's node ids this set decides: one, or every listed variant of a test whose cases
    could not be split (each member runs them all)."""
    members: tuple[tuple[str, ...], ...]
    """Per member, its node ids in the decision folder, aligned with `originals`."""
    real: int
    how: str
    """What the members differ in: `literal`, `row` (a case's expected parameter), `raises`."""
    values: tuple[str, ...] = ()
    """Per member, its value where they differ, as written in its source (for measurements)."""
    linked: bool = False
    """An integer reflected about the buggy code's output: which of the two is real follows the way
    the bug errs, the same for every such set of the task, so together they are one guess of two."""


@dataclass
class DecisionPlan:
    """The FAIL_TO_PASS run: its folder, its twin sets, and how to read its outcomes."""

    sets: list[TwinSet] = field(default_factory=list)
    probed: list = field(default_factory=list, repr=False)
    uncovered: dict[str, str] = field(default_factory=dict)
    """FAIL_TO_PASS ids without a twin set, each with the reason."""
    files: dict[str, bytes] = field(default_factory=dict)
    """The decision folder: path relative to the hidden tests' root -> content."""
    target_odds: int = DEFAULT_ODDS

    @property
    def ids(self) -> list[str]:
        """Every member's node ids, sorted (the order carries nothing)."""
        return sorted({i for s in self.sets for m in s.members for i in m})

    @property
    def odds(self) -> int:
        """1 in this many: a guess of every set, uniformly among its members, is right (the linked
        sets, which share one way the bug errs, count once, as one guess of two)."""
        free = math.prod(len(s.members) for s in self.sets if not s.linked)
        return free * (2 if any(s.linked for s in self.sets) else 1)

    @property
    def short(self) -> bool:
        """The sets could not reach the target odds (too few values to draw from)."""
        return bool(self.sets) and self.odds < self.target_odds

    def write(self, root: Path) -> None:
        for rel, data in self.files.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)

    def tampering(self, outcomes: Mapping[str, str], collected: Iterable[str] | None = None) -> list[str]:
        """What honest code cannot make happen: two members of a set both passed, or a member
        was never collected (a forger that deselects the members it believes are twins)."""
        problems: list[str] = []
        seen = set(collected) if collected is not None else None
        for s in self.sets:
            for k, original in enumerate(s.originals):
                passing = [m for m in s.members if outcomes.get(m[k]) == "passed"]
                if len(passing) > 1:
                    problems.append(
                        f"{len(passing)} of the {len(s.members)} members of the twin set of {original} passed: "
                        f"their {_HOW[s.how]} contradict each other, so the outcomes were forged"
                    )
                if seen is not None and any(m[k] not in seen for m in s.members):
                    problems.append(f"a member of the twin set of {original} was not collected")
        return problems

    def real_outcomes(self, outcomes: Mapping[str, str]) -> dict[str, str]:
        """Each decided FAIL_TO_PASS id -> its real member's outcome (absent: not reported)."""
        out: dict[str, str] = {}
        for s in self.sets:
            for k, original in enumerate(s.originals):
                got = outcomes.get(s.members[s.real][k])
                if got is not None:
                    out[original] = got
        return out

    def real_ids(self) -> dict[str, str]:
        """Installed node id of each decided FAIL_TO_PASS test's real member -> the task's id."""
        return {s.members[s.real][k]: o for s in self.sets for k, o in enumerate(s.originals)}

    def summary(self) -> str:
        n = sum(len(s.members) for s in self.sets)
        text = f"{len(self.sets)} twin sets ({n} members; a blind guess wins 1 in {self.odds:,})"
        if self.uncovered:
            shown = ", ".join(list(self.uncovered)[:3]) + (", ..." if len(self.uncovered) > 3 else "")
            text += f", {len(self.uncovered)} FAIL_TO_PASS tests without one ({shown})"
        return text


_HOW = {
    "literal": "expected values",
    "row": "expected parameters",
    "raises": "expected exceptions",
}
