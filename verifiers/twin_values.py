"""Drawing a twin set's values: integers and floats a progression, the real value at a uniformly
random rank; strings one character apart, drawn by how naturally they read so that the real one is no
likelier than a twin to be the natural one (`_members`); exceptions classes unrelated to each other;
and, where the buggy code's output is known, every member as near to it as the real one
(`agentrl.verifiers.twin_sets` says why)."""

from __future__ import annotations

import ast
import math
import random
from collections import Counter
from collections.abc import Callable, Collection, Mapping

from agentrl.verifiers.twin_sites import (
    _EXCEPTIONS,
    _MAX_MEMBERS,
    _char_class,
    _is_builtin_exception,
    _key,
    _Naturalness,
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


_START, _END = "\x02", "\x03"  # around a string where its characters are counted: its ends count too


def _own_pairs(text: str) -> Counter:
    """The characters of text and the pairs they come in (its ends marked): what one occurrence adds
    to `_Naturalness.pairs`."""
    t = f"{_START}{text}{_END}"
    return Counter(text) + Counter(t[k : k + 2] for k in range(len(t) - 1))


SIGNALS = ("pair_left", "pair_right", "character")
"""What `_signals` reads at a place, in its order."""


def _signals(freq: Counter, s: str, i: int, own: Counter | None = None) -> tuple[float, ...]:
    """What says how natural character i of s reads, by the characters and pairs `freq` counts (less
    `own`: the real value's own occurrence, which a twin does not have in the tests the plan is drawn
    from): log(1 + count) of the pair on its left and on its right (an end of the string counts as a
    character), and of the character alone (`SIGNALS`). Runs of three read sharper on the tests'
    strings, and drew twins that a forger told apart more often (docs/SECURITY.md)."""

    def count(key: str) -> float:
        return math.log1p(max(0, freq.get(key, 0) - (own.get(key, 0) if own else 0)))

    t = f"{_START}{s}{_END}"
    k = i + 1  # its place in t
    return count(t[k - 1 : k + 1]), count(t[k : k + 2]), count(t[k])


def _natural(nat: _Naturalness, s: str, at: Collection[int], own: Counter | None = None) -> float:
    """The log of the model's weight of s where it differs from its twins (positions `at`): how likely
    the test's author was to write these characters there, up to a term the same for every twin."""
    return sum(w * x for k in at for w, x in zip(nat.theta, _signals(nat.pairs, s, k, own), strict=True))


_CALIBRATION_POSITIONS = 800
_UNFITTED = (1.0, 1.0, 0.0)  # no string to fit on: the two pairs' counts, as twins were once ranked


def _calibrated(pairs: Counter, strings: list[str]) -> tuple[float, ...]:
    """The weights of `_signals` that make exp(weights . signals), normalised over the characters of a
    position's kind, the likeliest model of the characters the tests' strings have (a conditional
    logit fitted by Newton's method; each string's own occurrence left out, as at a site; positions
    drawn with a fixed seed). Drawing twins from that model is what makes the real one no more likely
    than a twin to read naturally: a flatter model leaves the real value the most natural member, a
    sharper one the least."""
    import numpy as np

    positions = [(t, i) for t in dict.fromkeys(strings) for i, c in enumerate(t) if len(_char_class(c)) >= 2]
    if not positions:
        return _UNFITTED
    rows = []  # per position: the signals of each character of its kind, and the real one's index
    for t, i in random.Random(0).sample(positions, min(len(positions), _CALIBRATION_POSITIONS)):
        own = _own_pairs(t)
        kind = _char_class(t[i])
        x = np.array([_signals(pairs, t[:i] + c + t[i + 1 :], i, own) for c in kind])  # (n, signals)
        rows.append((x, kind.index(t[i])))
    theta = np.zeros(len(SIGNALS))
    for _ in range(25):
        # A unit normal prior on each weight: a small suite's strings can separate the real characters
        # outright, and the likeliest weights are then infinite.
        grad = -theta
        hess = -np.eye(len(SIGNALS))
        for x, real in rows:
            z = x @ theta  # (n,)
            q = np.exp(z - z.max())
            q /= q.sum()
            mean = q @ x  # (signals,)
            grad += x[real] - mean
            hess -= (x * q[:, None]).T @ x - np.outer(mean, mean)
        step = np.linalg.solve(hess, grad)
        theta -= step
        if np.abs(step).max() < 1e-6:
            break
    return tuple(round(float(v), 4) for v in theta)  # type: ignore[return-value]


class _Declined(Exception):
    """A site drawn members for declined them (`_members`): the set is not made, at any size."""


def _members(
    real: str, others: list[str], log_weight: Callable[[str], float], m: int, rng: random.Random
) -> list[str]:
    """The real candidate and m - 1 others, drawn so that the real one is no more likely than any
    member to be the one a reader of `log_weight` would pick, whatever their rule.

    The candidates' weights (the calibrated naturalness, `_natural`), normalised, are taken as the
    chance p(x) that the test's author wrote x here. The others are drawn as a set S with probability
    proportional to the product of their p (conditional Poisson sampling); then
    P(S, real = x) = p(x) * prod(p, S) / Z(x), where
    Z(x) is that product summed over every set of m - 1 others than x. Only Z(x) singles out the real
    member, so the draw goes ahead with probability Z(real) / max Z and is declined otherwise
    (`_Declined`): then P(S, real = x) is the product of p over all m, the same whichever member is
    real. Ranking the candidates and cutting a window around the real one (how twins were drawn
    before) cannot give that where the real value is the most natural candidate, as it often is."""
    logs = [log_weight(x) for x in [real, *others]]
    top = max(logs)
    raw = [math.exp(x - top) for x in logs]
    total = sum(raw)
    p = [x / total for x in raw]
    z = _without_each(p, m - 1)
    if rng.random() * max(z) > z[0]:
        raise _Declined("the real value reads more naturally than the draw can hide")
    chosen = _conditional_poisson(p[1:], m - 1, rng)
    return [real, *[others[k] for k in chosen]]


def _without_each(p: list[float], k: int) -> list[float]:
    """e_k (the elementary symmetric polynomial of degree k) of p with each p[j] left out, for every j."""
    e = [1.0] + [0.0] * k
    for x in p:
        for d in range(k, 0, -1):
            e[d] += x * e[d - 1]
    out = []
    for x in p:
        f = 1.0  # e_d of p without x, from e_d = f_d + x * f_(d-1)
        for d in range(1, k + 1):
            f = max(0.0, e[d] - x * f)
        out.append(f)
    return out


def _conditional_poisson(q: list[float], k: int, rng: random.Random) -> list[int]:
    """k distinct indices of q, a set drawn with probability proportional to the product of its q."""
    n = len(q)
    # tail[t][d]: e_d of q[t:]
    tail = [[0.0] * (k + 1) for _ in range(n + 1)]
    tail[n][0] = 1.0
    for t in range(n - 1, -1, -1):
        tail[t][0] = 1.0
        for d in range(1, k + 1):
            tail[t][d] = tail[t + 1][d] + q[t] * tail[t + 1][d - 1]
    chosen: list[int] = []
    need = k
    for t in range(n):
        if need == 0:
            break
        if rng.random() * tail[t][need] < q[t] * tail[t + 1][need - 1]:
            chosen.append(t)
            need -= 1
    return chosen


def _edited(b: str, x: str) -> int:
    """The position of the character an edit of b put into x."""
    for i, c in enumerate(x):
        if i >= len(b) or b[i] != c:
            return i
    return len(x) - 1


_ATTEMPTS = 8  # places of a string tried before its site is declined


def _string_texts(site: _Site, m: int, rng: random.Random, freq: _Naturalness) -> list[str] | None:
    """m texts for a string site, the real one first; None when no place in it has room for m.
    Raises `_Declined` when each place tried declined its draw (`_members`)."""
    body = _string_body(site.text)
    assert body is not None
    head, text, quote = body
    own = _own_pairs(text)

    def natural(*at: int) -> Callable[[str], float]:
        return lambda x: _natural(freq, x, at, own)

    places: list[tuple[list[str], Callable[[str], float]]] = []  # (candidates, their weight) per place
    if isinstance(site.near, str) and _neighbour_edit(text, site.near) is not None:
        # One edit from the buggy output, each, like the real value.
        near = site.near
        edits = _neighbours(near, text)
        places.append((edits, lambda x: natural(_edited(near, x))(x)))
    elif site.grid:
        spots = [i for i, c in enumerate(text) if _char_class(c) and i not in site.quoted]
        for _ in range(_ATTEMPTS):
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
            places.append((made, natural(i, j)))
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
        near = site.near
        for i in rng.sample(positions, min(len(positions), _ATTEMPTS)):
            # Never the buggy output's own character there: that member would be the buggy output itself.
            taken = {text[i]} | ({near[i]} if isinstance(near, str) and len(near) == len(text) else set())
            made = [
                text[:i] + c + text[i + 1 :] for c in (site.pool or _char_class(text[i])) if c not in taken
            ]
            places.append((made, natural(i)))
    for made, weight in places:
        if len(made) < m - 1:
            continue
        try:
            picked = _members(text, made, weight, m, rng)
        except _Declined:
            continue
        return [f"{head}{x}{quote}" for x in picked]
    if any(len(made) >= m - 1 for made, _ in places):
        raise _Declined("every place tried declined its draw")
    return None


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
    freq: _Naturalness,
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
    site: _Site,
    m: int,
    rng: random.Random,
    freq: _Naturalness,
    exceptions: Counter,
    raised: Collection[str] = (),
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
