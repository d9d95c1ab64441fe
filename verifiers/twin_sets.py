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
  one value: an expected literal of an assertion every passing run reaches, the expected element
  of the case's own parameters (a parametrized case becomes one function whose parameters are
  defaults, so each failing case is its own set), or the exception a `pytest.raises` expects.
  One member has the original value; the others a value that contradicts it, so on honest code
  at most one member of a set passes (two passing is tampering, reward 0). The real member's
  outcome is the test's.
- **Values drawn so the real one is not special.** The `m` values are a clique with the real one
  at a uniformly random rank: integers and floats an arithmetic progression (step 1-3, kept on
  the original's side of zero), strings and bytes the same text with one position's character
  drawn from the characters the hidden tests themselves use there (same class: lower, upper,
  digit), exceptions drawn from the exception classes the hidden tests use (never one that
  catches another). No literal echoed elsewhere in its test or file, none the task's prompt
  quotes, no bool (a negation that passes on the buggy code).
- **Guessing does not pay.** Sets are sized so that the product of their sizes is at least
  `odds` (default 32): a forger that knows every set exactly and guesses each member uniformly
  wins one task in `odds` at most. Larger sets go where they cost least (the fewest variants).

What this does not cover (the plan lists them in `uncovered`, with the reason; `tasks synth`
marks such tasks and leaves them out of training): a failing test with no such value (only a
truthiness check, only a bool), one whose name is used elsewhere in the hidden tests, one
defined elsewhere than its id says (inherited), a rewritten file that does not parse. A forger
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
import builtins
import math
import random
import re
import secrets
import tokenize
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.verifiers.canaries import (
    _UNITTEST_EQUAL,
    _WORD_SUFFIXES,
    _always_reached,
    _calls_approx,
    _is_literal,
    _leaves,
    _Source,
    _span,
    _split,
)

DEFAULT_ODDS = 32
_DIGITS, _LOWER, _UPPER = "0123456789", "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_MAX_MEMBERS = 64
# Builtin exceptions a twin may expect instead of the real one; drawn from those the hidden tests
# themselves use first (weighted by use), these only fill up.
_EXCEPTIONS = (
    "ValueError",
    "TypeError",
    "KeyError",
    "IndexError",
    "AttributeError",
    "ZeroDivisionError",
    "RuntimeError",
    "NotImplementedError",
    "OverflowError",
    "StopIteration",
    "UnicodeError",
    "RecursionError",
    "NameError",
    "FileNotFoundError",
    "PermissionError",
    "TimeoutError",
    "EOFError",
    "ImportError",
    "MemoryError",
)


# --- the plan --------------------------------------------------------------------------------


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


# --- pytest's ids for parametrized cases -----------------------------------------------------


def _ascii_escaped(value: str | bytes) -> str:
    text = (
        value.decode("ascii", "backslashreplace")
        if isinstance(value, bytes)
        else value.encode("unicode_escape").decode("ascii")
    )
    return "".join(c if 32 <= ord(c) < 127 else f"\\x{ord(c):02x}" for c in text)


def _idval(node: ast.expr, argname: str, idx: int) -> str | None:
    """pytest's id for one parameter value given as source (None: cannot be known statically)."""
    if _is_literal(node):
        value = ast.literal_eval(node)
        if isinstance(value, (str, bytes)):
            return _ascii_escaped(value)
        if value is None or isinstance(value, (bool, int, float, complex)):
            return str(value)
        return f"{argname}{idx}"  # containers: pytest names them by argument and index
    if isinstance(node, (ast.Call, ast.BinOp, ast.Lambda, ast.Compare, ast.BoolOp, ast.Subscript)):
        return None  # an object: its __name__ (a class, a function) or argname+index, unknowable here
    return None


def _dedup(ids: list[str], style: str) -> list[str]:
    counts = Counter(ids)
    if all(c == 1 for c in counts.values()):
        return ids
    out, suffixes = list(ids), Counter()
    for i, x in enumerate(ids):
        if counts[x] > 1:
            if style == "7":
                out[i] = f"{x}{suffixes[x]}"
            else:  # pytest 8: an underscore before the counter when the id ends in a digit
                sep = "_" if x and x[-1].isdigit() else ""
                new = f"{x}{sep}{suffixes[x]}"
                while new in counts:
                    suffixes[x] += 1
                    new = f"{x}{sep}{suffixes[x]}"
                out[i] = new
            suffixes[x] += 1
    return out


@dataclass
class _Row:
    elements: list[ast.expr]
    explicit_id: str | None
    marked: bool


@dataclass
class _Parametrize:
    decorator: ast.expr
    argnames: list[str]
    rows: list[_Row]
    ids_kw: list[str | None] | None


def _argnames(node: ast.expr) -> list[str] | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [a.strip() for a in node.value.split(",") if a.strip()]
    if isinstance(node, (ast.List, ast.Tuple)) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts
    ):
        return [e.value for e in node.elts]  # type: ignore[attr-defined]
    return None


def _is_parametrize(dec: ast.expr) -> bool:
    return isinstance(dec, ast.Call) and getattr(dec.func, "attr", None) == "parametrize"


def _parametrize(
    fn: ast.FunctionDef | ast.AsyncFunctionDef, constants: dict[str, ast.expr]
) -> _Parametrize | None:
    """The test's one `parametrize` decorator, its rows as source nodes (a module constant it
    names is looked through), or None when there is not exactly one we can read."""
    decs = [d for d in fn.decorator_list if _is_parametrize(d)]
    if len(decs) != 1:
        return None
    dec = decs[0]
    assert isinstance(dec, ast.Call)
    kw = {k.arg: k.value for k in dec.keywords}
    if "indirect" in kw or len(dec.args) < 2 or (len(dec.args) > 2):
        return None
    names = _argnames(dec.args[0])
    values = dec.args[1]
    if isinstance(values, ast.Name):
        values = constants.get(values.id)  # type: ignore[assignment]
    if names is None or not isinstance(values, (ast.List, ast.Tuple)):
        return None
    ids_kw: list[str | None] | None = None
    if "ids" in kw:
        ids = kw["ids"]
        if not isinstance(ids, (ast.List, ast.Tuple)) or not all(
            isinstance(e, ast.Constant) and (e.value is None or isinstance(e.value, str)) for e in ids.elts
        ):
            return None
        ids_kw = [e.value for e in ids.elts]  # type: ignore[attr-defined]
    rows: list[_Row] = []
    for item in values.elts:
        explicit, marked = None, False
        if (
            isinstance(item, ast.Call)
            and getattr(item.func, "attr", getattr(item.func, "id", None)) == "param"
        ):
            for k in item.keywords:
                if k.arg == "id" and isinstance(k.value, ast.Constant) and isinstance(k.value.value, str):
                    explicit = k.value.value
                elif k.arg == "marks":
                    marked = True
            elements = list(item.args)
            if len(names) == 1 and len(elements) != 1:
                return None
        elif len(names) == 1:
            elements = [item]
        elif isinstance(item, (ast.Tuple, ast.List)):
            elements = list(item.elts)
        else:
            return None
        if len(elements) != len(names) or any(isinstance(e, ast.Starred) for e in elements):
            return None
        rows.append(_Row(elements, explicit, marked))
    if ids_kw is not None and len(ids_kw) != len(rows):
        return None
    return _Parametrize(dec, names, rows, ids_kw)


def _row_ids(p: _Parametrize, style: str) -> list[str | None]:
    raw: list[str | None] = []
    for idx, row in enumerate(p.rows):
        given = row.explicit_id if row.explicit_id is not None else (p.ids_kw[idx] if p.ids_kw else None)
        if given is not None:
            raw.append(given)
            continue
        parts = [_idval(e, n, idx) for e, n in zip(row.elements, p.argnames, strict=True)]
        raw.append(None if any(x is None for x in parts) else "-".join(parts))  # type: ignore[arg-type]
    if any(x is None for x in raw):
        return raw  # duplicates cannot be resolved without every id; validation decides
    return list(_dedup(raw, style))  # type: ignore[arg-type]


def match_rows(p: _Parametrize, suffixes: Iterable[str]) -> dict[str, int] | None:
    """Each listed case (`[id]`) -> its row, when pytest's ids (7.x or 8.x rules) name every listed
    case exactly once; None otherwise (the cases cannot be split safely)."""
    wanted = [s[1:-1] for s in suffixes if s.startswith("[") and s.endswith("]")]
    for style in ("7", "8"):
        ids = _row_ids(p, style)
        index: dict[str, int] = {}
        dup = False
        for i, x in enumerate(ids):
            if x is None:
                continue
            if x in index:
                dup = True
            index[x] = i
        if not dup and all(w in index for w in wanted):
            return {f"[{w}]": index[w] for w in wanted}
    return None


# --- where a set's members may differ ---------------------------------------------------------


@dataclass
class _Site:
    kind: str  # literal | row | raises
    node: ast.AST  # the leaf (a Constant, a UnaryOp over one) or the exception's Name
    text: str
    value: object
    capacity: int
    echoes: int
    """How often the value occurs in the member's own code (1: only here)."""
    near: object = None
    """The buggy code's output where this value is checked, when the task says (`failing_values`)."""
    position: int | None = None
    """For a string with a known buggy output: the one position the members differ at."""
    pool: str = ""
    """With `position`: the characters a member may have there (each keeps it as near)."""
    linked: bool = False
    """Reflected about the buggy output (see `TwinSet.linked`)."""
    grid: bool = False
    """A string with no known output of the buggy code to be near to: members may differ at two
    positions, so that more than one class of characters' worth of them fit."""
    quoted: frozenset[int] = frozenset()
    """Positions in a string's body inside a word the prompt quotes (`FixedTzOffset` in a frame the
    bug report shows): a member edited there would quote the prompt less than the real one does."""


def _exception_names(trees: Iterable[ast.Module]) -> Counter:
    """Builtin exception names the hidden tests use (raises, except clauses), by use."""
    out: Counter = Counter()
    for tree in trees:
        for n in ast.walk(tree):
            if isinstance(n, ast.Name) and _is_builtin_exception(n.id):
                out[n.id] += 1
    return out


def _unrelated(pool: list[str], name: str) -> list[str]:
    base = getattr(builtins, name)
    return [
        p
        for p in pool
        if p != name
        and not issubclass(getattr(builtins, p), base)
        and not issubclass(base, getattr(builtins, p))
    ]


def _raises_name(item: ast.expr) -> ast.Name | None:
    """`pytest.raises(Name, ...)` / `raises(Name)` / `self.assertRaises(Name, ...)`: the Name when it
    is a builtin exception class."""
    if not isinstance(item, ast.Call) or not item.args:
        return None
    func = getattr(item.func, "attr", getattr(item.func, "id", None))
    if func not in ("raises", "assertRaises", "assertRaisesRegex"):
        return None
    first = item.args[0]
    if isinstance(first, ast.Name) and _is_builtin_exception(first.id):
        return first
    return None


def _is_builtin_exception(name: str) -> bool:
    """A builtin exception class a twin may expect: not a warning, and not AssertionError (pytest's
    assertion rewriting names it in every test, so a member expecting it would compile differently)."""
    cls = getattr(builtins, name, None)
    return (
        isinstance(cls, type)
        and issubclass(cls, Exception)
        and not issubclass(cls, Warning)
        and name != "AssertionError"
    )


def _int_capacity(value: int) -> int:
    # The members stay on the original's side of zero with the real one at a uniform rank: a
    # progression of step 1 from 0 holds |value| + 1 values; a larger step holds fewer.
    return min(_MAX_MEMBERS, abs(value) + 1)


def _key(value: object) -> tuple[str, object]:
    return type(value).__name__, value


def _constants(nodes: Iterable[ast.AST]) -> Counter:
    """(type, value) of every constant in these trees, counted; names count as ("name", id). An
    identifier counts as a string too: pytest's assertion rewriting turns the names an assertion
    reads into string constants, and a string literal equal to one is one constant, not two."""
    out: Counter = Counter()
    for tree in nodes:
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant):
                out[_key(n.value)] += 1
            elif isinstance(n, ast.Name):
                out[("name", n.id)] += 1
                out[("str", n.id)] += 1
            elif isinstance(n, ast.Attribute):
                out[("str", n.attr)] += 1
            elif isinstance(n, ast.arg):
                out[("str", n.arg)] += 1
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out[("str", n.name)] += 1
    return out


def _leaf_site(kind: str, leaf: ast.AST, src: _Source, context: Counter, avoid: str) -> _Site | None:
    start, end = _span(leaf)
    text = src.segment(start, end)
    value = leaf.value if isinstance(leaf, ast.Constant) else None  # type: ignore[attr-defined]
    if isinstance(value, bool) or value is None:
        return None  # a bool twin is a negation: it passes on the buggy code
    if avoid and _quoted(text, value, avoid):
        return None
    if isinstance(value, int):
        if any(c not in _DIGITS for c in text):
            return None
        cap = _int_capacity(value)
    elif isinstance(value, float):
        m = re.fullmatch(r"([0-9]+)\.([0-9]*)", text) or re.fullmatch(r"([0-9]*)\.([0-9]+)", text)
        if m is None or not math.isfinite(value):
            return None
        cap = _int_capacity(int(m.group(1) or "0"))
    elif isinstance(value, (str, bytes)):
        body = _string_body(text)
        if body is None:
            return None
        quoted = _quoted_positions(body[1], avoid)
        classes = [_char_class(c) if i not in quoted else "" for i, c in enumerate(body[1])]
        if not any(classes):
            return None
        cap = max(len(pool) for pool in classes if pool)
    else:
        return None
    if cap < 2:
        return None
    site = _Site(kind, leaf, text, value, cap, context[_key(value)])
    if isinstance(value, (str, bytes)):
        site.quoted = quoted
    return site


def _quoted_positions(body: str, avoid: str) -> frozenset[int]:
    """The positions of `body` inside a word (a run of letters, digits and underscores, three or more
    long) that `avoid` holds as a word of its own."""
    if not avoid:
        return frozenset()
    out: set[int] = set()
    for m in re.finditer(r"\w{3,}", body):
        if re.search(rf"(?<!\w){re.escape(m.group())}(?!\w)", avoid):
            out.update(range(m.start(), m.end()))
    return frozenset(out)


def _quoted(text: str, value: object, avoid: str) -> bool:
    """Whether the prompt quotes this literal: a string's value when long enough to mean anything;
    a number's spelling as a token of its own on a line of code or an error the prompt shows (a
    count in its prose, a `2` inside a version number `1.2.0`, is not a quote)."""
    if not avoid:
        return False
    if isinstance(value, str):
        return (len(value) >= 3 and value in avoid) or text in avoid
    token = re.compile(rf"(?<![\w.]){re.escape(text)}(?![\w.])")
    return any(
        token.search(line)
        for line in avoid.splitlines()
        if line.lstrip().startswith((">", "E ")) or ".py:" in line or "==" in line
    )


def _string_body(text: str) -> tuple[str, str, str] | None:
    m = re.fullmatch(r"([rRbBuU]{0,2})('''|\"\"\"|'|\")(.*)\2", text, re.S)
    if m is None or "\\" in m.group(3):
        return None
    return m.group(1) + m.group(2), m.group(3), m.group(2)


# Punctuation a string's character may be swapped for (no quote, backslash or space: its spelling).
_PUNCT = "-_.:/+~@#%&*=|!?,;"


def _char_class(c: str) -> str:
    if c in _LOWER:
        return _LOWER
    if c in _UPPER:
        return _UPPER
    if c in _DIGITS:
        return _DIGITS
    return _PUNCT if c in _PUNCT else ""


# A builtin constructor over a literal (`list('BD')`, `set([1, 2])`): as good as a literal.
_CONSTRUCTORS = frozenset({"list", "tuple", "set", "frozenset", "sorted", "dict", "str", "bytes"})


def _literal_side(side: ast.expr) -> ast.expr | None:
    if _is_literal(side):
        return side
    if (
        isinstance(side, ast.Call)
        and isinstance(side.func, ast.Name)
        and side.func.id in _CONSTRUCTORS
        and len(side.args) == 1
        and not side.keywords
        and _is_literal(side.args[0])
    ):
        return side.args[0]
    return None


def _eq_literal_sides(stmt: ast.stmt) -> list[ast.expr]:
    """The literal sides of an always-reached equality check (assert ==, assertEqual)."""
    sides: list[ast.expr] = []
    if isinstance(stmt, ast.Assert):
        test = stmt.test
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
            if _calls_approx(test):
                return []
            sides = [test.left, test.comparators[0]]
    elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        call = stmt.value
        if getattr(call.func, "attr", None) in _UNITTEST_EQUAL and len(call.args) >= 2:
            sides = list(call.args[:2])
    return [lit for side in sides if (lit := _literal_side(side)) is not None]


def _eq_name_sides(stmt: ast.stmt) -> list[str]:
    """Names compared whole in an always-reached equality check (`assert f(x) == expected`)."""
    out = []
    if isinstance(stmt, ast.Assert):
        test = stmt.test
        if (
            isinstance(test, ast.Compare)
            and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Eq)
            and not _calls_approx(test)
        ):
            out = [s.id for s in (test.left, test.comparators[0]) if isinstance(s, ast.Name)]
    elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        call = stmt.value
        if getattr(call.func, "attr", None) in _UNITTEST_EQUAL and len(call.args) >= 2:
            out = [a.id for a in call.args[:2] if isinstance(a, ast.Name)]
    return out


def _body_sites(
    fn: ast.FunctionDef | ast.AsyncFunctionDef,
    src: _Source,
    context: Counter,
    avoid: str,
    only: ast.stmt | bool | None = True,
) -> list[_Site]:
    """Sites in the body's always-reached statements; `only`: just this statement (False: none)."""
    sites = []
    for stmt in _always_reached(fn.body):
        if only is False or (isinstance(only, ast.stmt) and stmt is not only):
            continue
        for side in _eq_literal_sides(stmt):
            for leaf in _leaves(side):
                if (site := _leaf_site("literal", leaf, src, context, avoid)) is not None:
                    sites.append(site)
        items = []
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            items = [i.context_expr for i in stmt.items]
        elif isinstance(stmt, ast.Expr):
            items = [stmt.value]
        for item in items:
            if (name := _raises_name(item)) is not None:
                start, end = _span(name)
                sites.append(
                    _Site("raises", name, src.segment(start, end), name.id, 0, context[("name", name.id)])
                )
    return sites


# --- drawing the members' values ------------------------------------------------------------


def _progression(value: int, m: int, rng: random.Random) -> list[int]:
    """m integers on value's side of zero, value among them at a uniformly random rank."""
    room = abs(value)  # how many steps fit between value and zero
    steps = [s for s in (1, 2, 3) if room // s + 1 >= m] or [1]
    step = rng.choice(steps)
    rank = rng.randrange(m)
    sign = -1 if value < 0 else 1
    return [value + sign * step * (j - rank) for j in range(m)]


def _int_texts(site: _Site, m: int, rng: random.Random) -> list[str]:
    return [str(v) for v in _progression(int(site.value), m, rng)]  # type: ignore[call-overload]


def _float_texts(site: _Site, m: int, rng: random.Random) -> list[str]:
    whole, _, frac = site.text.partition(".")
    values = _progression(int(whole or "0"), m, rng)
    out = [f"{w}.{frac}" if whole or w else f".{frac}" for w in values]
    out[values.index(int(whole or "0"))] = site.text
    return out


def _fit(freq: Counter, s: str, i: int) -> float:
    """How natural character i of s is next to its neighbours, by the pairs of characters the hidden
    tests' own strings are made of: members are drawn by it, so that a twin's character is as
    likely as the real one to read like the test's text."""
    left = freq.get(s[i - 1 : i + 1], 0) if i > 0 else freq.get(s[i], 0)
    right = freq.get(s[i : i + 2], 0) if i + 1 < len(s) else freq.get(s[i], 0)
    return (left + 1) * (right + 1)


def _edited(b: str, x: str) -> int:
    """The position of the character an edit of b put into x."""
    for i, c in enumerate(x):
        if i >= len(b) or b[i] != c:
            return i
    return len(x) - 1


def _window(
    real: str, others: list[str], weight: Callable[[str], float], m: int, rng: random.Random
) -> list[str] | None:
    """The real candidate and m - 1 others next to it in rank by `weight` (how natural each reads),
    the real one at a uniformly random place in that window where the ranks allow: a rule that
    picks the most (or least) natural member then picks the real one no more often than chance,
    which drawing the others by weight alone does not give (the common ones fill the set, and the
    real one is then the odd, rarer one). Ties are broken at random. None: too few candidates."""
    if len(others) < m - 1:
        return None
    keyed = [(weight(x), rng.random(), x) for x in [real, *others]]
    ranked = [x for _, _, x in sorted(keyed, reverse=True)]
    k = ranked.index(real)
    lo, hi = max(0, k - m + 1), min(k, len(ranked) - m)
    start = rng.randint(lo, hi)
    window = ranked[start : start + m]
    return [real, *[x for x in window if x != real]]


def _string_texts(site: _Site, m: int, rng: random.Random, freq: Counter) -> list[str] | None:
    body = _string_body(site.text)
    assert body is not None
    head, text, quote = body
    if isinstance(site.near, str) and _neighbour_edit(text, site.near) is not None:
        # One edit from the buggy output, each, like the real value.
        near = site.near
        picked = _window(text, _neighbours(near, text), lambda x: _fit(freq, x, _edited(near, x)), m, rng)
    elif site.grid:
        spots = [i for i, c in enumerate(text) if _char_class(c) and i not in site.quoted]
        if len(spots) < 2:
            return None
        i, j = sorted(rng.sample(spots, 2))
        made = [
            text[:i] + x + text[i + 1 : j] + y + text[j + 1 :]
            for x in _char_class(text[i])
            for y in _char_class(text[j])
            if (x, y) != (text[i], text[j])
        ]
        picked = _window(text, made, lambda x: _fit(freq, x, i) * _fit(freq, x, j), m, rng)
    else:
        if site.position is not None:
            positions = [site.position]
        else:
            positions = [
                i
                for i, c in enumerate(text)
                if (pool := _char_class(c)) and len(pool) >= m and i not in site.quoted
            ]
        if not positions:
            return None
        i = rng.choice(positions)
        real = text[i]
        near = site.near
        # Never the buggy output's own character there: that member would be the buggy output itself.
        taken = {real} | ({near[i]} if isinstance(near, str) and len(near) == len(text) else set())
        made = [text[:i] + c + text[i + 1 :] for c in (site.pool or _char_class(real)) if c not in taken]
        picked = _window(text, made, lambda x: _fit(freq, x, i), m, rng)
    return None if picked is None else [f"{head}{x}{quote}" for x in picked]


def _values(
    site: _Site,
    m: int,
    rng: random.Random,
    freq: Counter,
    exceptions: Counter,
    context: Counter,
    raised: Collection[str] = (),
) -> list[str] | None:
    """m texts for the site, the real one first (the caller shuffles the members). A draw in which
    a member's value occurs elsewhere in its code is drawn again (an echo would single it out, and
    so would the compiled code's constant table, where equal constants are one); None when 50
    draws all echo."""
    for _ in range(50):
        texts = _draw(site, m, rng, freq, exceptions, raised)
        if texts is None:
            return None
        if not any(context[_text_key(site, t)] > 0 or _held(site, t, context) for t in texts[1:]):
            return texts
    return None


def _held(site: _Site, text: str, context: Counter) -> bool:
    """Whether one of the run's strings (`("inside", s)` keys) holds this member's text."""
    if site.kind == "raises":
        return False
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return False
    shown = value if isinstance(value, str) else text
    return bool(shown) and any(k[0] == "inside" and shown in k[1] for k in context)


def _text_key(site: _Site, text: str) -> tuple[str, object]:
    if site.kind == "raises":
        return ("name", text)
    try:
        return _key(ast.literal_eval(text))
    except (ValueError, SyntaxError):
        return ("?", text)


def _draw(
    site: _Site, m: int, rng: random.Random, freq: Counter, exceptions: Counter, raised: Collection[str] = ()
) -> list[str] | None:
    if site.kind == "raises":
        pool = _unrelated([e for e in dict.fromkeys([*exceptions, *_EXCEPTIONS])], site.text)
        for name in raised:  # what the buggy code raises: a member expecting it would pass there
            if _is_builtin_exception(name):
                pool = _unrelated(pool, name)
        chosen: list[str] = []
        while pool and len(chosen) < m - 1:
            weights = [exceptions.get(p, 0) + 1 for p in pool]
            c = rng.choices(pool, weights)[0]
            chosen.append(c)
            pool = _unrelated([p for p in pool if p != c], c)  # no two members catch the same
        return [site.text, *chosen] if len(chosen) == m - 1 else None
    value = site.value
    if isinstance(value, int) and isinstance(site.near, int) and site.linked:
        texts = [site.text, str(2 * site.near - value)]
    elif isinstance(value, int):
        texts = _int_texts(site, m, rng)
    elif isinstance(value, float):
        texts = _float_texts(site, m, rng)
    else:
        texts = _string_texts(site, m, rng, freq)
        if texts is None:
            return None
    real = texts.index(site.text) if site.text in texts else 0
    return [texts[real], *texts[:real], *texts[real + 1 :]]


def _near_misses(
    p: _Pending, failing_values: Mapping[str, list[str]], failing_errors: Mapping[str, str] | None = None
) -> None:
    """Where the task says what the buggy code produced at a site, draw members as near to it as the
    real one is, so that "the member nearest to the buggy output" picks among them all: an integer
    is reflected about it (two members, linked); a string one edit from it (a mutant's usual miss)
    has twins made by that same edit with another character (`_neighbours`); a string further away
    differs from its twins at one position where every other character keeps them as far. A string
    no such position fits, or a value that is only part of what was compared, is not used."""
    nears = []
    for o in p.originals:
        for text in failing_values.get(o, []):
            try:
                nears.append(ast.literal_eval(text))
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue
    for site in p.sites:
        if site.kind == "raises":
            continue
        v = site.value
        others = [b for b in nears if type(b) is type(v) and b != v]
        if nears and not any(b == v and type(b) is type(v) for b in nears):
            # The buggy output is known, but as a whole this value is part of (a container): no
            # way to draw members all as near to it, so none at all.
            site.capacity = 0
            continue
        if len(others) != 1 or not any(b == v and type(b) is type(v) for b in nears):
            if isinstance(v, str) and not others and (body := _string_body(site.text)) is not None:
                # No output of the buggy code to be near to (the package raised before the check, or
                # the task does not say): room for more members, at two positions.
                classes = sorted((len(_char_class(c)) for c in body[1] if _char_class(c)), reverse=True)
                if len(classes) >= 2:
                    site.grid = True
                    site.capacity = min(_MAX_MEMBERS, classes[0] * classes[1])
            continue  # not this value's check, or not one output to be near to
        b = others[0]
        site.near = b
        if isinstance(v, int) and not isinstance(v, bool):
            # Reflected about it: both members as near to it. Any other twin would be further, and a
            # mutant's output is near the right one (off by one: "the nearest" would win 9 sets in
            # 10). Which of the two is real then follows the way the bug errs, the same in every
            # such set of the task: they are linked, one guess of two for them all (`_size`).
            twin = 2 * b - v
            site.capacity = 2 if (twin >= 0) == (v >= 0) and twin != v else 0
            site.linked = True
        elif isinstance(v, str) and (body := _string_body(site.text)) is not None and body[1] == v:
            assert isinstance(b, str)
            if _neighbour_edit(v, b) is not None:
                site.capacity = min(_MAX_MEMBERS, len(_neighbours(b, v)) + 1)
            else:
                # Further than one edit: one position whose every other character leaves a member
                # exactly as far from the buggy output as the real value.
                far = _levenshtein(v, b)
                best = ""
                for i, c in enumerate(v):
                    pool = "".join(
                        x for x in _char_class(c) if x != c and _levenshtein(v[:i] + x + v[i + 1 :], b) == far
                    )
                    if len(pool) > len(best):
                        site.position, best = i, pool
                site.pool = best
                site.capacity = len(best) + 1 if best else 0
        else:
            site.capacity = 0  # a float, bytes: no member drawn near enough, so none at all


def _levenshtein(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def _neighbour_edit(v: str, b: str) -> tuple[str, int] | None:
    """How v is one edit from b: ("sub", position) or ("ins", position of v's extra character)."""
    if len(v) == len(b):
        diffs = [i for i, (x, y) in enumerate(zip(v, b, strict=True)) if x != y]
        return ("sub", diffs[0]) if len(diffs) == 1 and _char_class(v[diffs[0]]) else None
    if len(v) == len(b) + 1:
        for i in range(len(v)):
            if v[:i] + v[i + 1 :] == b and _char_class(v[i]):
                return ("ins", i)
    return None


def _neighbours(b: str, v: str) -> list[str]:
    """The strings one edit from b made as v is (the same substitution or insertion, at the same
    place) with another character of that class: v's twins. At the same place, so that where a
    string was edited (its end, say: "the one ending in punctuation is real") says nothing; one edit
    from b, so that "the one nearest the buggy output" says nothing either."""
    edit = _neighbour_edit(v, b)
    assert edit is not None
    kind, at = edit
    pool = _char_class(v[at])
    if kind == "sub":
        out = [b[:at] + x + b[at + 1 :] for x in pool if x != b[at]]
    else:
        out = [b[:at] + x + b[at:] for x in pool]
    # An insertion next to the same character reads the same whichever side it went on: no twin
    # may equal another, or the real value.
    return [x for x in dict.fromkeys(out) if x != v and x != b]


def _raises_capacity(site: _Site, exceptions: Counter) -> int:
    pool = _unrelated([e for e in dict.fromkeys([*exceptions, *_EXCEPTIONS])], site.text)
    n = 1
    while pool:  # greedy: how many mutually unrelated classes there are
        n += 1
        pool = _unrelated(pool[1:], pool[0])
    return n


# --- the planner ------------------------------------------------------------------------------


@dataclass
class _File:
    rel: str
    text: str
    tree: ast.Module
    src: _Source
    encoding: str


@dataclass
class _Test:
    """One FAIL_TO_PASS function and the listed cases of it that fail."""

    file: _File
    owner: ast.Module | ast.ClassDef
    fn: ast.FunctionDef | ast.AsyncFunctionDef
    prefix: str
    suffixes: list[str]


@dataclass
class _Pending:
    """A set being planned: what its members share, where they may differ."""

    test: _Test
    originals: list[str]
    sites: list[_Site]
    row: _Row | None = None
    params: _Parametrize | None = None
    site: _Site | None = None
    m: int = 2
    context: Counter = field(default_factory=Counter)

    @property
    def cost(self) -> int:
        return len(self.originals)


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


def _is_test_module(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return name.startswith("test") or name.endswith("_test.py")


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
        for n in f.tree.body:
            if isinstance(n, ast.ClassDef) and n.name == parts[0]:
                for item in n.body:
                    if isinstance(item, defs) and item.name == parts[1]:
                        return n, item
    return None


def _expected_params(fn: ast.FunctionDef | ast.AsyncFunctionDef, names: list[str]) -> list[str]:
    """The parameters a case only checks against: the first statement that reads one compares it
    whole for equality with something that does not read it (`assert f(x) == expected`). A twin's
    value there contradicts the real one; a parameter that is also an input would only make the
    twin another case, which may pass."""
    out = []
    for name in names:
        stmt = _first_use(fn, name)
        if stmt is None or stmt not in _always_reached(fn.body) or name not in _eq_name_sides(stmt):
            continue
        sides = _eq_sides(stmt)
        other = [side for side in sides if not (isinstance(side, ast.Name) and side.id == name)]
        if len(other) == 1 and not any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(other[0])):
            out.append(name)
    return out


def _eq_sides(stmt: ast.stmt) -> list[ast.expr]:
    if isinstance(stmt, ast.Assert) and isinstance(stmt.test, ast.Compare) and len(stmt.test.ops) == 1:
        return [stmt.test.left, stmt.test.comparators[0]]
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        return list(stmt.value.args[:2])
    return []


def _signature_ok(fn: ast.FunctionDef | ast.AsyncFunctionDef, names: list[str]) -> bool:
    a = fn.args
    if a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs or a.defaults:
        return False
    if any(arg.annotation is not None for arg in a.args):
        return False
    return all(n in [arg.arg for arg in a.args] for n in names)


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


@dataclass
class _Prepared:
    plan: DecisionPlan
    pending: list[_Pending]
    files: list[_File]
    others: list[Path]
    root: Path
    freq: Counter
    exceptions: Counter
    failing_errors: Mapping[str, str]
    failing_values: Mapping[str, list[str]] = field(default_factory=dict)
    run_strings: list[str] = field(default_factory=list)
    """The run's string constants: a value whose text one of them holds (an expected slice of an
    input string, an expected number the input spells out) is read off the input."""
    run: Counter = field(default_factory=Counter)
    """Every constant the FAIL_TO_PASS run holds (each failing test's code once, each failing case's
    values, the module code kept around them, the support files): a value found twice in it (its
    own place and one more) would stand out, to a reader and in the constant tables alike."""


def _compared(ids: list[str], failing_values: Mapping[str, list[str]]) -> Counter:
    """The values a failing check compared on the buggy code (`FAIL_TO_PASS_VALUES`), as constants."""
    out: Counter = Counter()
    for i in ids:
        for text in failing_values.get(i, []):
            try:
                out[_key(ast.literal_eval(text))] += 1
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue  # not a literal pytest printed whole, or a container (no leaf of ours is one)
    return out


_STATS: dict[tuple, tuple[Counter, Counter, Counter]] = {}


def _suite_stats(files: list[_File], others: list[Path]) -> tuple[Counter, Counter, Counter]:
    """Per suite (cached by its files' identities): how often each test name is referred to, the
    characters its strings use, the builtin exceptions it names."""
    key = (tuple(id(f.tree) for f in files), tuple(str(p) for p in others))
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
    freq: Counter = Counter()
    for f in files:
        for n in ast.walk(f.tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str):
                freq.update(n.value)  # characters, and the pairs they come in
                freq.update(n.value[i : i + 2] for i in range(len(n.value) - 1))
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
    by_rel = {f.rel: f for f in files}
    counts, freq, exceptions = _suite_stats(files, others)
    listed_by_prefix: dict[str, list[str]] = {}
    for entry in listed or fail_to_pass:
        prefix, suffix = _split(entry)
        listed_by_prefix.setdefault(prefix, []).append(suffix)

    tests: dict[str, _Test] = {}
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
        tests.setdefault(prefix, _Test(f, owner, fn, prefix, [])).suffixes.append(suffix)

    pending: list[_Pending] = []
    for t in tests.values():
        f, fn = t.file, t.fn
        # Where an echo of a value would show: the member's own code (its compiled constants, and
        # what a reader of it sees next to the value).
        context = _constants([fn])
        body = _body_sites(
            fn, f.src, context, avoid, _where(fn, [t.prefix + x for x in t.suffixes], failing_lines)
        )
        for site in body:
            if site.kind == "raises":
                site.capacity = _raises_capacity(site, exceptions)
        split = None
        if t.suffixes != [""]:
            params = _parametrize(fn, _module_constants(f.tree))
            if params is not None and _signature_ok(fn, params.argnames) and _body_line(fn) is not None:
                split = match_rows(params, listed_by_prefix.get(t.prefix, t.suffixes))
        if split is not None and params is not None:
            expected = _expected_params(fn, params.argnames)
            for suffix in t.suffixes:
                row = params.rows[split[suffix]]
                if row.marked:
                    plan.uncovered[t.prefix + suffix] = "its case carries marks (skip, xfail): not split off"
                    continue
                # The case's member holds this row and the body, not the other rows.
                others = [d for d in fn.decorator_list if d is not params.decorator]
                row_context = _constants([*row.elements, *fn.body, *others])
                where = _where(fn, [t.prefix + suffix], failing_lines)
                sites = []
                for name in expected:
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
                for site in sites:
                    if site.kind == "raises":
                        site.capacity = _raises_capacity(site, exceptions)
                pending.append(_Pending(t, [t.prefix + suffix], sites, row, params, context=row_context))
        else:
            pending.append(_Pending(t, [t.prefix + s for s in t.suffixes], list(body), context=context))

    prepared = _Prepared(plan, pending, files, others, root, freq, exceptions, failing_errors or {})
    prepared.run, prepared.run_strings = _run_constants(tests, pending, files)
    return prepared


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
    for f in files:
        if f.rel in with_tests:
            nodes += [
                n
                for n in f.tree.body
                if not (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test"))
                and not isinstance(n, ast.ClassDef)
                and not (isinstance(n, ast.Assign) and _is_literal(n.value))
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


def _where(
    fn: ast.FunctionDef | ast.AsyncFunctionDef, ids: list[str], failing_lines: Mapping[str, int] | None
) -> ast.stmt | bool:
    """The always-reached statement every one of `ids` fails at on the buggy code (True: not
    known, any; False: none usable: not known for some, or not one statement)."""
    if failing_lines is None:
        return True
    found: set[int] = set()
    stmts = _always_reached(fn.body)
    for i in ids:
        line = failing_lines.get(i)
        hit = next(
            (st for st in stmts if line is not None and st.lineno <= line <= (st.end_lineno or st.lineno)),
            None,
        )
        if hit is None:
            return False
        found.add(id(hit))
    if len(found) != 1:
        return False
    hit = next(st for st in stmts if id(st) in found)
    if _is_check(hit):
        return hit
    # It failed before any check (the package raised in an assignment): the first check that reads
    # what that statement assigned is where the members may differ; the buggy code never gets there.
    assigned = {n.id for n in ast.walk(hit) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    for st in stmts[stmts.index(hit) + 1 :]:
        if _is_check(st) and any(isinstance(n, ast.Name) and n.id in assigned for n in ast.walk(st)):
            return st
        if any(isinstance(n, ast.Name) and n.id in assigned for n in ast.walk(st)):
            return False  # used by something else first
    return False


def _is_check(stmt: ast.stmt) -> bool:
    if isinstance(stmt, ast.Assert):
        return True
    if isinstance(stmt, (ast.With, ast.AsyncWith)):
        return any(_raises_name(i.context_expr) is not None for i in stmt.items)
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Call)
        and getattr(stmt.value.func, "attr", "").startswith("assert")
    )


def _first_use(fn: ast.FunctionDef | ast.AsyncFunctionDef, name: str) -> ast.stmt | None:
    """The first statement of the body that reads `name`."""
    for stmt in fn.body:
        if any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(stmt)):
            return stmt
    return None


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


def _member_name(name: str, taken: set[str], words: list[str], rng: random.Random) -> str:
    pool = [w for w in words if w not in name.split("_")] or list(_WORD_SUFFIXES)
    for _ in range(200):
        candidate = f"{name}_{rng.choice(pool + list(_WORD_SUFFIXES))}"
        if candidate not in taken:
            taken.add(candidate)
            return candidate
    n = 2
    while f"{name}_{n}" in taken:
        n += 1
    taken.add(f"{name}_{n}")
    return f"{name}_{n}"


def _replace(text: str, base: tuple[int, int], start: tuple[int, int], end: tuple[int, int], new: str) -> str:
    """Replace [start, end) (file positions) in `text`, which begins at file position `base`."""
    src = _Source(text)
    (l1, c1), (l2, c2) = start, end
    bl, bc = base
    r1, r2 = l1 - bl + 1, l2 - bl + 1
    c1 -= bc if l1 == bl else 0
    c2 -= bc if l2 == bl else 0
    head = b"".join(src.bytes[: r1 - 1]) + src.bytes[r1 - 1][:c1]
    tail = src.bytes[r2 - 1][c2:] + b"".join(src.bytes[r2:])
    return (head + new.encode() + tail).decode()


def _member_texts(p: _Pending, f: _File, values: list[str], names: list[str]) -> list[str]:
    """Each member's source (decorators included), in `names` order; member i has values[i]."""
    fn = p.test.fn
    first = min([fn.lineno, *(d.lineno for d in fn.decorator_list)])
    whole = "".join(f.src.lines[first - 1 : fn.end_lineno])
    site = p.site
    assert site is not None
    out = []
    for value, name in zip(values, names, strict=True):
        if p.row is None:
            text = whole
            if site.kind != "row":
                start, end = _span(site.node)
                text = _replace(whole, (first, 0), start, end, value)
            text = re.sub(rf"(\bdef\s+){re.escape(fn.name)}\b", rf"\g<1>{name}", text, count=1)
        else:
            text = _row_member(p, f, site, value, name)
        out.append(text if text.endswith("\n") else text + "\n")
    return out


def _row_member(p: _Pending, f: _File, site: _Site, value: str, name: str) -> str:
    """A parametrized test's one case as a function of its own: the `parametrize` decorator gone,
    the case's values as the parameters' defaults (pytest asks fixtures only for the others)."""
    fn, params, row = p.test.fn, p.params, p.row
    assert params is not None and row is not None
    defaults = []
    for argname, element in zip(params.argnames, row.elements, strict=True):
        e_start, e_end = _span(element)
        text = f.src.segment(e_start, e_end)
        if site.kind == "row" and _contains(element, site.node):
            s_start, s_end = _span(site.node)
            text = _replace(text, e_start, s_start, s_end, value)
        defaults.append(f"{argname}={text}")
    fixtures = [a.arg for a in fn.args.args if a.arg not in params.argnames]
    indent = f.src.lines[fn.lineno - 1][
        : len(f.src.lines[fn.lineno - 1]) - len(f.src.lines[fn.lineno - 1].lstrip())
    ]
    decorators = [
        indent + "@" + f.src.segment(*_span(d)) + "\n" for d in fn.decorator_list if d is not params.decorator
    ]
    first_body = _body_line(fn)
    assert first_body is not None
    body = "".join(f.src.lines[first_body - 1 : fn.end_lineno])
    if site.kind != "row":
        start, end = _span(site.node)
        body = _replace(body, (first_body, 0), start, end, value)
    head = "async def" if isinstance(fn, ast.AsyncFunctionDef) else "def"
    signature = ", ".join([*fixtures, *defaults])
    # Multi-line defaults keep their own line breaks; the body keeps its indentation.
    return "".join(decorators) + f"{indent}{head} {name}({signature}):\n" + body


def _body_line(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int | None:
    """The line the body's first statement starts on, when it starts its own line (not a one-line
    `def f(): ...`); a comment between the signature and it is left out of a copy."""
    first = fn.body[0]
    line = min([first.lineno, *(d.lineno for d in getattr(first, "decorator_list", []))])
    if line <= fn.lineno:
        return None
    return line


def _contains(tree: ast.AST, node: ast.AST) -> bool:
    return any(n is node for n in ast.walk(tree))


def _build(
    plan: DecisionPlan, sets: list[_Pending], prepared: _Prepared, rng: random.Random, *, probe: bool = False
) -> None:
    """Write the decision folder's files: each file with failing tests, its tests replaced by the
    members; the support files as they are. `probe`: the members are the probes of `probe_sites`
    (each set's one twin kept, the real copy left out)."""
    files, others, root = prepared.files, prepared.others, prepared.root
    freq, exceptions = prepared.freq, prepared.exceptions
    by_file: dict[str, list[_Pending]] = {}
    for p in sets:
        by_file.setdefault(p.test.file.rel, []).append(p)
    for rel, group in by_file.items():
        f = group[0].test.file
        every = [n.name for n in ast.walk(f.tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        words = sorted(
            {w for n in every if n.startswith("test") for w in n.split("_")[1:] if w.isalpha() and len(w) > 2}
        )
        taken = {n.id for n in ast.walk(f.tree) if isinstance(n, ast.Name)} | set(every)
        taken |= {n.name for n in ast.walk(f.tree) if isinstance(n, ast.ClassDef)}
        blocks: dict[int, list[str]] = {}  # id(function) -> member texts
        made: list[tuple[_Pending, TwinSet]] = []
        for p in group:
            assert p.site is not None
            # The exception each case fails with on the buggy code is one no member may expect.
            raised = {e for o in p.originals if (e := prepared.failing_errors.get(o))}
            # So is a value it compared on the buggy code (its output there): that member would pass.
            avoid_values = p.context + prepared.run + _compared(p.originals, prepared.failing_values)
            for x in prepared.run_strings:  # and no twin whose text a string of the run holds
                avoid_values[("inside", x)] += 1
            values = None
            for m in range(p.m, 1, -1):  # fewer members when that many values all echo
                if (values := _values(p.site, m, rng, freq, exceptions, avoid_values, raised)) is not None:
                    break
            if values is None:
                for o in p.originals:
                    plan.uncovered[o] = "too few values to draw its members from"
                continue
            names = [_member_name(p.test.fn.name, taken, words, rng) for _ in values]
            rng.shuffle(names)  # drawn in turn, a name could say which value came first
            texts = _member_texts(p, f, values, names)
            order = list(range(len(values)))
            rng.shuffle(order)
            owner = p.test.prefix.rsplit("::", 1)[0]
            members = tuple(
                tuple(
                    f"{owner}::{names[i]}" + ("" if p.row is not None else _split(o)[1]) for o in p.originals
                )
                for i in order
            )
            real = order.index(0)
            drawn = tuple(values[i] for i in order)
            if probe:
                order = [i for i in order if i != 0]
            blocks.setdefault(id(p.test.fn), []).extend(texts[i] for i in order)
            if probe:
                plan.probed.append(p)
            made.append(
                (
                    p,
                    TwinSet(
                        tuple(p.originals),
                        members,
                        real,
                        "row" if p.site.kind == "row" else p.site.kind,
                        drawn,
                        p.site.linked,
                    ),
                )
            )
        text = _rewrite(f, blocks, rng)
        if text is None:
            for p, _ in made:
                for o in p.originals:
                    plan.uncovered[o] = "the rewritten test file did not parse"
            continue
        plan.sets.extend(s for _, s in made)
        plan.files[rel] = text.encode(f.encoding)
    if not plan.sets:
        plan.files.clear()
        return
    # The support files, as they are: conftest, helpers, data. Other test modules stay out
    # (they hold other tests, and so other copies of the truth), unless a kept file imports one.
    kept = set(plan.files)
    imported: set[str] = set()
    for rel in kept:
        for n in ast.parse(plan.files[rel].decode(_encoding(files, rel))).body:
            if isinstance(n, ast.ImportFrom):
                imported.add((n.module or "").rsplit(".", 1)[-1])
            elif isinstance(n, ast.Import):
                imported.update(a.name.rsplit(".", 1)[-1] for a in n.names)
    for f in files:
        if f.rel in kept:
            continue
        if _is_test_module(f.rel) and Path(f.rel).stem not in imported:
            continue
        plan.files[f.rel] = f.text.encode(f.encoding)
    for path in others:
        if path.stat().st_size < 2**24:
            plan.files[path.relative_to(root).as_posix()] = path.read_bytes()


def _encoding(files: list[_File], rel: str) -> str:
    return next((f.encoding for f in files if f.rel == rel), "utf-8")


def _rewrite(f: _File, blocks: dict[int, list[str]], rng: random.Random) -> str | None:
    """The file with every test function removed, the members in place of the failing ones, and
    the module constants nothing uses any more dropped."""
    defs = (ast.FunctionDef, ast.AsyncFunctionDef)
    cuts: list[tuple[int, int, str]] = []

    def cut(fn: ast.FunctionDef | ast.AsyncFunctionDef, indent: str) -> None:
        first = min([fn.lineno, *(d.lineno for d in fn.decorator_list)])
        members = blocks.get(id(fn))
        # A class whose tests all go keeps a body (`pass`).
        text = (
            ("\n" if indent else "\n\n").join(members) if members else (f"{indent}pass\n" if indent else "")
        )
        cuts.append((first, fn.end_lineno or fn.lineno, text))

    # A test the module's own code names (`test_x.slow = True`, an alias) stays, or importing the
    # file would fail; the ones replaced by members go regardless.
    named = {
        n.id
        for node in f.tree.body
        if not isinstance(node, (*defs, ast.ClassDef))
        for n in ast.walk(node)
        if isinstance(n, ast.Name)
    }
    for node in f.tree.body:
        if isinstance(node, defs) and node.name.startswith("test"):
            if node.name not in named or id(node) in blocks:
                cut(node, "")
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, defs) and item.name.startswith("test"):
                    line = f.src.lines[item.lineno - 1]
                    cut(item, line[: len(line) - len(line.lstrip())])
    lines = list(f.src.lines)
    if lines and not lines[-1].endswith(("\n", "\r")):
        lines[-1] += "\n"
    for first, last, text in sorted(cuts, reverse=True):
        lines[first - 1 : last] = [text]
    text = "".join(lines)
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    # Module constants only the removed tests used (a table of expected values) go too.
    for _ in range(10):
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        exported = {
            e.value
            for n in tree.body
            if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in n.targets)
            for e in getattr(n.value, "elts", [])
            if isinstance(e, ast.Constant)
        }
        drop = [
            n
            for n in tree.body
            if isinstance(n, ast.Assign)
            and all(isinstance(t, ast.Name) and t.id not in used and t.id not in exported for t in n.targets)
            and _is_literal(n.value)
        ]
        if not drop:
            break
        src = _Source(text)
        out = list(src.lines)
        for n in sorted(drop, key=lambda n: n.lineno, reverse=True):
            out[n.lineno - 1 : n.end_lineno] = []
        text = "".join(out)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            return None
    return text


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
