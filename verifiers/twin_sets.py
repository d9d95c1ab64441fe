"""Twin sets: each FAIL_TO_PASS test decided in a test process of its own, among members only one of which is real.

The agent's code runs inside the process that runs the hidden tests, so it can read everything
there and forge any outcome. Canary twins (`agentrl.verifiers.canaries`) make forging every outcome
score 0; what is left to a forger that has read our source is to tell, in each group of copies,
the real test from the ones that must fail, and forge only those. This module leaves it nothing
to go on, and makes a guess cost more than it can win:

- **A process of their own.** The FAIL_TO_PASS tests run first, alone, from a folder built for
  that run: their files with every other test removed (and the module constants that only those
  used), the support files (conftest, helpers, data) unchanged. No other test, and so no other
  copy of the truth (a shared table of expected values, a passing test asserting the same
  thing), is in that process. The rest of the suite runs after it, in a second process, when the
  first one's outcomes are already on the host.
- **One set per failing case.** A FAIL_TO_PASS test `T` becomes a *twin set* of `m` members:
  copies of `T` under fresh names (none keeps `T`'s), in a random order, alike in everything but
  one value: an expected literal of an assertion every passing run reaches (a scalar, or an
  element of an expected container, `== D({"a": 17})` included), the expected element of the
  case's own parameters (a parametrized case becomes one function whose parameters are
  defaults, so each failing case is its own set), or the exception a `pytest.raises` (or an
  `assert raises(E, f)` helper) expects. A test a base class defines is one set however many of
  its subclasses' node ids fail: its members are defined where it is, each run under every one
  of those classes. One member has the original value; the others a value that contradicts it,
  so on honest code at most one member of a set passes (two passing is tampering, reward 0).
  The real member's outcome is the test's.
- **Values drawn so the real one is not special.** The `m` values are a clique with the real one
  at a uniformly random rank: integers and floats an arithmetic progression (step 1-3, kept on
  the original's side of zero), strings and bytes the same text with one position's character
  (two, when no output of the buggy code is known) swapped for another of its kind (a lowercase
  or capital vowel or consonant, a digit, punctuation: every member has as many of each kind as
  the real one), those that read as much like the hidden tests' own strings as the real one does,
  exceptions drawn from the exception classes the hidden tests use (never one that catches
  another). No literal echoed elsewhere in its test or file, none the task's prompt quotes, no
  bool (a negation that passes on the buggy code).
- **Guessing does not pay.** Sets are sized so that the product of their sizes is at least
  `odds` (default 32): a forger that knows every set exactly and guesses each member uniformly
  wins one task in `odds` at most. Larger sets go where they cost least (the fewest variants).

What this does not cover (the plan lists them in `uncovered`, with the reason; `tasks synth`
marks such tasks and leaves them out of training): a failing test with no such value (only a
truthiness check, only a bool, only values its own inputs repeat), one whose name is used
elsewhere in the hidden tests, one defined elsewhere than its id says (a base class in another
module, generated), a rewritten file that does not parse. A forger
that can compute the right answer (from a correct inverse function in the package, say) can
tell the members apart: it could fix the bug instead.

Use:

    plan = plan_twin_sets(hidden, fail_to_pass, listed=fail_to_pass + pass_to_pass, avoid=task.prompt)
    plan.write(staged_folder)             # the first run's tests; run exactly plan.ids there
    problems = plan.tampering(outcomes, collected)   # non-empty: reward 0
    f2p = plan.real_outcomes(outcomes)    # {FAIL_TO_PASS id: outcome of its real member}
"""

from __future__ import annotations

import ast
import hashlib
import math
import random
import re
import secrets
import tokenize
from collections import Counter
from collections.abc import Collection, Mapping
from pathlib import Path

from agentrl.verifiers.canaries import (
    _is_literal,
    _leaves,
    _Source,
    _span,
    _split,
)
from agentrl.verifiers.twin_folder import _body_line, _build
from agentrl.verifiers.twin_ids import _is_parametrize, _Parametrize, _parametrize, _Row, match_rows
from agentrl.verifiers.twin_plan import DEFAULT_ODDS, DecisionPlan, TwinSet
from agentrl.verifiers.twin_sites import (
    _body_sites,
    _constants,
    _exception_names,
    _expected_params,
    _File,
    _first_use,
    _is_test_module,
    _key,
    _leaf_site,
    _Naturalness,
    _Pending,
    _Prepared,
    _raises_capacity,
    _signature_ok,
    _Site,
    _Test,
    _where,
)
from agentrl.verifiers.twin_values import _calibrated, _near_misses, _own_pairs

# The plan's types, its id matching and its folder live in modules of their own (twin_plan,
# twin_ids, twin_sites, twin_values, twin_folder); their public names are importable from here.
__all__ = [
    "DEFAULT_ODDS",
    "DecisionPlan",
    "TwinSet",
    "coverage",
    "match_rows",
    "plan_twin_sets",
    "probe_sites",
    "site_key",
]

_PARSED: dict[tuple[str, int, int], _File | None] = {}
"""Parsed test files by (path, mtime, size): a task's hidden tests are the same for every episode,
and parsing a suite of thousands of lines costs more than the plan (the trees are never changed)."""


def _read(root: Path) -> tuple[list[_File], list[Path]]:
    files, others = [], []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if path.suffix != ".py":
            others.append(path)
            continue
        st = path.stat()
        key = (str(path), st.st_mtime_ns, st.st_size)
        if key not in _PARSED:
            if len(_PARSED) > 4096:
                _PARSED.clear()
            try:
                with tokenize.open(path) as fh:
                    text, encoding = fh.read(), fh.encoding
                _PARSED[key] = _File(rel, text, ast.parse(text), _Source(text), encoding)
            except (SyntaxError, UnicodeDecodeError, ValueError):
                _PARSED[key] = None
        parsed = _PARSED[key]
        if parsed is None:
            others.append(path)
        else:
            files.append(
                parsed
                if parsed.rel == rel
                else _File(rel, parsed.text, parsed.tree, parsed.src, parsed.encoding)
            )
    return files, others


def _module_constants(tree: ast.Module) -> dict[str, ast.expr]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            out[node.targets[0].id] = node.value
    return out


def _find(
    f: _File, parts: list[str]
) -> tuple[ast.Module | ast.ClassDef, ast.FunctionDef | ast.AsyncFunctionDef] | None:
    defs = (ast.FunctionDef, ast.AsyncFunctionDef)
    if len(parts) == 1:
        for n in f.tree.body:
            if isinstance(n, defs) and n.name == parts[0]:
                return f.tree, n
    elif len(parts) == 2:
        classes = {n.name: n for n in f.tree.body if isinstance(n, ast.ClassDef)}
        return _method(classes, parts[0], parts[1], set())
    return None


def _method(
    classes: dict[str, ast.ClassDef], cls: str, name: str, seen: set[str]
) -> tuple[ast.ClassDef, ast.FunctionDef | ast.AsyncFunctionDef] | None:
    """The class of this module that defines `cls.name`: `cls` itself, else its bases in order
    (a test a base class defines runs under each subclass's node id too). None when it is not
    found before a base defined elsewhere (an imported class), or the class is redefined."""
    node = classes.get(cls)
    if node is None or cls in seen:
        return None
    seen.add(cls)
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
            return node, item
        if any(isinstance(t, ast.Name) and t.id == name for t in _targets(item)):
            return None  # assigned in the class body (`test_x = other`): not a copy of a def
    for base in node.bases:
        if not isinstance(base, ast.Name) or base.id not in classes:
            return None
        if (found := _method(classes, base.id, name, seen)) is not None:
            return found
    return None


def _targets(stmt: ast.stmt) -> list[ast.expr]:
    if isinstance(stmt, ast.Assign):
        return stmt.targets
    if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        return [stmt.target]
    return []


def plan_twin_sets(
    hidden: Path,
    fail_to_pass: list[str],
    *,
    listed: list[str] | None = None,
    avoid: str = "",
    odds: int = DEFAULT_ODDS,
    failing_lines: Mapping[str, int] | None = None,
    failing_errors: Mapping[str, str] | None = None,
    failing_values: Mapping[str, list[str]] | None = None,
    safe_sites: Collection[str] | None = None,
    rng: random.Random | None = None,
) -> DecisionPlan:
    """Plan the FAIL_TO_PASS run over the hidden tests at `hidden` (a folder or a file); see the
    module docstring. `listed`: every node id the task lists (FAIL_TO_PASS and PASS_TO_PASS), to
    check that a parametrized test's cases are read as pytest names them. `avoid`: text the agent
    was shown (the prompt): no member differs in a value it quotes. `failing_lines`: per
    FAIL_TO_PASS id, the line of its test file where it fails on the buggy code: members then
    differ only in that statement (an earlier check passes on the buggy code, and the buggy code
    would say which member holds the right value there). Without it, any always-reached check.
    `failing_errors`: the exception each fails with on the buggy code: no member expects it (or a
    relative), which the buggy code would pass. `failing_values`: the values its failing check
    compared there (the buggy output among them): no member expects one. `safe_sites`: the site keys (`site_key`) that
    probing on the correct code found contradicting (`probe_sites`): only those are used."""
    rng = rng or random.Random(secrets.randbits(64))
    prepared = _prepare(hidden, fail_to_pass, listed, avoid, failing_lines, failing_errors)
    prepared.failing_values = failing_values or {}
    plan = prepared.plan
    plan.target_odds = odds
    live: list[_Pending] = []
    for p in prepared.pending:
        _near_misses(p, prepared.failing_values, prepared.failing_errors)
        # A value its own code holds elsewhere (an input, a message) would single the real member out,
        # to a reader and in the compiled code's constant table alike: never such a site.
        usable = [
            s
            for s in p.sites
            if s.capacity >= 2
            and s.echoes <= 1
            and prepared.run[_key(s.value) if s.kind != "raises" else ("name", s.value)] <= 1
            and (
                s.kind == "raises"
                or _inside(_text_of(s.value, s.text), prepared.run_strings, isinstance(s.value, str)) <= 0
            )
            and (safe_sites is None or site_key(p, s) in safe_sites)
        ]
        if not usable:
            for o in p.originals:
                plan.uncovered[o] = (
                    "no value its members could differ in where it fails on the buggy code (an expected "
                    "literal, parameter or exception, not a bool, not one the prompt quotes, one the "
                    "code's equality does not ignore)"
                )
            continue
        p.sites = usable
        live.append(p)
    _size(live, odds, rng)
    _build(plan, live, prepared, rng)
    return plan


def site_key(p: _Pending, site: _Site) -> str:
    """A site's name across runs: its test's node id prefix, and where the value sits in the file."""
    line, col = _span(site.node)[0]
    return f"{p.test.prefix}@{line}:{col}"


def probe_sites(
    hidden: Path,
    fail_to_pass: list[str],
    *,
    listed: list[str] | None = None,
    failing_lines: Mapping[str, int] | None = None,
    avoid: str = "",
    rng: random.Random | None = None,
) -> tuple[dict[str, bytes], dict[str, str]]:
    """A folder of probes (path -> content) and its node ids (-> site key): for every candidate
    site of every FAIL_TO_PASS test, one copy whose value there is drawn as a twin's would be.
    Run over the correct code, every probe must fail: one that passes marks a site whose value
    the code's equality ignores (a version compared with a string, build metadata and all), where
    members would not contradict each other. `tasks synth` runs them on the pristine package.
    `avoid`: text the agent can read (the prompt, the package's own source): a site whose value it
    quotes is not a candidate (a real value a docstring mentions would stand out)."""
    rng = rng or random.Random(0)
    prepared = _prepare(hidden, fail_to_pass, listed, avoid, failing_lines, None)
    probes: list[_Pending] = []
    keys: dict[int, str] = {}
    for p in prepared.pending:
        for site in p.sites:
            if site.capacity < 2:
                continue
            q = _Pending(p.test, p.originals, [site], p.row, p.params, site, 2, p.context)
            keys[id(q)] = site_key(p, site)
            probes.append(q)
    plan = DecisionPlan()
    _build(plan, probes, prepared, rng, probe=True)
    ids: dict[str, str] = {}
    for s, q in zip(plan.sets, plan.probed, strict=True):
        for nodeid in s.members[1 - s.real]:
            ids[nodeid] = keys[id(q)]
    return plan.files, ids


_STATS: dict[tuple, tuple[Counter, _Naturalness, Counter]] = {}


def _suite_stats(files: list[_File], others: list[Path]) -> tuple[Counter, _Naturalness, Counter]:
    """Per suite (cached by its files' content): how often each test name is referred to, how
    natural a string reads by the characters its strings use, the builtin exceptions it names."""
    # By content: an id of a parsed tree is reused once that tree is freed, and another suite's
    # statistics would then draw this one's twins.
    key = (
        hashlib.sha256("\0".join(f"{f.rel}\0{f.text}" for f in files).encode()).hexdigest(),
        tuple((str(p), p.stat().st_mtime_ns) for p in others),
    )
    if key in _STATS:
        return _STATS[key]
    texts = [f.text for f in files] + [
        p.read_text(errors="replace") for p in others if p.stat().st_size < 2**20
    ]
    # Every occurrence of a test's name but its definitions (another file's test of the same name
    # is not a reference to this one).
    counts: Counter = Counter(w for t in texts for w in re.findall(r"\b(test\w*|Test\w*)", t))
    for t in texts:
        counts.subtract(re.findall(r"\bdef\s+(test\w*)", t))
    for name in {fn for t in texts for fn in re.findall(r"\bdef\s+(test\w*)", t)}:
        counts[name] += 1  # its own definition
    strings = [
        n.value
        for f in files
        for n in ast.walk(f.tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]
    pairs: Counter = Counter()
    for text in strings:
        pairs.update(_own_pairs(text))  # characters, and the pairs they come in
    freq = _Naturalness(pairs, _calibrated(pairs, strings))
    exceptions = _exception_names(f.tree for f in files)
    if len(_STATS) > 256:
        _STATS.clear()
    _STATS[key] = (counts, freq, exceptions)
    return counts, freq, exceptions


def _prepare(
    hidden: Path,
    fail_to_pass: list[str],
    listed: list[str] | None,
    avoid: str,
    failing_lines: Mapping[str, int] | None,
    failing_errors: Mapping[str, str] | None,
) -> _Prepared:
    plan = DecisionPlan()
    root = hidden if hidden.is_dir() else hidden.parent
    files, others = _read(root) if hidden.is_dir() else (_read_one(hidden), [])
    counts, freq, exceptions = _suite_stats(files, others)
    listed_by_prefix: dict[str, list[str]] = {}
    for entry in listed or fail_to_pass:
        prefix, suffix = _split(entry)
        listed_by_prefix.setdefault(prefix, []).append(suffix)
    tests = _failing_tests(plan, files, fail_to_pass, counts)
    pending: list[_Pending] = []
    for t in tests.values():
        pending += _pending_sets(
            plan, t, listed_by_prefix.get(t.prefix, t.suffixes), avoid, failing_lines, exceptions
        )
    prepared = _Prepared(plan, pending, files, others, root, freq, exceptions, failing_errors or {})
    prepared.run, prepared.run_strings = _run_constants(tests, pending, files)
    return prepared


def _failing_tests(
    plan: DecisionPlan, files: list[_File], fail_to_pass: list[str], counts: Counter
) -> dict[str, _Test]:
    """The FAIL_TO_PASS functions, by node id prefix, each with its failing cases; the ids no copy
    could stand for go to `plan.uncovered`."""
    by_rel = {f.rel: f for f in files}
    tests: dict[str, _Test] = {}
    by_fn: dict[int, _Test] = {}
    for entry in dict.fromkeys(fail_to_pass):
        prefix, suffix = _split(entry)
        rel, *parts = prefix.split("::")
        f = by_rel.get(rel)
        found = _find(f, parts) if f is not None and parts else None
        if found is None:
            plan.uncovered[entry] = "not defined where its node id says (inherited, generated or nested)"
            continue
        owner, fn = found
        if counts.get(fn.name, 0) > 1:
            plan.uncovered[entry] = (
                "its name is used elsewhere in the hidden tests (a copy would behave differently)"
            )
            continue
        # One function that fails under several classes (a base's test, inherited) is one test:
        # its members are defined once, where it is, and each runs under every one of those classes.
        t = by_fn.get(id(fn)) or tests.setdefault(prefix, _Test(f, owner, fn, prefix, []))
        by_fn[id(fn)] = t
        if prefix == t.prefix:
            t.suffixes.append(suffix)
        t.ids.append(entry)
    return tests


def _pending_sets(
    plan: DecisionPlan,
    t: _Test,
    listed: list[str],
    avoid: str,
    failing_lines: Mapping[str, int] | None,
    exceptions: Counter,
) -> list[_Pending]:
    """The sets one failing test becomes: one per failing case when its cases can be split off
    (`listed`: the suffixes the task lists for it, to match pytest's ids), else one for them all."""
    f, fn = t.file, t.fn
    # Where an echo of a value would show: the member's own code (its compiled constants, and
    # what a reader of it sees next to the value).
    context = _constants([fn])
    body = _body_sites(fn, f.src, context, avoid, _where(fn, t.ids, failing_lines))
    _size_raises(body, exceptions)
    split = params = None
    if t.suffixes != [""] and len(t.ids) == len(t.suffixes):  # cases are split under one class only
        params = _parametrize(fn, _module_constants(f.tree))
        if params is not None and _signature_ok(fn, params.argnames) and _body_line(fn) is not None:
            split = match_rows(params, listed)
    if split is None or params is None:
        return [_Pending(t, list(t.ids), list(body), context=context)]
    out = []
    for suffix in t.suffixes:
        row = params.rows[split[suffix]]
        if row.marked:
            plan.uncovered[t.prefix + suffix] = "its case carries marks (skip, xfail): not split off"
            continue
        out.append(_case_set(t, suffix, row, params, avoid, failing_lines, exceptions))
    return out


def _case_set(
    t: _Test,
    suffix: str,
    row: _Row,
    params: _Parametrize,
    avoid: str,
    failing_lines: Mapping[str, int] | None,
    exceptions: Counter,
) -> _Pending:
    """One failing case of a parametrized test as a set of its own: its sites are its row's
    expected parameters (and, when it is the test's only failing case, the body's checks)."""
    f, fn = t.file, t.fn
    # The case's member holds this row and the body, not the other rows.
    decorators = [d for d in fn.decorator_list if d is not params.decorator]
    row_context = _constants([*row.elements, *fn.body, *decorators])
    where = _where(fn, [t.prefix + suffix], failing_lines)
    sites = []
    for name in _expected_params(fn, params.argnames):
        if where is not True and _first_use(fn, name) is not where:
            continue  # checked before the case fails: the buggy code would tell the members apart
        element = row.elements[params.argnames.index(name)]
        for leaf in _leaves(element):
            if (site := _leaf_site("row", leaf, f.src, row_context, avoid)) is not None:
                sites.append(site)
    if len(t.suffixes) == 1:
        # With more failing cases of this test in the run, every other case's members hold
        # the body's real values: only the case's own values may differ then.
        sites += _body_sites(fn, f.src, row_context, avoid, where)
    _size_raises(sites, exceptions)
    return _Pending(t, [t.prefix + suffix], sites, row, params, context=row_context)


def _size_raises(sites: list[_Site], exceptions: Counter) -> None:
    """An expected exception's site holds as many members as there are classes unrelated to it."""
    for site in sites:
        if site.kind == "raises":
            site.capacity = _raises_capacity(site, exceptions)


def _run_constants(
    tests: Mapping[str, _Test], pending: list[_Pending], files: list[_File]
) -> tuple[Counter, list[str]]:
    nodes: list[ast.AST] = []
    split = {id(p.test.fn) for p in pending if p.row is not None}
    for t in tests.values():
        if id(t.fn) in split:
            others = [d for d in t.fn.decorator_list if not _is_parametrize(d)]
            nodes += [*t.fn.body, *others]
        else:
            nodes.append(t.fn)
    for p in pending:
        if p.row is not None:
            nodes += p.row.elements
    with_tests = {t.file.rel for t in tests.values()}
    defs = (ast.FunctionDef, ast.AsyncFunctionDef)
    for f in files:
        if f.rel in with_tests:
            nodes += [
                n
                for n in f.tree.body
                if not (isinstance(n, defs) and n.name.startswith("test"))
                and not isinstance(n, ast.ClassDef)
                and not (isinstance(n, ast.Assign) and _is_literal(n.value))
            ]
            # A class keeps all but its tests in the run (a test class's attributes, a helper class).
            nodes += [
                item
                for n in f.tree.body
                if isinstance(n, ast.ClassDef)
                for item in n.body
                if not (isinstance(item, defs) and item.name.startswith("test"))
            ]
        elif not _is_test_module(f.rel):
            nodes.append(f.tree)  # conftest, helpers: in the run as they are
    strings = [
        n.value
        for tree in nodes
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]
    return _constants(nodes), strings


def _inside(text: str, strings: list[str], own: bool) -> int:
    """How many of the run's strings hold `text` (its own string, when it is one, not counted)."""
    return sum(text in x for x in strings) - (1 if own else 0)


def _text_of(value: object, text: str) -> str:
    """What a value reads as inside a string: a string's own characters, a number's spelling."""
    return value if isinstance(value, str) else text


def _read_one(path: Path) -> list[_File]:
    with tokenize.open(path) as fh:
        text, encoding = fh.read(), fh.encoding
    return [_File(path.name, text, ast.parse(text), _Source(text), encoding)]


def _size(sets: list[_Pending], odds: int, rng: random.Random) -> None:
    """Pick each set's site and size: the product of sizes reaches `odds` at the least cost
    (a member runs every variant of its set), never past a site's capacity."""
    if not sets:
        return
    need = max(2, math.ceil(odds ** (1 / len(sets))))
    for p in sets:
        # A free site (not linked to the others by the way the bug errs) that holds what this set
        # needs, else any; then at random.
        best = sorted(p.sites, key=lambda s: (s.linked, s.capacity < need, rng.random()))
        p.site = best[0]
        p.m = 2

    def reached() -> int:
        free = math.prod(p.m for p in sets if p.site is not None and not p.site.linked)
        return free * (2 if any(p.site is not None and p.site.linked for p in sets) else 1)

    while reached() < odds:
        growable = [p for p in sets if p.site is not None and not p.site.linked and p.m < p.site.capacity]
        if not growable:
            # Try a roomier site for the set that limits most.
            for p in sorted(sets, key=lambda q: q.m):
                roomier = [s for s in p.sites if s.capacity > p.m and not s.linked]
                if roomier:
                    p.site = max(roomier, key=lambda s: s.capacity)
                    break
            else:
                return
            continue
        best = max(growable, key=lambda p: math.log((p.m + 1) / p.m) / p.cost)
        best.m += 1


def coverage(
    hidden: Path,
    fail_to_pass: list[str],
    *,
    listed: list[str] | None = None,
    avoid: str = "",
    odds: int = DEFAULT_ODDS,
    failing_lines: Mapping[str, int] | None = None,
    failing_errors: Mapping[str, str] | None = None,
    failing_values: Mapping[str, list[str]] | None = None,
    safe_sites: Collection[str] | None = None,
) -> tuple[dict[str, str], int]:
    """Which FAIL_TO_PASS tests no twin set can cover (id -> why), and the odds the sets reach, as
    a verification would plan them (a fixed draw: coverage does not depend on it)."""
    plan = plan_twin_sets(
        hidden,
        fail_to_pass,
        listed=listed,
        avoid=avoid,
        odds=odds,
        failing_lines=failing_lines,
        failing_errors=failing_errors,
        failing_values=failing_values,
        safe_sites=safe_sites,
        rng=random.Random(0),
    )
    return dict(plan.uncovered), plan.odds
