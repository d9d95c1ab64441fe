"""What one run of the hidden tests says: the runner's signed result stream, read and checked
record by record (`read_stream`), the per-test report it gives, and the score of a report.

Pure functions of text and a key: no sandbox, nothing of the agent's. Where the stream comes
from, and why each rule is there, is the docstring of `agentrl.verifiers.hidden_tests`."""

from __future__ import annotations

import ast
import hashlib
import hmac
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

# --- the report ----------------------------------------------------------------------------


Outcome = Literal["passed", "failed", "error", "skipped"]
_SEVERITY: dict[str, int] = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


@dataclass(frozen=True)
class CaseResult:
    """One test's outcome, or a module that failed to collect."""

    nodeid: str
    outcome: Outcome
    message: str = ""


@dataclass(frozen=True)
class Report:
    """Per-test outcomes, from the runner's result stream."""

    tests: dict[str, CaseResult] = field(default_factory=dict)
    collection_errors: list[CaseResult] = field(default_factory=list)

    def count(self, outcome: Outcome) -> int:
        return sum(t.outcome == outcome for t in self.tests.values())


# --- the result stream ---------------------------------------------------------------------


RECORD_KINDS: dict[str, tuple[type, ...]] = {
    "start": (int,),
    "runner_error": (str,),
    "collect_error": (str, str),
    "collected": (list,),
    "report": (str, str, str, str),
    "tamper": (str,),
    "internal_error": (str,),
    "end": (int,),
}
_PHASES = ("setup", "call", "teardown")
_REPORT_OUTCOMES = ("passed", "failed", "skipped", "xfailed", "xpassed")
_TRUNCATED = re.compile(r"\n\[agentrl: output truncated, \d+ bytes dropped\]\Z")


def sign(key: bytes, body: str) -> str:
    """The MAC of one record's body (what the runner writes before it), 32 hex digits."""
    return hmac.new(key, body.encode("utf-8", "backslashreplace"), hashlib.sha256).hexdigest()[:32]


@dataclass
class Stream:
    """What the runner's result stream says, after every check on it (see `read_stream`)."""

    started: bool = False
    tampered: list[str] = field(default_factory=list)
    """Why the stream cannot be trusted; non-empty means reward 0."""
    collected: list[str] | None = None
    outcomes: dict[str, CaseResult] = field(default_factory=dict)
    """Per test, the worst outcome of its phases (setup/teardown failures are errors)."""
    collect_errors: list[CaseResult] = field(default_factory=list)
    internal_errors: list[str] = field(default_factory=list)
    runner_errors: list[str] = field(default_factory=list)
    end: int | None = None
    cut: bool = False
    """The stream hit its size cap (`max_report_mb`)."""

    def report(self) -> Report:
        return Report(dict(self.outcomes), list(self.collect_errors))


def covered(nodeid: str, listed: set[str]) -> bool:
    """Whether a collected node id is one of the listed tests (a listed function id covers its
    parametrized variants)."""
    return nodeid in listed or nodeid.split("[", 1)[0] in listed


def read_stream(text: str, key: bytes, *, expected: list[str] | None = None) -> Stream:
    """Parse and check the runner's result stream (the rules are step 7 of the docstring of
    `agentrl.verifiers.hidden_tests`). The first record that breaks one ends the reading.

    `expected`: when the run was given exactly these node ids, every collected test must be
    one of them. Pure: no sandbox, so the rules are unit-tested on hand-made streams.
    """
    out = Stream()
    lines = _lines(text, out)
    phases: dict[str, dict[str, tuple[str, str]]] = {}
    listed = set(expected) if expected is not None else None
    for i, line in enumerate(lines):
        if (why := _take(out, i, line, key, listed, phases)) is not None:
            out.tampered.append(why)
            return out
    for nodeid, by_phase in phases.items():
        out.outcomes[nodeid] = _merge(nodeid, by_phase)
    return out


def _lines(text: str, out: Stream) -> list[str]:
    """The stream's records, one a line: a stream cut at its size cap loses its last, partial line
    (`out.cut`); an uncut one whose last line has no newline is marked."""
    if _TRUNCATED.search(text):
        out.cut = True
        text = _TRUNCATED.sub("", text)
        text = text[: text.rfind("\n") + 1]  # the line the cap cut in two is not a record
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    elif lines and not out.cut:
        out.tampered.append("the last record is cut short (no newline): the process wrote part of a line")
        lines.pop()
    return lines


def _parse(i: int, line: str, key: bytes) -> tuple[str, list[Any]] | str:
    """Record i's kind and fields when it is signed, in sequence and well-formed; else why not."""
    mac, _, body = line.partition("\t")
    if not hmac.compare_digest(mac.encode("ascii", "replace"), sign(key, body).encode()):
        return f"record {i} was not written by the runner (bad signature): {line[:120]!r}"
    parts = body.split("\t")
    if parts[0] != str(i):
        return f"record {i} is out of sequence (numbered {parts[0][:20]!r})"
    kind = parts[1] if len(parts) > 1 else ""
    types = RECORD_KINDS.get(kind)
    try:
        fields = [ast.literal_eval(p) for p in parts[2:]]
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return f"record {i} ({kind}) has a field that is not a literal"
    if (
        types is None
        or len(fields) != len(types)
        or not all(isinstance(f, t) for f, t in zip(fields, types, strict=True))
    ):
        return f"record {i} is malformed ({kind!r} with {len(fields)} field(s))"
    return kind, fields


def _take(
    out: Stream,
    i: int,
    line: str,
    key: bytes,
    listed: set[str] | None,
    phases: dict[str, dict[str, tuple[str, str]]],
) -> str | None:
    """Check record i against what came before it and add what it says to `out` (results to
    `phases`); why it cannot be trusted, or None."""
    parsed = _parse(i, line, key)
    if isinstance(parsed, str):
        return parsed
    kind, fields = parsed
    if i == 0 and kind != "start":
        return f"the stream does not open with `start` but with {kind!r}"
    if out.end is not None:
        return f"a {kind!r} record came after `end`: something wrote results after pytest finished"
    if kind == "start":
        if out.started:
            return "a second `start` record"
        out.started = True
    elif kind == "tamper":
        out.tampered.append(fields[0])
    elif kind == "runner_error":
        out.runner_errors.append(fields[0])
    elif kind == "internal_error":
        out.internal_errors.append(fields[0])
    elif kind == "collect_error":
        if out.collected is not None:
            return "a collection error was reported after collection had finished"
        out.collect_errors.append(CaseResult(fields[0], "error", fields[1]))
    elif kind == "collected":
        return _take_collected(out, fields[0], listed)
    elif kind == "report":
        return _take_report(out, fields, phases)
    elif kind == "end":
        out.end = fields[0]
    return None


def _take_collected(out: Stream, ids: list[Any], listed: set[str] | None) -> str | None:
    if out.collected is not None:
        return "a second list of collected tests"
    if not all(isinstance(x, str) for x in ids) or len(set(ids)) != len(ids):
        return "the collected tests are not a list of distinct node ids"
    if listed is not None:
        foreign = [x for x in ids if not covered(x, listed)]
        if foreign:
            return f"tests the task does not list were collected (made up?): {foreign[:3]}"
    out.collected = ids
    return None


def _take_report(out: Stream, fields: list[Any], phases: dict[str, dict[str, tuple[str, str]]]) -> str | None:
    nodeid, when, outcome, message = fields
    if out.collected is None:
        return f"a result for {nodeid} came before the tests were collected"
    if nodeid not in set(out.collected):
        return f"a result for a test that was never collected (made up): {nodeid}"
    if when not in _PHASES or outcome not in _REPORT_OUTCOMES:
        return f"a result with an unknown phase or outcome: {when!r} {outcome!r}"
    if when in phases.get(nodeid, {}):
        return f"a second result for {nodeid} ({when}): the first one stands, so this is forged"
    phases.setdefault(nodeid, {})[when] = (outcome, message)
    return None


def _merge(nodeid: str, by_phase: dict[str, tuple[str, str]]) -> CaseResult:
    """One test's outcome from its phases, as pytest's JUnit report counts it: a failed setup
    or teardown is an error, a failed call a failure, xfailed is skipped, xpassed is passed."""
    outcome: Outcome = "passed"
    message = ""
    for when in _PHASES:
        if when not in by_phase:
            continue
        raw, msg = by_phase[when]
        kind: Outcome = {
            "passed": "passed",
            "xpassed": "passed",
            "skipped": "skipped",
            "xfailed": "skipped",
            "failed": "failed" if when == "call" else "error",
        }[raw]  # type: ignore[assignment]
        if _SEVERITY[kind] > _SEVERITY[outcome]:
            outcome, message = kind, msg
    if "call" not in by_phase and outcome == "passed":
        outcome, message = "error", "the test never ran its call phase"
    return CaseResult(nodeid, outcome, message)


# --- the score -----------------------------------------------------------------------------


def _as_list(value: Any, source: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(
                f"{source} is a string but not a JSON list of test ids: {value[:200]!r}"
            ) from None
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{source} must be a list of pytest node ids (strings), got {value!r}")
    return list(value)


def _matches(entry: str, nodeid: str) -> bool:
    if "::" in entry:
        return nodeid == entry
    last = nodeid.rsplit("::", 1)[-1]
    return last == entry or last.split("[", 1)[0] == entry


def score(
    report: Report,
    *,
    mode: Literal["all", "fraction"] = "all",
    fail_to_pass: list[str] | None = None,
    pass_to_pass: list[str] | None = None,
) -> tuple[float, bool, str]:
    """Reward, passed, and a one-line summary for a report (see the module docstring)."""
    listed = [*(fail_to_pass or []), *(pass_to_pass or [])]
    if listed:
        failures: list[str] = []
        n_ok = 0
        for entry in dict.fromkeys(listed):  # a test in both lists counts once
            hits = [t for t in report.tests.values() if _matches(entry, t.nodeid)]
            if not hits:
                failures.append(f"{entry}: missing from the report (counts as failed)")
                continue
            bad = [t for t in hits if t.outcome != "passed"]
            if bad:
                failures.extend(f"{t.nodeid}: {t.outcome} {_first_line(t.message)}".rstrip() for t in bad)
            else:
                n_ok += 1
        total = len(dict.fromkeys(listed))
        what = f"{n_ok}/{total} of the FAIL_TO_PASS + PASS_TO_PASS tests passed"
    else:
        failures = [
            f"{t.nodeid}: {t.outcome} {_first_line(t.message)}".rstrip()
            for t in report.tests.values()
            if t.outcome != "passed"
        ]
        total = len(report.tests)
        n_ok = total - len(failures)
        if total == 0:
            return 0.0, False, "no hidden test ran"
        what = f"{n_ok}/{total} hidden tests passed"
    all_ok = n_ok == total
    reward = float(all_ok) if mode == "all" else n_ok / total
    summary = f"{what} (mode {mode})"
    if failures:
        shown = "; ".join(failures[:8])
        more = f"; ... {len(failures) - 8} more" if len(failures) > 8 else ""
        summary += f"; not passed: {shown}{more}"
    return reward, all_ok, summary


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:200] if text.strip() else ""
