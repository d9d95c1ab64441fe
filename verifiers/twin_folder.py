"""The decision folder of a twin-set plan: each file with failing tests rewritten (every test
removed, the members of each set in place of the failing ones, renamed and in a random order, the
module constants nothing uses any more dropped), the support files as they are."""

from __future__ import annotations

import ast
import random
import re
from pathlib import Path

from agentrl.verifiers.canaries import (
    _WORD_SUFFIXES,
    _is_literal,
    _Source,
    _span,
    _split,
)
from agentrl.verifiers.twin_plan import DecisionPlan, TwinSet
from agentrl.verifiers.twin_sites import _File, _is_test_module, _Pending, _Prepared, _Site
from agentrl.verifiers.twin_values import _compared, _Declined, _values


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
    by_file: dict[str, list[_Pending]] = {}
    for p in sets:
        by_file.setdefault(p.test.file.rel, []).append(p)
    for rel, group in by_file.items():
        _build_file(plan, rel, group, prepared, rng, probe)
    if not plan.sets:
        plan.files.clear()
        return
    _add_support_files(plan, prepared)


def _build_file(
    plan: DecisionPlan, rel: str, group: list[_Pending], prepared: _Prepared, rng: random.Random, probe: bool
) -> None:
    """One test file of the folder: its sets drawn, their members in place of their tests."""
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
        drawn = _member_set(p, f, prepared, rng, taken, words)
        if drawn is None:
            for o in p.originals:
                plan.uncovered[o] = "too few values to draw its members from"
            continue
        twin_set, texts, order = drawn
        if probe:
            order = [i for i in order if i != 0]
        blocks.setdefault(id(p.test.fn), []).extend(texts[i] for i in order)
        if probe:
            plan.probed.append(p)
        made.append((p, twin_set))
    text = _rewrite(f, blocks, rng)
    if text is None:
        for p, _ in made:
            for o in p.originals:
                plan.uncovered[o] = "the rewritten test file did not parse"
        return
    plan.sets.extend(s for _, s in made)
    plan.files[rel] = text.encode(f.encoding)


def _member_set(
    p: _Pending, f: _File, prepared: _Prepared, rng: random.Random, taken: set[str], words: list[str]
) -> tuple[TwinSet, list[str], list[int]] | None:
    """One set's members: its values drawn, its names, each member's source (real first) and the
    order they go in; None when too few values could be drawn."""
    assert p.site is not None
    # The exception each case fails with on the buggy code is one no member may expect.
    raised = {e for o in p.originals if (e := prepared.failing_errors.get(o))}
    # So is a value it compared on the buggy code (its output there): that member would pass.
    avoid_values = p.context + prepared.run + _compared(p.originals, prepared.failing_values)
    for x in prepared.run_strings:  # and no twin whose text a string of the run holds
        avoid_values[("inside", x)] += 1
    values = None
    try:
        for m in range(p.m, 1, -1):  # fewer members when that many values all echo
            values = _values(p.site, m, rng, prepared.freq, prepared.exceptions, avoid_values, raised)
            if values is not None:
                break
    except _Declined:
        # Not retried with fewer members: a second chance would be likelier to be needed where the
        # real value is the natural one, which is what declining keeps from showing.
        return None
    if values is None:
        return None
    names = [_member_name(p.test.fn.name, taken, words, rng) for _ in values]
    rng.shuffle(names)  # drawn in turn, a name could say which value came first
    texts = _member_texts(p, f, values, names)
    order = list(range(len(values)))
    rng.shuffle(order)
    # Each original's member runs under the original's own class (an inherited test's, a subclass).
    owners = [_split(o)[0].rsplit("::", 1)[0] for o in p.originals]
    members = tuple(
        tuple(
            f"{owner}::{names[i]}" + ("" if p.row is not None else _split(o)[1])
            for owner, o in zip(owners, p.originals, strict=True)
        )
        for i in order
    )
    drawn = tuple(values[i] for i in order)
    twin_set = TwinSet(tuple(p.originals), members, order.index(0), p.site.kind, drawn, p.site.linked)
    return twin_set, texts, order


def _add_support_files(plan: DecisionPlan, prepared: _Prepared) -> None:
    """The support files, as they are: conftest, helpers, data. Other test modules stay out (they
    hold other tests, and so other copies of the truth), unless a kept file imports one."""
    kept = set(plan.files)
    imported: set[str] = set()
    for rel in kept:
        for n in ast.parse(plan.files[rel].decode(_encoding(prepared.files, rel))).body:
            if isinstance(n, ast.ImportFrom):
                imported.add((n.module or "").rsplit(".", 1)[-1])
            elif isinstance(n, ast.Import):
                imported.update(a.name.rsplit(".", 1)[-1] for a in n.names)
    for f in prepared.files:
        if f.rel in kept:
            continue
        if _is_test_module(f.rel) and Path(f.rel).stem not in imported:
            continue
        plan.files[f.rel] = f.text.encode(f.encoding)
    for path in prepared.others:
        if path.stat().st_size < 2**24:
            plan.files[path.relative_to(prepared.root).as_posix()] = path.read_bytes()


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
