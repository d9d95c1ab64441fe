"""Drawing a twin set's values: integers and floats a progression, strings one character apart,
exceptions classes unrelated to each other; the real value at a uniformly random rank, and, where
the buggy code's output is known, every member as near to it as the real one
(`agentrl.verifiers.twin_sets` says why)."""

from __future__ import annotations

import ast
import random
from collections import Counter
from collections.abc import Callable, Collection, Mapping

from agentrl.verifiers.twin_sites import (
    _EXCEPTIONS,
    _MAX_MEMBERS,
    _char_class,
    _is_builtin_exception,
    _key,
    _Pending,
    _Site,
    _string_body,
    _unrelated,
)


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
        pair = _grid_spots(text, spots, m, rng)
        if pair is None:
            return None
        i, j = pair
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


def _grid_spots(text: str, spots: list[int], m: int, rng: random.Random) -> tuple[int, int] | None:
    """Two positions, uniformly among those whose kinds hold m members between them (two vowels
    hold 25 at most): drawn at random first, every pair counted only when that keeps missing."""
    size = {i: len(_char_class(text[i])) for i in spots}
    if len(spots) < 2:
        return None
    for _ in range(64):
        i, j = sorted(rng.sample(spots, 2))
        if size[i] * size[j] >= m:
            return i, j
    pairs = [(i, j) for i in spots for j in spots if i < j and size[i] * size[j] >= m]
    return rng.choice(pairs) if pairs else None


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
    no such position fits is not used. An element of an expected container is held against the
    buggy output's element at its place (`_nears_at`): used where that differs (as above) or is
    missing, never where it agrees."""
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
        at = _nears_at(site, nears) if site.path else nears
        if at is None:
            site.capacity = 0  # the buggy output agrees there (the real member would be nearest), or unknown
            continue
        others = [b for b in at if type(b) is type(v) and b != v]
        if at and not any(b == v and type(b) is type(v) for b in at):
            # The buggy output is known, but as a whole this value is part of (a container): no
            # way to draw members all as near to it, so none at all.
            site.capacity = 0
            continue
        if len(others) != 1 or not any(b == v and type(b) is type(v) for b in at):
            if isinstance(v, str) and not others and (body := _string_body(site.text)) is not None:
                # No output of the buggy code to be near to (the package raised before the check, or
                # the task does not say): room for more members, at two positions.
                classes = sorted(
                    (
                        len(_char_class(c))
                        for k, c in enumerate(body[1])
                        if _char_class(c) and k not in site.quoted
                    ),
                    reverse=True,
                )
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


def _nears_at(site: _Site, nears: list) -> list | None:
    """For an element of an expected container: the values compared at its place, as `nears` holds
    them for a whole value (the element and the buggy output's element there: near-miss rules
    apply), [] when the buggy output has nothing there to be near to (no key, another shape: every
    member is as far from it), None when the element may not differ (the buggy output agrees there,
    so the real member would be the nearest; or what was compared is not this container)."""
    if not nears:
        return []
    same = [b for b in nears if type(b) is type(site.whole) and b == site.whole]
    others: list = []
    for b in nears:  # the buggy output, once (each original of the set compared it)
        if not (type(b) is type(site.whole) and b == site.whole) and b not in others:
            others.append(b)
    if not same or len(others) != 1:
        return None
    b = others[0]
    for step in site.path:
        if not isinstance(b, (list, tuple, dict)):
            return []
        try:
            b = b[step]
        except (KeyError, IndexError, TypeError):
            return []
    v = site.value
    if type(b) is not type(v):
        return []
    return None if b == v else [v, b]


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
