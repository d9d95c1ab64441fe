"""Drawing string twins by how naturally they read: the real value is the most natural member of its
set no more often than chance, when the model the planner draws by is the one its author wrote by."""

from __future__ import annotations

import math
import random
import string

import pytest

from agentrl.verifiers.twin_values import _calibrated, _conditional_poisson, _Declined, _members, _own_pairs


def _most_natural_rate(m: int, trials: int, draw, seed: int = 3) -> float:
    """How often the real value is the top-weighted member of a set drawn by `draw`, real ~ weights."""
    rng = random.Random(seed)
    hits = n = 0
    for _ in range(trials):
        w = [rng.random() ** 12 * 50 + 0.05 for _ in range(26)]  # a few natural letters
        cands = list(range(26))
        real = rng.choices(cands, w)[0]
        try:
            got = draw(real, [c for c in cands if c != real], lambda x, w=w: math.log(w[x]), m, rng)
        except _Declined:
            continue
        assert len(got) == m and len(set(got)) == m and got[0] == real
        n += 1
        hits += max(got, key=lambda x, w=w: w[x]) == real
    return hits / n


def _weighted_draw(real, others, log_weight, m, rng):
    """Others by weight, no more: what the planner must not do (the real one stands out as natural)."""
    q = [math.exp(log_weight(x)) for x in others]
    return [real, *[others[k] for k in _conditional_poisson(q, m - 1, rng)]]


@pytest.mark.parametrize("m", [2, 5])
def test_the_real_value_is_the_most_natural_member_no_more_often_than_chance(m):
    trials = 6000
    chance = 1 / m
    tolerance = 4 * (chance * (1 - chance) / (trials * 0.6)) ** 0.5  # ~4 sigma over the sets kept
    assert abs(_most_natural_rate(m, trials, _members) - chance) < tolerance
    # The same check catches a draw that leaves the real value's own weight unanswered.
    assert _most_natural_rate(m, trials, _weighted_draw) > chance + tolerance


def test_conditional_poisson_draws_distinct_members_by_their_product():
    rng = random.Random(0)
    q = [0.1, 0.2, 0.3, 0.4]
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(20000):
        got = tuple(_conditional_poisson(q, 2, rng))
        assert len(set(got)) == 2
        counts[got] = counts.get(got, 0) + 1
    # P({i, j}) is proportional to q_i q_j: {2, 3} is 6 times as likely as {0, 1}.
    assert 5 < counts[(2, 3)] / counts[(0, 1)] < 7.2


def test_the_model_is_fitted_on_the_tests_own_characters():
    words = ["processes", "statuses", "aliases", "databases", "buses", "addresses", "classes"] * 5
    pairs = sum((_own_pairs(w) for w in words), start=_own_pairs(""))
    theta = _calibrated(pairs, words)
    assert theta[0] > 0.3 and theta[1] > 0.3  # a repeated vocabulary: its pairs say which letter is real
    rng = random.Random(0)
    noise = ["".join(rng.choice(string.ascii_lowercase) for _ in range(12)) for _ in range(60)]
    pairs = sum((_own_pairs(w) for w in noise), start=_own_pairs(""))
    flat = _calibrated(pairs, noise)
    assert all(abs(x) < 0.5 for x in flat)  # letters drawn at random: nothing reads as more natural
