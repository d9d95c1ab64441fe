"""AST mutation operators: plant one small bug in one function of a module's source.

Pure functions of source text, no sandbox. `enumerate_sites` lists every place in every
function where an operator applies; `apply_site` turns one site into a `Mutant`. The edit is
spliced into the original text over exactly the mutated node's span (columns included), so
the rest of the file keeps its bytes, comments and formatting: a mutant differs from the
original only where the bug is, and nothing else (reformatting, lost comments) gives away
which function was touched. After splicing, the mutant is parsed again and its AST must equal
the intended one, which catches precedence surprises.

Operators (`KINDS`):

| kind | change |
|---|---|
| `compare_negate` | `<` ↔ `>=`, `>` ↔ `<=`, `==` ↔ `!=`, `is` ↔ `is not`, `in` ↔ `not in` |
| `compare_boundary` | `<` ↔ `<=`, `>` ↔ `>=` |
| `constant_off_by_one` | an integer literal `n` → `n + 1` or `n - 1` |
| `slice_off_by_one` | a slice bound or subscript index `i` → `i + 1` or `i - 1` |
| `range_off_by_one` | an argument `x` of `range(...)` → `x + 1` or `x - 1` |
| `swap_arguments` | two neighbouring positional arguments of a call swapped |
| `swap_operands` | operands of `-`, `/`, `//`, `%`, `**` swapped |
| `arith_operator` | `+` ↔ `-`, `*` ↔ `//`, `/` → `*`, `%` → `//` (also in `+=` ...) |
| `bool_operator` | `and` ↔ `or` |
| `negate_condition` | the test of an `if`/`while`/conditional expression negated |
| `wrong_return` | `return x` → `return None`; `return True` ↔ `return False` |
| `drop_statement` | one statement of a block removed (`pass` if it was the only one) |
| `change_default` | a parameter's int default `n` → `n ± 1`, a bool default flipped |
"""

from __future__ import annotations

import ast
import copy
import functools
from collections.abc import Iterator
from dataclasses import dataclass

KINDS: tuple[str, ...] = (
    "compare_negate",
    "compare_boundary",
    "constant_off_by_one",
    "slice_off_by_one",
    "range_off_by_one",
    "swap_arguments",
    "swap_operands",
    "arith_operator",
    "bool_operator",
    "negate_condition",
    "wrong_return",
    "drop_statement",
    "change_default",
)

_NEGATE = {
    ast.Lt: ast.GtE,
    ast.GtE: ast.Lt,
    ast.Gt: ast.LtE,
    ast.LtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_BOUNDARY = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}
_ARITH = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.FloorDiv,
    ast.FloorDiv: ast.Mult,
    ast.Div: ast.Mult,
    ast.Mod: ast.FloorDiv,
}
_NON_COMMUTATIVE = (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
_SYMBOL = {
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Is: "is",
    ast.IsNot: "is not",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
    ast.And: "and",
    ast.Or: "or",
}
# Statements whose removal is a plausible bug; docstrings, `pass`, imports, nested
# definitions and scope declarations are not.
_DROPPABLE = (
    ast.Expr,
    ast.Assign,
    ast.AugAssign,
    ast.AnnAssign,
    ast.If,
    ast.For,
    ast.While,
    ast.With,
    ast.Raise,
    ast.Return,
    ast.Try,
    ast.Delete,
)


@dataclass(frozen=True)
class Site:
    """One applicable mutation: `node_index` is the target's position in `ast.walk(function)`."""

    function: str
    """Qualified name inside the module (`Class.method`, `func`)."""
    kind: str
    node_index: int
    variant: int
    """Which of the operator's alternatives (`n + 1` or `n - 1`, ...)."""
    lineno: int

    @property
    def key(self) -> str:
        return f"{self.function}:{self.kind}:{self.node_index}:{self.variant}"


@dataclass(frozen=True)
class Mutant:
    site: Site
    description: str
    """What changed, e.g. "`<` -> `>=`" (for statistics; never shown to the agent)."""
    source: str
    """The whole mutated module."""
    original_function: str
    """The function's source lines before and after the mutation: what the oracle swaps back."""
    mutated_function: str


class MutationError(ValueError):
    """The site cannot be applied to this source (stale site, precedence, unsplicable statement)."""


def functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Top-level functions and methods of top-level classes (nested classes too), with qualified names.

    Functions nested inside functions belong to their outer function: a mutation there is a
    mutation of the outer one (that is the unit a split is keyed on).
    """

    def visit(
        body: list[ast.stmt], prefix: str
    ) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield prefix + node.name, node
            elif isinstance(node, ast.ClassDef):
                yield from visit(node.body, f"{prefix}{node.name}.")

    yield from visit(tree.body, "")


def _is_docstring(stmt: ast.stmt, body: list[ast.stmt]) -> bool:
    return (
        stmt is body[0]
        and isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Constant)
        and isinstance(stmt.value.value, str)
    )


def _int_const(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Constant) and type(node.value) is int  # bools are ints: excluded
    )


def _plus(node: ast.expr, delta: int) -> ast.expr:
    return ast.BinOp(left=node, op=ast.Add() if delta > 0 else ast.Sub(), right=ast.Constant(1))


def _variants(
    func: ast.FunctionDef | ast.AsyncFunctionDef, node: ast.AST, parents: dict[int, ast.AST]
) -> Iterator[tuple[str, int]]:
    """(kind, variant) pairs that apply at `node`."""
    parent = parents.get(id(node))
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        op = type(node.ops[0])
        if op in _NEGATE:
            yield "compare_negate", 0
        if op in _BOUNDARY:
            yield "compare_boundary", 0
    if _int_const(node) and not _in_signature(func, node, parents):
        yield "constant_off_by_one", 0
        if node.value >= 1:
            yield "constant_off_by_one", 1
    if (isinstance(parent, ast.Slice) and node in (parent.lower, parent.upper) and not _int_const(node)) or (
        isinstance(parent, ast.Subscript)
        and node is parent.slice
        and isinstance(node, ast.Name)
        and isinstance(parent.ctx, ast.Load)
    ):
        yield "slice_off_by_one", 0
        yield "slice_off_by_one", 1
    if (
        isinstance(parent, ast.Call)
        and isinstance(parent.func, ast.Name)
        and parent.func.id == "range"
        and node in parent.args
        and not _int_const(node)
    ):
        yield "range_off_by_one", 0
        yield "range_off_by_one", 1
    if isinstance(node, ast.Call):
        args = node.args
        for i in range(len(args) - 1):
            if (
                not isinstance(args[i], ast.Starred)
                and not isinstance(args[i + 1], ast.Starred)
                and ast.dump(args[i]) != ast.dump(args[i + 1])
            ):
                yield "swap_arguments", i
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, _NON_COMMUTATIVE) and ast.dump(node.left) != ast.dump(node.right):
            yield "swap_operands", 0
        if type(node.op) in _ARITH and not _is_format(node):
            yield "arith_operator", 0
    if isinstance(node, ast.AugAssign) and type(node.op) in _ARITH:
        yield "arith_operator", 0
    if isinstance(node, ast.BoolOp):
        yield "bool_operator", 0
    if isinstance(parent, ast.If | ast.While | ast.IfExp) and node is parent.test:
        yield "negate_condition", 0
    if isinstance(node, ast.Return) and node.value is not None:
        value = node.value
        if isinstance(value, ast.Constant) and isinstance(value.value, bool):
            yield "wrong_return", 1
        elif not (isinstance(value, ast.Constant) and value.value is None):
            yield "wrong_return", 0
    if isinstance(node, _DROPPABLE) and isinstance(parent, ast.AST):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(parent, field, None)
            if (
                isinstance(block, list)
                and any(s is node for s in block)
                and not _is_docstring(node, block)
                and not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
            ):
                yield "drop_statement", 0
    if node is func:
        defaults = [*node.args.defaults, *[d for d in node.args.kw_defaults if d is not None]]
        for i, d in enumerate(defaults):
            if isinstance(d, ast.Constant) and (type(d.value) is int or isinstance(d.value, bool)):
                yield "change_default", i


def _is_format(node: ast.BinOp) -> bool:
    # `"%s" % x` is string formatting, not arithmetic.
    return isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant | ast.JoinedStr)


def _in_signature(func: ast.AST, node: ast.AST, parents: dict[int, ast.AST]) -> bool:
    """Defaults and decorators are outside the function's body: `change_default` covers defaults."""
    cur: ast.AST | None = node
    while cur is not None and cur is not func:
        p = parents.get(id(cur))
        if p is func and cur not in func.body:  # type: ignore[attr-defined]
            return True
        if isinstance(p, ast.arguments):
            return True
        cur = p
    return False


def _parents(root: ast.AST) -> dict[int, ast.AST]:
    out: dict[int, ast.AST] = {}
    for node in ast.walk(root):
        for child in ast.iter_child_nodes(node):
            out[id(child)] = node
    return out


def enumerate_sites(source: str) -> list[Site]:
    """Every (function, kind, node, variant) where an operator applies, in source order."""
    tree = ast.parse(source)
    sites = []
    for qualname, func in functions(tree):
        parents = _parents(func)
        # Before Python 3.12 the positions of nodes inside f-strings are unreliable: no splicing there.
        in_fstring = {id(n) for js in ast.walk(func) if isinstance(js, ast.JoinedStr) for n in ast.walk(js)}
        for index, node in enumerate(ast.walk(func)):
            if id(node) in in_fstring:
                continue
            for kind, variant in _variants(func, node, parents):
                sites.append(Site(qualname, kind, index, variant, getattr(node, "lineno", func.lineno)))
    return sites


def _transform(
    func: ast.AST, node: ast.AST, parents: dict[int, ast.AST], site: Site
) -> tuple[ast.AST, ast.AST, str]:
    """Mutate the copy in place. Returns (node whose span is replaced, its new version, description)."""
    kind, v = site.kind, site.variant
    if kind in ("compare_negate", "compare_boundary"):
        assert isinstance(node, ast.Compare)
        table = _NEGATE if kind == "compare_negate" else _BOUNDARY
        old = type(node.ops[0])
        new = copy.copy(node)
        new.ops = [table[old]()]
        return node, new, f"`{_SYMBOL[old]}` -> `{_SYMBOL[table[old]]}`"
    if kind == "constant_off_by_one":
        assert isinstance(node, ast.Constant)
        value = node.value + (1 if v == 0 else -1)
        return node, ast.Constant(value), f"`{node.value}` -> `{value}`"
    if kind in ("slice_off_by_one", "range_off_by_one"):
        new = _plus(copy.deepcopy(node), 1 if v == 0 else -1)  # type: ignore[arg-type]
        return node, new, f"`{ast.unparse(node)}` -> `{ast.unparse(new)}`"
    if kind == "swap_arguments":
        assert isinstance(node, ast.Call)
        new = copy.copy(node)
        args = list(node.args)
        args[v], args[v + 1] = args[v + 1], args[v]
        new.args = args
        return node, new, f"arguments {v + 1} and {v + 2} of `{ast.unparse(node.func)}(...)` swapped"
    if kind == "swap_operands":
        assert isinstance(node, ast.BinOp)
        new = ast.BinOp(left=node.right, op=node.op, right=node.left)
        return node, new, f"operands of `{_SYMBOL[type(node.op)]}` swapped"
    if kind == "arith_operator":
        assert isinstance(node, ast.BinOp | ast.AugAssign)
        old = type(node.op)
        new = copy.copy(node)
        new.op = _ARITH[old]()
        aug = "=" if isinstance(node, ast.AugAssign) else ""
        return node, new, f"`{_SYMBOL[old]}{aug}` -> `{_SYMBOL[_ARITH[old]]}{aug}`"
    if kind == "bool_operator":
        assert isinstance(node, ast.BoolOp)
        new = copy.copy(node)
        new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        return node, new, f"`{_SYMBOL[type(node.op)]}` -> `{_SYMBOL[type(new.op)]}`"
    if kind == "negate_condition":
        assert isinstance(node, ast.expr)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return node, node.operand, "`not` removed from a condition"
        return node, ast.UnaryOp(op=ast.Not(), operand=node), "condition negated"
    if kind == "wrong_return":
        assert isinstance(node, ast.Return) and node.value is not None
        if v == 1:
            assert isinstance(node.value, ast.Constant)
            flipped = ast.Constant(not node.value.value)
            return node.value, flipped, f"`return {node.value.value}` -> `return {flipped.value}`"
        return node.value, ast.Constant(None), "return value replaced by `None`"
    if kind == "change_default":
        assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        defaults = [*node.args.defaults, *[d for d in node.args.kw_defaults if d is not None]]
        d = defaults[v]
        assert isinstance(d, ast.Constant)
        value = (not d.value) if isinstance(d.value, bool) else d.value + 1
        return d, ast.Constant(value), f"default `{d.value!r}` -> `{value!r}`"
    raise MutationError(f"unknown mutation kind {kind!r}; known kinds: {', '.join(KINDS)}")


def _replace_in_tree(root: ast.AST, old: ast.AST, new: ast.AST) -> None:
    for parent in ast.walk(root):
        for field, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, field, new)
                return
            if isinstance(value, list):
                for i, item in enumerate(value):
                    if item is old:
                        value[i] = new
                        return
    raise MutationError("mutation target not found in its function")


def _find_function(tree: ast.Module, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    for name, func in functions(tree):
        if name == qualname:
            return func
    raise MutationError(f"no function {qualname!r} in the module")


def _offset(lines: list[bytes], lineno: int, col: int) -> int:
    """Byte offset into the joined file of (1-based line, UTF-8 byte column): AST columns are bytes."""
    return sum(len(line) for line in lines[: lineno - 1]) + col


def _same(a: ast.AST, b: ast.AST) -> bool:
    return ast.dump(a, include_attributes=False) == ast.dump(b, include_attributes=False)


@functools.lru_cache(maxsize=8)
def _parse_cached(source: str) -> ast.Module:
    # Many sites of one module are applied in a row; the original tree is only read, never changed.
    return ast.parse(source)


def apply_site(source: str, site: Site) -> Mutant:
    """Apply one site to `source`; raises `MutationError` when it cannot be done faithfully."""
    tree = _parse_cached(source)
    func = _find_function(tree, site.function)
    nodes = list(ast.walk(func))
    if site.node_index >= len(nodes):
        raise MutationError(f"site {site.key} does not exist in this source")
    # The function as the mutant must parse to: a copy of its tree, changed the same way.
    expected = copy.deepcopy(func)
    if site.kind == "drop_statement":
        mutated, description = _drop_statement(source, func, expected, site)
    else:
        mutated, description = _splice(source, func, expected, site)
    mutated_text = mutated.decode()
    try:
        new_func = _find_function(ast.parse(mutated_text), site.function)
    except SyntaxError as exc:
        raise MutationError(f"mutant does not parse: {exc}") from exc
    if not _same(new_func, expected):
        raise MutationError("mutant's AST is not the intended one")
    # Everything outside the original function's lines is unchanged, so the mutant's function
    # is whatever lies between the same prefix and suffix: swapping the two spans is exact.
    olines, mlines = source.splitlines(keepends=True), mutated_text.splitlines(keepends=True)
    start = min([func.lineno, *[d.lineno for d in func.decorator_list]]) - 1
    tail = len(olines) - func.end_lineno  # type: ignore[operator]
    return Mutant(
        site=site,
        description=description,
        source=mutated_text,
        original_function="".join(olines[start : len(olines) - tail]),
        mutated_function="".join(mlines[start : len(mlines) - tail]),
    )


def _block_of(parent: ast.AST, stmt: ast.AST) -> list[ast.stmt]:
    """The statement list of `parent` (body, orelse, finalbody) that holds `stmt`."""
    return next(
        getattr(parent, f)
        for f in ("body", "orelse", "finalbody")
        if isinstance(getattr(parent, f, None), list) and any(s is stmt for s in getattr(parent, f))
    )


def _drop_statement(
    source: str, func: ast.FunctionDef | ast.AsyncFunctionDef, expected: ast.AST, site: Site
) -> tuple[bytes, str]:
    """The source with the site's statement removed (`pass` when it was its block's only one), and
    `expected` changed to match; the mutant's bytes and a description."""
    target = list(ast.walk(func))[site.node_index]
    exp_target = list(ast.walk(expected))[site.node_index]
    block = _block_of(_parents(func)[id(target)], target)
    exp_block = _block_of(_parents(expected)[id(exp_target)], exp_target)
    data = source.encode()
    blines = data.splitlines(keepends=True)
    start = _offset(blines, target.lineno, 0)  # type: ignore[attr-defined]
    end = _offset(blines, target.end_lineno, len(blines[target.end_lineno - 1]))  # type: ignore[attr-defined]
    first = blines[target.lineno - 1]  # type: ignore[attr-defined]
    last = blines[target.end_lineno - 1]  # type: ignore[attr-defined]
    if first[: target.col_offset].strip() or last[target.end_col_offset :].split(b"#")[0].strip():  # type: ignore[attr-defined]
        raise MutationError("statement shares its line with another statement")
    if len(block) == 1:
        replacement = first[: target.col_offset] + b"pass\n"  # type: ignore[attr-defined]
        exp_block[exp_block.index(exp_target)] = ast.Pass()  # type: ignore[arg-type]
    else:
        replacement = b""
        exp_block.remove(exp_target)  # type: ignore[arg-type]
    return data[:start] + replacement + data[end:], f"`{type(target).__name__}` statement removed"


def _splice(
    source: str, func: ast.FunctionDef | ast.AsyncFunctionDef, expected: ast.AST, site: Site
) -> tuple[bytes, str]:
    """The source with the site's node replaced by its transform, unparsed and spliced in (in
    parentheses only when needed), and `expected` changed to match; the mutant's bytes and a
    description."""
    target = list(ast.walk(func))[site.node_index]
    exp_target = list(ast.walk(expected))[site.node_index]
    old_node, new_node, description = _transform(func, target, _parents(func), site)
    exp_old, exp_new, _ = _transform(expected, exp_target, _parents(expected), site)
    if exp_old is expected:
        raise MutationError("cannot replace a whole function")
    _replace_in_tree(expected, exp_old, exp_new)
    data = source.encode()
    blines = data.splitlines(keepends=True)
    start = _offset(blines, old_node.lineno, old_node.col_offset)  # type: ignore[attr-defined]
    end = _offset(blines, old_node.end_lineno, old_node.end_col_offset)  # type: ignore[attr-defined]
    text = ast.unparse(new_node).encode()
    # Parenthesised only when needed: the replacement may bind looser than its context.
    for candidate in (text, b"(" + text + b")"):
        attempt = data[:start] + candidate + data[end:]
        try:
            got = _find_function(ast.parse(attempt), site.function)
        except SyntaxError:
            continue
        if _same(got, expected):
            return attempt, description
    raise MutationError(f"splicing `{text.decode()}` does not give the intended AST")


def is_equivalent(original: str, mutated: str) -> bool:
    """Syntactically identical modules (the mutation changed nothing the interpreter sees)."""
    return _same(_parse_cached(original), ast.parse(mutated))
