"""Where a twin set's members may differ (its *sites*): the expected literals, parameters and
exceptions of a failing test's always-reached checks, how many members each could hold, and the
records of a test being planned. `agentrl.verifiers.twin_sets` says why each rule is there."""

from __future__ import annotations

import ast
import builtins
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.verifiers.canaries import (
    _UNITTEST_EQUAL,
    _always_reached,
    _calls_approx,
    _is_literal,
    _leaves,
    _Source,
    _span,
)
from agentrl.verifiers.twin_ids import _Parametrize, _Row
from agentrl.verifiers.twin_plan import DecisionPlan

_DIGITS = "0123456789"


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
    path: tuple = ()
    """For an element of an expected container: the keys and indices that lead to it."""
    whole: object = None
    """With `path`: the whole expected container's value (None when it has no literal value)."""


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


# The kinds a string member's characters are swapped within: every member of a set then has as many
# vowels, consonants, capitals, digits and punctuation as the real value, so a rule that counts a
# kind (the fewest vowels, the most capitals) picks among ties. Swapped by case alone, a real vowel
# became a consonant about as often as the tests' own letters are consonants, and the member with
# the fewest vowels was the real one more often than chance.
_KINDS = ("aeiou", "bcdfghjklmnpqrstvwxyz", "AEIOU", "BCDFGHJKLMNPQRSTVWXYZ", _DIGITS, _PUNCT)


def _char_class(c: str) -> str:
    """The characters of c's kind (c among them), or "" when c is not to be swapped."""
    return next((kind for kind in _KINDS if c in kind), "") if c else ""


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


def _is_class(func: ast.expr) -> bool:
    """A callee named like a class (`D`, `OrderedDict`, `self.D`) or a builtin constructor."""
    name = getattr(func, "id", getattr(func, "attr", ""))
    return isinstance(func, (ast.Name, ast.Attribute)) and (name[:1].isupper() or name in _CONSTRUCTORS)


def _structure(node: ast.expr) -> bool:
    """A literal, or a container display whose elements are: literals, displays, or a class
    called on one alone (`D({"a": D({"b": 2})})`, a mapping type the test builds its values with)."""
    if _is_literal(node):
        return True
    if isinstance(node, ast.Call):
        return _is_class(node.func) and len(node.args) == 1 and not node.keywords and _structure(node.args[0])
    if isinstance(node, (ast.List, ast.Tuple)):
        return all(_structure(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(k is not None and _is_literal(k) for k in node.keys) and all(
            _structure(v) for v in node.values
        )
    return False


def _structure_value(node: ast.expr) -> object:
    """The plain value of a structure (a class called on a container is taken as that container:
    how a dict-like prints), or None when there is none."""
    if isinstance(node, ast.Call) and len(node.args) == 1:
        return _structure_value(node.args[0])
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_structure_value(e) for e in node.elts]
        return (
            None if any(x is None for x in items) else (list if isinstance(node, ast.List) else tuple)(items)
        )
    if isinstance(node, ast.Dict):
        values = [_structure_value(v) for v in node.values]
        if any(x is None for x in values):
            return None
        try:
            return {ast.literal_eval(k): v for k, v in zip(node.keys, values, strict=True)}  # type: ignore[arg-type]
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _leaf_paths(node: ast.expr, path: tuple = ()) -> list[tuple[ast.AST, tuple]]:
    """The perturbable constants of a structure, each with the keys and indices that lead to it
    (dict keys are left alone, as `_leaves` does: a changed key can make two entries one)."""
    if isinstance(node, ast.Call) and len(node.args) == 1:
        return _leaf_paths(node.args[0], path)
    if isinstance(node, (ast.List, ast.Tuple)):
        return [x for i, e in enumerate(node.elts) for x in _leaf_paths(e, (*path, i))]
    if isinstance(node, ast.Dict):
        out = []
        for k, v in zip(node.keys, node.values, strict=True):
            try:
                key = ast.literal_eval(k)  # type: ignore[arg-type]
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue
            out += _leaf_paths(v, (*path, key))
        return out
    return [(leaf, path) for leaf in _leaves(node)]


def _eq_literal_sides(stmt: ast.stmt) -> list[ast.expr]:
    """The literal sides of an always-reached equality check (assert ==, assertEqual); failing
    those, the one side that is a structure a class is called on (`== D({1: 2})`)."""
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
    literal = [lit for side in sides if (lit := _literal_side(side)) is not None]
    if literal:
        return literal
    # Only when the other side is not one too: `f([1]) == g([2])` compares two computations.
    made = [side for side in sides if isinstance(side, ast.Call) and _structure(side)]
    return made if len(made) == 1 else []


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
            whole = _structure_value(side)
            for leaf, path in _leaf_paths(side):
                if (site := _leaf_site("literal", leaf, src, context, avoid)) is not None:
                    site.path, site.whole = path, whole if path else None
                    sites.append(site)
        items = []
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            items = [i.context_expr for i in stmt.items]
        elif isinstance(stmt, ast.Expr):
            items = [stmt.value]
        elif isinstance(stmt, ast.Assert) and isinstance(stmt.test, ast.Call) and len(stmt.test.args) >= 2:
            # `assert raises(KeyError, f)`: a helper that says whether f raised it (anything else
            # propagates); with no callable, `raises(E)` is a context manager, always true.
            items = [stmt.test]
        for item in items:
            if (name := _raises_name(item)) is not None:
                start, end = _span(name)
                sites.append(
                    _Site("raises", name, src.segment(start, end), name.id, 0, context[("name", name.id)])
                )
    return sites


def _raises_capacity(site: _Site, exceptions: Counter) -> int:
    pool = _unrelated([e for e in dict.fromkeys([*exceptions, *_EXCEPTIONS])], site.text)
    n = 1
    while pool:  # greedy: how many mutually unrelated classes there are
        n += 1
        pool = _unrelated(pool[1:], pool[0])
    return n


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
    ids: list[str] = field(default_factory=list)
    """Every FAIL_TO_PASS id it stands for: its listed cases, under each class that has it (one a
    base class defines and subclasses inherit has a node id under each)."""


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


def _is_test_module(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return name.startswith("test") or name.endswith("_test.py")


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


@dataclass
class _Naturalness:
    """How natural a string reads to one who has the hidden tests' strings: the characters and pairs of
    characters those strings are made of, and the weights of a model that reads from their counts how
    likely a character is at a place (`twin_values._signals`, `_natural`), fitted on the tests' own
    characters (`twin_values._calibrated`). Members are drawn by that model (`twin_values._members`)."""

    pairs: Counter
    theta: tuple[float, ...] = (1.0, 1.0, 0.0)
    """The weights of `twin_values.SIGNALS`."""


@dataclass
class _Prepared:
    plan: DecisionPlan
    pending: list[_Pending]
    files: list[_File]
    others: list[Path]
    root: Path
    freq: _Naturalness
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
