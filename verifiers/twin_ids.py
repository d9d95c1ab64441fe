"""pytest's ids for the cases of a parametrized test, read from its source: which row of a
`parametrize` decorator a listed case (`test_x[a-1]`) is, by pytest 7's and pytest 8's rules, so
that each failing case can become a twin set of its own (`agentrl.verifiers.twin_sets`)."""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from agentrl.verifiers.canaries import _is_literal


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
