"""Verifiers that compare the submitted answer with `task.answer`: exact-match, numeric, regex."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

from agentrl.core.episode import Episode
from agentrl.core.task import Task
from agentrl.sandbox.base import Sandbox
from agentrl.verifiers.base import Verdict


def _no_answer(task: Task, episode: Episode) -> Verdict | None:
    if task.answer is None:
        return Verdict(0.0, False, f"task {task.id} has no reference answer; this verifier needs task.answer")
    if episode.submission is None:
        return Verdict(0.0, False, f"nothing submitted (episode ended: {episode.finish_reason})")
    return None


def normalize_text(text: str, *, case_sensitive: bool = False) -> str:
    """Collapse whitespace, strip surrounding quotes and a trailing period; casefold unless asked not to."""
    text = " ".join(text.strip().split())
    text = text.strip("\"'`").rstrip(".").strip()
    return text if case_sensitive else text.casefold()


@dataclass
class ExactMatchVerifier:
    """Passes when the submission equals `task.answer` after normalisation (whitespace, quotes, case)."""

    case_sensitive: bool = False
    name: str = "exact-match"

    def verify(self, sandbox: Sandbox | None, task: Task, episode: Episode) -> Verdict:
        if (v := _no_answer(task, episode)) is not None:
            return v
        got = normalize_text(episode.submission or "", case_sensitive=self.case_sensitive)
        want = normalize_text(task.answer or "", case_sensitive=self.case_sensitive)
        ok = got == want
        return Verdict(float(ok), ok, f"submitted {got!r}, expected {want!r}")


_NUMBER = re.compile(r"[-+]?(?:\d[\d,_]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?:\s*/\s*\d+)?%?")


def parse_number(text: str) -> float | None:
    """The last number in `text`: '1,234.5', '-3/4', '12%', '$42', '2e3'. None when there is none."""
    matches = _NUMBER.findall(text.replace("−", "-"))
    if not matches:
        return None
    tok = matches[-1].replace(",", "").replace("_", "").replace(" ", "")
    percent = tok.endswith("%")
    tok = tok.rstrip("%")
    try:
        value = float(Fraction(tok)) if "/" in tok else float(tok)
    except (ValueError, ZeroDivisionError):
        return None
    return value / 100 if percent else value


@dataclass
class NumericVerifier:
    """Passes when the submitted number is within `rel_tol`/`abs_tol` of the reference (math.isclose)."""

    rel_tol: float = 1e-6
    abs_tol: float = 1e-9
    name: str = "numeric"

    def verify(self, sandbox: Sandbox | None, task: Task, episode: Episode) -> Verdict:
        if (v := _no_answer(task, episode)) is not None:
            return v
        want = parse_number(task.answer or "")
        if want is None:
            return Verdict(0.0, False, f"task {task.id}: reference answer {task.answer!r} is not a number")
        got = parse_number(episode.submission or "")
        if got is None:
            return Verdict(0.0, False, f"no number in the submission {episode.submission!r}")
        ok = math.isclose(got, want, rel_tol=self.rel_tol, abs_tol=self.abs_tol)
        return Verdict(float(ok), ok, f"submitted {got:g}, expected {want:g}")


@dataclass
class RegexVerifier:
    """Passes when the whole submission matches the pattern in `task.answer` (or `pattern`)."""

    pattern: str | None = None
    flags: int = re.IGNORECASE
    name: str = "regex"

    def verify(self, sandbox: Sandbox | None, task: Task, episode: Episode) -> Verdict:
        pattern = self.pattern or task.answer
        if pattern is None:
            return Verdict(0.0, False, "no pattern: set `pattern` or task.answer")
        if episode.submission is None:
            return Verdict(0.0, False, f"nothing submitted (episode ended: {episode.finish_reason})")
        ok = re.fullmatch(pattern, episode.submission.strip(), self.flags) is not None
        return Verdict(
            float(ok),
            ok,
            f"{episode.submission.strip()!r} {'matches' if ok else 'does not match'} /{pattern}/",
        )


@dataclass
class ToolUsedVerifier:
    """A format gate: passes when `tool` ran at least `min_calls` times in the episode.

    Counts calls that ran (`Episode.calls`), not calls attempted: a call refused for its
    arguments, for an unknown name, or past the step's limit did nothing and does not count.
    """

    tool: str = "python"
    min_calls: int = 1
    name: str = "tool-used"

    def verify(self, sandbox: Sandbox | None, task: Task, episode: Episode) -> Verdict:
        n = episode.calls_ran(self.tool)
        attempted = sum(1 for call in episode.calls if call.name == self.tool)
        ok = n >= self.min_calls
        refused = f" ({attempted - n} more attempted that did not run)" if attempted > n else ""
        return Verdict(float(ok), ok, f"{self.tool} ran {n} time(s){refused}, need {self.min_calls}")
