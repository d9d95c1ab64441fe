"""The task synthesizer: plant a bug in a real package, keep it only if the package's own tests catch it.

Per package, in one sandbox of the package's image that is reused for every mutant:

1. the pristine source is staged into /workspace and the package's test suite copied under
   /verifier; the suite runs twice on the original (a test that passes once and fails once is
   flaky and never used), giving the baseline set of passing tests;
2. candidate mutations (`mutate.enumerate_sites` over the package's target modules) are put
   in a fixed order by the seed: functions shuffled, each function's sites shuffled, then
   taken round-robin across functions so that one big function cannot take the whole quota;
3. each mutant is written over its module, the suite runs, the original module is written
   back. A mutant is kept when at least one baseline-passing test fails (FAIL_TO_PASS) and
   at most `max_fail_fraction` of them do (a bug that breaks most of the suite is an import
   error in disguise, not a bug report); every other baseline-passing test is PASS_TO_PASS.

Tests run exactly as the `hidden-tests` verifier runs them (its runner, ini file, arguments
and result stream), so the node ids recorded here are the ones it will look up.

Everything is deterministic from the seed and cached as an append-only trial log per package
(`<cache>/synth/<package>-<version>-seed<S>-v<N>.jsonl`): a later call with a larger `n`
resumes where the log stops; the same call again costs nothing. Each trial records what was
tried and why it was kept or rejected, which is where the statistics come from.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentrl.core.task import Task
from agentrl.core.types import Split
from agentrl.envs.python_repair.images import ensure_image, stage_source
from agentrl.envs.python_repair.mutate import MutationError, Site, apply_site, enumerate_sites, is_equivalent
from agentrl.envs.python_repair.packages import (
    DEFAULT_PACKAGES,
    PackageSpec,
    cache_root,
    get_spec,
    source_dir,
    tests_dir,
    unpacked,
)
from agentrl.sandbox.base import PROTECTED_DIR, Limits, Sandbox, backend_capabilities, open_sandbox
from agentrl.verifiers.hidden_tests import Report, install_tests, remove_tests, run_tests
from agentrl.verifiers.twin_audit import ReaderAudit, audit_task
from agentrl.verifiers.twin_sets import DEFAULT_ODDS, coverage, probe_sites

# Bump when a change here would make old trial logs wrong (operators, keep rule, prompt).
SYNTH_VERSION = 6
# A task is kept only when a blind guess among its twin sets wins at most 1 in this many.
TWIN_ODDS = DEFAULT_ODDS
SPLIT_FRACTIONS: tuple[tuple[Split, float], ...] = (("train", 0.8), ("validation", 0.1), ("test", 0.1))

REASONS = {
    "kept": "kept: some tests go pass -> fail, the rest still pass",
    "no_twin_cover": "some failing test cannot be decided among twins (agentrl.verifiers.twin_sets): no "
    "value to differ in where it fails, or too few to make a guess pay at most 1 in 32",
    "no_test_fails": "no test fails (the mutant survives the suite, or is equivalent at run time)",
    "too_many_fail": "other tests break: more than max_fail_fraction of the passing tests fail",
    "import_error": "the package no longer imports (collection errors)",
    "timeout": "the test suite timed out on the mutant (e.g. an infinite loop)",
    "equivalent": "the mutant's AST equals the original's",
    "syntax_error": "the mutant does not compile",
    "crash": "pytest produced no usable report",
}


def split_of(package: str, module: str, function: str) -> Split:
    """The split of every task mutating this function: a hash, so no function is in two splits."""
    digest = hashlib.sha256(f"{package}:{module}:{function}".encode()).digest()
    u = int.from_bytes(digest[:8], "little") / 2**64
    acc = 0.0
    for split, frac in SPLIT_FRACTIONS:
        acc += frac
        if u < acc:
            return split
    return SPLIT_FRACTIONS[-1][0]


@dataclass(frozen=True)
class Candidate:
    module: str
    site: Site

    @property
    def function_key(self) -> str:
        return f"{self.module}:{self.site.function}"


def candidates(spec: PackageSpec, seed: int) -> list[Candidate]:
    """Every applicable mutation of the package, in the seed's fixed trial order (see the module docstring)."""
    rng = random.Random(f"python-repair/{spec.name}/{seed}")
    by_function: dict[str, list[Candidate]] = defaultdict(list)
    root = source_dir(spec)
    for module in spec.targets:
        for site in enumerate_sites((root / module).read_text()):
            by_function[f"{module}:{site.function}"].append(Candidate(module, site))
    keys = sorted(by_function)
    rng.shuffle(keys)
    for key in keys:
        rng.shuffle(by_function[key])
        by_function[key] = _interleave_kinds(by_function[key])
    order: list[Candidate] = []
    depth = max((len(v) for v in by_function.values()), default=0)
    for r in range(depth):
        order.extend(by_function[k][r] for k in keys if r < len(by_function[k]))
    return order


def _interleave_kinds(sites: list[Candidate]) -> list[Candidate]:
    """Round-robin over mutation kinds (in shuffled order): statements outnumber every other
    kind of site, and without this most tasks of a function would be dropped statements."""
    buckets: dict[str, list[Candidate]] = {}
    for c in sites:
        buckets.setdefault(c.site.kind, []).append(c)
    out: list[Candidate] = []
    for r in range(max((len(b) for b in buckets.values()), default=0)):
        out.extend(b[r] for b in buckets.values() if r < len(b))
    return out


# --- running the suite in the sandbox -------------------------------------------------------


@dataclass(frozen=True)
class SuiteRun:
    report: Report | None
    seconds: float
    timed_out: bool
    exit_code: int
    output: str


class SuiteRunner:
    """One sandbox of a package's image with the pristine source in /workspace and the tests under /verifier."""

    RUN_DIR = f"{PROTECTED_DIR}/synth"

    def __init__(self, spec: PackageSpec, *, backend: str = "docker", limits: Limits | None = None):
        if backend_capabilities(backend).engine_images:
            ensure_image(spec)
        self.spec = spec
        self.sandbox: Sandbox = open_sandbox(
            backend,
            image=spec.image,
            limits=limits or Limits(cpus=1.0, memory_mb=1024, exec_timeout_s=300.0),
            labels={"agentrl.purpose": "python-repair-synth"},
        )
        try:
            stage_source(self.sandbox, spec.source_dir_in_image)
            # The same installation, runner and arguments as the hidden-tests verifier: the
            # node ids recorded here are the ones it will look up.
            self.tests = install_tests(self.sandbox, tests_dir(spec), self.RUN_DIR)
        except BaseException:
            self.sandbox.close()
            raise

    def run(self, timeout_s: float) -> SuiteRun:
        # Whole failure reports (the verifier keeps the last 1,000 characters): the bug report picks the
        # failing lines, the error and the frames out of them.
        run = run_tests(self.sandbox, self.tests, timeout_s=timeout_s, message_chars=_REPORT_CHARS)
        res = run.result
        return SuiteRun(run.report(), res.duration_s, res.timed_out, res.exit_code, run.output[-4000:])

    def probe(self, files: dict[str, bytes], ids: dict[str, str], timeout_s: float) -> set[str]:
        """Run twin-site probes (`agentrl.verifiers.twin_sets.probe_sites`) over the pristine source
        in the workspace; the site keys whose probe failed, as every twin must (a probe that passes
        marks a value the code's equality ignores). A run that does not finish cleanly: none."""
        if not ids:
            return set()
        with tempfile.TemporaryDirectory(prefix="agentrl-probes-") as tmp:
            root = Path(tmp, "tests")
            for rel, data in files.items():
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                (root / rel).write_bytes(data)
            installed = install_tests(self.sandbox, root)
            try:
                run = run_tests(self.sandbox, installed, ids=sorted(ids), timeout_s=timeout_s)
            finally:
                remove_tests(self.sandbox, [installed])
        report = run.report()
        if report is None or report.collection_errors:
            return set()
        passed = {ids[t] for t, case in report.tests.items() if t in ids and case.outcome == "passed"}
        reported = {ids[t] for t in report.tests if t in ids}
        return reported - passed

    def write(self, module: str, text: str) -> None:
        self.sandbox.write_file(module, text)

    def close(self) -> None:
        self.sandbox.close()

    def __enter__(self) -> SuiteRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- the trial log ----------------------------------------------------------------------------


@dataclass
class Baseline:
    passing: list[str]
    flaky: list[str]
    failing: list[str]
    seconds: float


@dataclass
class Trial:
    index: int
    package: str
    module: str
    function: str
    kind: str
    site: str
    description: str
    lineno: int
    outcome: str
    """A key of `REASONS`."""
    seconds: float = 0.0
    """Wall time of the suite on the mutant (0 when it was rejected before running)."""
    n_failing: int = 0
    task: dict[str, Any] | None = None


def synth_dir(cache_dir: Path | None = None) -> Path:
    return Path(cache_dir) if cache_dir is not None else cache_root() / "synth"


def log_path(spec: PackageSpec, seed: int, cache_dir: Path | None = None) -> Path:
    return synth_dir(cache_dir) / f"{spec.name}-{spec.version}-seed{seed}-v{SYNTH_VERSION}.jsonl"


def baseline_path(spec: PackageSpec, cache_dir: Path | None = None) -> Path:
    return synth_dir(cache_dir) / f"{spec.name}-{spec.version}-baseline-v{SYNTH_VERSION}.json"


def read_log(spec: PackageSpec, seed: int, cache_dir: Path | None = None) -> list[Trial]:
    path = log_path(spec, seed, cache_dir)
    if not path.is_file():
        return []
    trials = []
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                break  # a line cut short by an interrupted run: redone on resume
            trials.append(Trial(**json.loads(line)))
    return trials


def _outcomes(report: Report) -> dict[str, str]:
    return {nodeid: case.outcome for nodeid, case in report.tests.items()}


def baseline(runner: SuiteRunner, cache_dir: Path | None = None) -> Baseline:
    """Run the untouched suite twice; cached per package version."""
    path = baseline_path(runner.spec, cache_dir)
    if path.is_file():
        return Baseline(**json.loads(path.read_text()))
    runs = [runner.run(timeout_s=600.0) for _ in range(2)]
    for r in runs:
        if r.report is None or r.report.collection_errors:
            raise RuntimeError(
                f"{runner.spec.name}: the untouched test suite does not run cleanly in {runner.spec.image} "
                f"(exit {r.exit_code}, timed out: {r.timed_out}): {r.output[-1500:]}"
            )
    a, b = (_outcomes(r.report) for r in runs)  # type: ignore[arg-type]
    passing = sorted(t for t in a if a[t] == "passed" and b.get(t) == "passed")
    flaky = sorted(t for t in set(a) | set(b) if (a.get(t) == "passed") != (b.get(t) == "passed"))
    failing = sorted(t for t in a if a[t] in ("failed", "error") and t not in flaky)
    result = Baseline(passing, flaky, failing, max(r.seconds for r in runs))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(result)))
    return result


# --- the bug report -----------------------------------------------------------------------------


# Object reprs carry memory addresses (`<function f at 0x7f...>`): different on every run, and
# noise in a bug report. Dropping them keeps prompts deterministic from the seed.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def normalize_message(message: str) -> str:
    return _ADDRESS.sub("", message)


_REPORT_CHARS = 20_000

# In pytest's report of a failure: a frame's failing line (`>`), the error (`E`), and a frame's place
# (`path.py:line: ExcType`; `path.py:line: in function` for a middle frame, its call on the next line).
_FAILING = re.compile(r"^>\s")
_ERROR = re.compile(r"^E(\s|$)")
_PLACE = re.compile(r"^\S+\.py:\d+:")
_MIDDLE = re.compile(r"^\S+\.py:\d+: in \S+$")


def _entries(message: str) -> list[tuple[str, list[str]]]:
    """pytest's report of a failure as its traceback entries, each (place, its `>` and `E` lines).
    A long entry's lines come before its place; a short (middle) one's call comes after it."""
    lines = [ln.rstrip() for ln in normalize_message(message).splitlines()]
    entries: list[tuple[str, list[str]]] = []
    pending: list[str] = []
    i = 0
    while i < len(lines):
        ln = lines[i]
        if _MIDDLE.match(ln):
            call = lines[i + 1] if i + 1 < len(lines) else ""
            entries.append((ln, [">" + call[1:] if call.startswith(" ") else call] if call.strip() else []))
            pending, i = [], i + 2
            continue
        if _PLACE.match(ln):
            entries.append((ln, [x for x in pending if _FAILING.match(x) or _ERROR.match(x)]))
            pending = []
        else:
            pending.append(ln)
        i += 1
    return entries


def _in_tests(place: str, test_file: str) -> bool:
    path = place.split(":", 1)[0]
    return path.endswith("/" + test_file) or path == test_file or "/verifier/" in path


def failing_line(message: str, test_file: str) -> int | None:
    """The line of the test's own file where it failed (its first traceback entry there)."""
    for place, _ in _entries(message):
        path, _, rest = place.partition(":")
        if path.endswith("/" + test_file) or path == test_file:
            return int(rest.split(":", 1)[0])
    return None


def failing_error(message: str) -> str:
    """The exception a test failed with, as its report's last place names it ("" if none)."""
    entries = _entries(message)
    return entries[-1][0].rsplit(":", 1)[-1].strip() if entries else ""


_COMPARED = (
    re.compile(r"^E\s+(?:AssertionError: )?assert (.+) == (.+)$"),
    re.compile(r"^E\s+AssertionError: (.+) != (.+)$"),
)


def failing_values(message: str) -> list[str]:
    """The two sides a failing equality check compared, as pytest printed them (`assert 6 == 5`,
    unittest's `6 != 5`): the buggy output is one of them. Empty when the report says no such thing."""
    for line in normalize_message(message).splitlines():
        for pattern in _COMPARED:
            if m := pattern.match(line.rstrip()):
                return [m.group(1).strip(), m.group(2).strip()]
    return []


def failure_excerpt(message: str, test_file: str = "", max_lines: int = 14) -> str:
    """What a bug report may say of one failing test: the frames in the package (each one's
    failing line and place) and, when the error was raised there, the error. Nothing of the
    test's own frames, never its assertion and the values it expects: the hidden tests' twin
    sets differ in exactly those (`agentrl.verifiers.twin_sets`), and a prompt quoting them would
    say which member is real. Past `max_lines`, the middle frames go."""
    entries = _entries(message)
    if not entries:  # not pytest's report of a test (a collection error, a crash): its error only
        errors = [ln.rstrip() for ln in normalize_message(message).splitlines() if _ERROR.match(ln)]
        return "\n".join(_clip_line(ln, 200) for ln in errors[-3:])
    kept: list[str] = []
    for k, (place, lines) in enumerate(entries):
        if _in_tests(place, test_file):
            continue
        last = k == len(entries) - 1
        kept.extend(ln for ln in lines if last or not _ERROR.match(ln))
        kept.append(place)
    if len(kept) > max_lines:
        kept = ["...", *kept[-(max_lines - 1) :]]
    return "\n".join(_clip_line(ln, 200) for ln in kept)


def _error_kind(message: str, test_file: str) -> str:
    entries = _entries(message)
    if not entries:
        return "fails"
    place = entries[-1][0]
    exc = place.rsplit(":", 1)[-1].strip() or "an error"
    if _in_tests(place, test_file):
        return "its own check fails" if exc == "AssertionError" else f"{exc} in the test itself"
    return f"{exc} raised in the package"


def _clip_line(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 3].rstrip() + "..."


def bug_report(
    spec: PackageSpec,
    failures: list[tuple[str, str]],
    n_passing: int,
    max_shown: int = 5,
    cases: dict[str, int] | None = None,
) -> str:
    """The task prompt: what a user would file after running the package's test suite.

    The failing tests by name (a parametrized test once, with how many of its cases fail) and, for
    each, what went wrong: its own check failing, or an error raised in the package with the
    package's frames down to it. Never a line of a test, a case's parameters or a value a test
    expects (see `failure_excerpt`), and no file, line or function of the package beyond what
    the package's frames say. `cases`: per test, how many cases it has in all.
    """
    by_test: dict[str, list[str]] = {}
    for nodeid, message in failures:
        by_test.setdefault(nodeid.split("[", 1)[0], []).append(message)
    lines = [
        f"The `{spec.dist}` package ({spec.version}; {spec.kind}) is checked out in /workspace, and "
        f"its test suite has started failing: {len(failures)} test(s) fail while the other "
        f"{n_passing - len(failures)} still pass. The failures:",
        "",
    ]
    for test, messages in list(by_test.items())[:max_shown]:
        test_file = test.split("::", 1)[0]
        message = messages[0]
        of = (cases or {}).get(test)
        count = (
            f" ({len(messages)} of its {of} cases)"
            if of and of > 1
            else f" ({len(messages)} cases)"
            if len(messages) > 1
            else ""
        )
        lines.append(f"- {test}{count}: {_error_kind(message, test_file)}")
        if message.strip() and (excerpt := failure_excerpt(message, test_file)):
            lines.extend("    " + ln for ln in excerpt.splitlines())
    if len(by_test) > max_shown:
        lines.append(f"- ... and {len(by_test) - max_shown} more tests")
    lines += [
        "",
        "The test suite is not in the workspace; it is run against /workspace after you submit. "
        "Find the bug in the package's source and fix it without breaking anything else (do not "
        "just special-case the tests). You can run Python in /workspace to reproduce the failures. "
        "When you are done, call `submit` with a one-line summary of the fix.",
    ]
    return "\n".join(lines)


def _package_text(spec: PackageSpec) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(source_dir(spec).rglob("*.py")))


def _twin_cover(
    spec: PackageSpec,
    base: Baseline,
    f2p: list[str],
    p2p: list[str],
    prompt: str,
    lines: dict[str, int],
    errors: dict[str, str],
    values: dict[str, list[str]],
    runner: SuiteRunner | None,
) -> tuple[set[str], dict[str, str], int, ReaderAudit | None]:
    """Whether every failing test can be decided among twins (see agentrl.verifiers.twin_sets): a
    task where one cannot is kept out of the task set (a forger could pass it by forging it). The
    sites safe to use, the failing tests no set covers (-> why), the odds the sets reach, and, where
    they reach `TWIN_ODDS`, how readers of the run's files fare (`agentrl.verifiers.twin_audit`)."""
    # Only sites whose probe fails on the pristine package count: equality there is not blind.
    safe: set[str] = set()
    if runner is not None:
        # Not a value the prompt or the package's own source (its docstrings) quotes: the real one
        # would be the member that text mentions.
        readable = prompt + "\n" + _package_text(spec)
        files, probe_ids = probe_sites(
            tests_dir(spec), f2p, listed=[*f2p, *p2p], failing_lines=lines, avoid=readable
        )
        safe = runner.probe(files, probe_ids, timeout_s=max(30.0, 6 * base.seconds))
    planned: dict[str, Any] = dict(
        listed=[*f2p, *p2p],
        avoid=prompt,
        odds=TWIN_ODDS,
        failing_lines=lines,
        failing_errors=errors,
        failing_values=values,
        safe_sites=safe,
    )
    uncovered, odds = coverage(tests_dir(spec), f2p, **planned)
    # Sets that reach the odds may still give the real member away to one who reads the run's files.
    readers = audit_task(tests_dir(spec), f2p, **planned) if odds >= TWIN_ODDS else None
    return safe, uncovered, odds, readers


def _task(
    spec: PackageSpec,
    cand: Candidate,
    mutant: Any,
    base: Baseline,
    f2p: list[str],
    run: SuiteRun,
    seed: int,
    runner: SuiteRunner | None = None,
) -> Task:
    """The task of a kept mutant. `runner` (its workspace holding the pristine source again) runs
    the twin-site probes; without it no site counts as safe."""
    assert run.report is not None
    p2p = [t for t in base.passing if t not in set(f2p)]
    failures = [(t, run.report.tests[t].message if t in run.report.tests else "") for t in f2p]
    lines = {
        t: line for t, message in failures if (line := failing_line(message, t.split("::", 1)[0])) is not None
    }
    errors = {t: kind for t, message in failures if (kind := failing_error(message))}
    values = {t: got for t, message in failures if (got := failing_values(message))}
    cases = Counter(t.split("[", 1)[0] for t in base.passing)
    prompt = bug_report(spec, failures, len(base.passing), cases=dict(cases))
    safe, uncovered, odds, readers = _twin_cover(spec, base, f2p, p2p, prompt, lines, errors, values, runner)
    key = f"{spec.name}:{spec.version}:{cand.module}:{cand.site.key}"
    return Task(
        id=f"python-repair/{spec.name}/{hashlib.sha256(key.encode()).hexdigest()[:12]}",
        prompt=prompt,
        files={cand.module: mutant.source},
        image=spec.image,
        hidden_tests=str(tests_dir(spec)),
        split=split_of(spec.name, cand.module, cand.site.function),
        metadata={
            "package": spec.name,
            "version": spec.version,
            "module": cand.module,
            "function": cand.site.function,
            "kind": cand.site.kind,
            "description": mutant.description,
            "lineno": cand.site.lineno,
            "source_dir": spec.source_dir_in_image,
            "FAIL_TO_PASS": f2p,
            "PASS_TO_PASS": p2p,
            "FAIL_TO_PASS_LINES": lines,
            "FAIL_TO_PASS_ERRORS": errors,
            "FAIL_TO_PASS_VALUES": values,
            "TWIN_SITES": sorted(safe),
            "twin_sets": {
                # Usable: guessing every set wins 1 in TWIN_ODDS at most. A failing test no set covers
                # is listed; it does not help a forger, which must still guess every set.
                # ... and no reader of the run's files picks the real members more often than that.
                "covered": odds >= TWIN_ODDS and readers is not None and readers.fit,
                "every_failing_test": not uncovered,
                "odds": odds,
                "uncovered": uncovered,
                "readers": readers.as_dict() if readers is not None else None,
                "readers_reason": readers.reason() if readers is not None and not readers.fit else "",
            },
            "original_function": mutant.original_function,
            "mutated_function": mutant.mutated_function,
            "test_seconds": round(run.seconds, 3),
            "seed": seed,
        },
    )


# --- the synthesis loop -------------------------------------------------------------------------


@dataclass
class SynthConfig:
    seed: int = 0
    """Fixes the trial order (and so the tasks): same seed, same tasks."""
    max_fail_fraction: float = 0.25
    """Reject a mutant that fails more than this fraction of the passing tests."""
    max_per_function: int = 4
    """At most this many tasks mutate the same function."""
    max_trials_per_task: int = 12
    """Give up on a package after this many trials per wanted task (its candidates are poor)."""
    backend: str = "docker"
    """Sandbox backend the suites run in (docker or bwrap)."""
    cache_dir: Path | None = None
    """Where trial logs live; default `<cache>/synth` (see `packages.cache_root`)."""
    every_failing_test: bool = False
    """Keep only tasks whose every failing test is in a twin set (not only those whose sets make a
    guess pay 1 in 32 at most): far fewer tasks (a failing check with no value to differ in, one
    the package's docs quote, one the buggy code's output is not one edit from, is common)."""


def _log(msg: str) -> None:
    print(f"[python-repair] {msg}", file=sys.stderr, flush=True)


def synthesize_package(spec: PackageSpec, want: int, config: SynthConfig) -> list[Trial]:
    """Extend the package's trial log until it holds `want` kept tasks (or candidates run out)."""
    trials = read_log(spec, config.seed, config.cache_dir)
    kept = sum(t.outcome == "kept" for t in trials)
    if kept >= want:
        return trials
    # Sources and image come from the build step; on a fresh machine it runs here, once.
    if backend_capabilities(config.backend).engine_images:
        ensure_image(spec)
    else:
        unpacked(spec)
    order = candidates(spec, config.seed)
    per_function = Counter(f"{t.module}:{t.function}" for t in trials if t.outcome == "kept")
    budget = want * config.max_trials_per_task
    start = trials[-1].index + 1 if trials else 0
    if start >= len(order) or len(trials) >= budget:
        return trials
    originals = {m: (source_dir(spec) / m).read_text() for m in spec.targets}
    path = log_path(spec, config.seed, config.cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    _log(
        f"{spec.name}: {kept}/{want} tasks cached; synthesizing from trial {start} ({len(order)} candidates)"
    )
    with SuiteRunner(spec, backend=config.backend) as runner, open(path, "a") as log:
        base = baseline(runner, config.cache_dir)
        timeout = max(30.0, 6 * base.seconds)
        for index in range(start, len(order)):
            if kept >= want or len(trials) >= budget:
                break
            cand = order[index]
            if per_function[cand.function_key] >= config.max_per_function:
                continue
            try:
                mutant = apply_site(originals[cand.module], cand.site)
            except MutationError:
                continue  # not a trial: the operator cannot be spliced here faithfully
            trial = Trial(
                index=index,
                package=spec.name,
                module=cand.module,
                function=cand.site.function,
                kind=cand.site.kind,
                site=cand.site.key,
                description=mutant.description,
                lineno=cand.site.lineno,
                outcome="",
            )
            if is_equivalent(originals[cand.module], mutant.source):
                trial.outcome = "equivalent"
            else:
                try:
                    compile(mutant.source, cand.module, "exec")
                except SyntaxError:
                    trial.outcome = "syntax_error"
            if not trial.outcome:
                runner.write(cand.module, mutant.source)
                try:
                    run = runner.run(timeout_s=timeout)
                finally:
                    runner.write(cand.module, originals[cand.module])
                trial.seconds = round(run.seconds, 3)
                trial.outcome, f2p = _judge(run, base, config)
                trial.n_failing = len(f2p)
                if trial.outcome == "kept":
                    task = _task(spec, cand, mutant, base, f2p, run, config.seed, runner)
                    trial.task = task.model_dump(mode="json")
                    cover = task.metadata["twin_sets"]
                    if cover["covered"] and (cover["every_failing_test"] or not config.every_failing_test):
                        kept += 1
                        per_function[cand.function_key] += 1
                    else:
                        trial.outcome = "no_twin_cover"
            trials.append(trial)
            log.write(json.dumps(asdict(trial)) + "\n")
            log.flush()
            if len(trials) % 25 == 0:
                _log(f"{spec.name}: {len(trials)} trials, {kept} kept ({time.time() - t0:.0f}s)")
    _log(f"{spec.name}: {kept} tasks after {len(trials)} trials ({time.time() - t0:.0f}s this run)")
    return trials


def _judge(run: SuiteRun, base: Baseline, config: SynthConfig) -> tuple[str, list[str]]:
    if run.timed_out:
        return "timeout", []
    if run.report is None:
        return "crash", []
    if run.report.collection_errors:
        return "import_error", []
    tests = run.report.tests
    f2p = [t for t in base.passing if t not in tests or tests[t].outcome != "passed"]
    if not f2p:
        return "no_test_fails", []
    if len(f2p) > config.max_fail_fraction * len(base.passing):
        return "too_many_fail", f2p
    return "kept", f2p


@dataclass
class SynthResult:
    tasks: list[Task]
    trials: dict[str, list[Trial]] = field(default_factory=dict)
    seconds: float = 0.0


def synthesize(
    packages: list[str] | tuple[str, ...] = DEFAULT_PACKAGES, n: int = 300, config: SynthConfig | None = None
) -> SynthResult:
    """At least `n` tasks (when the candidates allow), spread evenly over `packages`; cached and resumable.

    A package that runs out of good candidates leaves its share to the others.
    """
    config = config or SynthConfig()
    specs = [get_spec(p) for p in packages]
    if not specs:
        raise ValueError("no packages given; choose from " + ", ".join(DEFAULT_PACKAGES))
    t0 = time.time()
    quota = {s.name: math.ceil(n / len(specs)) for s in specs}
    logs: dict[str, list[Trial]] = {}
    for _ in range(len(specs)):  # redistribution rounds
        exhausted = []
        for s in specs:
            logs[s.name] = synthesize_package(s, quota[s.name], config)
            if sum(t.outcome == "kept" for t in logs[s.name]) < quota[s.name]:
                exhausted.append(s.name)
        total = sum(min(quota[k], _kept(v)) for k, v in logs.items())
        open_ = [s.name for s in specs if s.name not in exhausted]
        if total >= n or not exhausted or not open_:
            break
        for name in exhausted:
            quota[name] = _kept(logs[name])
        extra = math.ceil((n - sum(quota[k] for k in exhausted) - sum(quota[k] for k in open_)) / len(open_))
        for name in open_:
            quota[name] += max(extra, 0)
    tasks = []
    for s in specs:
        got = [Task.model_validate(t.task) for t in logs[s.name] if t.outcome == "kept"]
        tasks.extend(got[: quota[s.name]])
    return SynthResult(tasks, logs, time.time() - t0)


def _kept(trials: list[Trial]) -> int:
    return sum(t.outcome == "kept" for t in trials)


def cached_tasks(
    packages: list[str] | tuple[str, ...] = DEFAULT_PACKAGES, seed: int = 0, cache_dir: Path | None = None
) -> list[Task]:
    """Every task already synthesized for these packages and seed (no sandbox started)."""
    out = []
    for name in packages:
        out.extend(
            Task.model_validate(t.task)
            for t in read_log(get_spec(name), seed, cache_dir)
            if t.outcome == "kept"
        )
    return out


def statistics(trials: list[Trial], tasks: list[Task] | None = None) -> dict[str, Any]:
    """Counts tried/kept/rejected (with reasons) per package and per mutation kind, and suite seconds."""
    by_package: dict[str, Counter] = defaultdict(Counter)
    by_kind: dict[str, Counter] = defaultdict(Counter)
    seconds = [t.seconds for t in trials if t.seconds > 0]
    for t in trials:
        by_package[t.package][t.outcome] += 1
        by_kind[t.kind][t.outcome] += 1

    def summary(c: Counter) -> dict[str, Any]:
        return {
            "tried": sum(c.values()),
            "kept": c["kept"],
            "rejected": sum(v for k, v in c.items() if k != "kept"),
            "reasons": {k: v for k, v in sorted(c.items()) if k != "kept"},
        }

    total = Counter()
    for c in by_package.values():
        total.update(c)
    seconds.sort()
    out: dict[str, Any] = {
        "total": summary(total),
        "per_package": {k: summary(v) for k, v in sorted(by_package.items())},
        "per_kind": {k: summary(v) for k, v in sorted(by_kind.items())},
        "suite_seconds": {
            "n": len(seconds),
            "mean": round(sum(seconds) / len(seconds), 3) if seconds else None,
            "p50": seconds[len(seconds) // 2] if seconds else None,
            "p99": seconds[min(len(seconds) - 1, int(0.99 * len(seconds)))] if seconds else None,
        },
    }
    # Why the tasks left out of the set were left out: per failing test that no twin set covers.
    why: Counter = Counter()
    for t in trials:
        if t.outcome == "no_twin_cover" and t.task:
            info = t.task["metadata"].get("twin_sets", {})
            if info.get("readers_reason") and (info.get("readers") or {}).get("short"):
                reasons = {f"the twin sets reach 1 in {TWIN_ODDS} in under half the draws"}
            elif info.get("readers_reason"):
                reasons = {"a reader of the run's files picks the real members more often than a guess"}
            else:
                reasons = set(info.get("uncovered", {}).values()) or {
                    f"the twin sets reach only 1 in {info.get('odds')} (too few values to draw from)"
                }
            why.update(reasons)
    out["no_twin_cover"] = {"tasks": total["no_twin_cover"], "why": dict(why.most_common())}
    # Kept tasks with failing tests no set covers (decided by the other sets' odds), and why.
    partly: Counter = Counter()
    n_partly = 0
    for t in trials:
        if (
            t.outcome == "kept"
            and t.task
            and (unc := t.task["metadata"].get("twin_sets", {}).get("uncovered"))
        ):
            n_partly += 1
            partly.update(set(unc.values()))
    out["kept_with_uncovered_failing_tests"] = {"tasks": n_partly, "why": dict(partly.most_common())}
    if tasks is not None:
        out["tasks"] = {
            "n": len(tasks),
            "per_package": dict(sorted(Counter(t.metadata["package"] for t in tasks).items())),
            "per_kind": dict(sorted(Counter(t.metadata["kind"] for t in tasks).items())),
            "per_split": dict(sorted(Counter(t.split for t in tasks).items())),
            "functions": len(
                {(t.metadata["package"], t.metadata["module"], t.metadata["function"]) for t in tasks}
            ),
        }
    return out
