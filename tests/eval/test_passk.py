import itertools
from math import comb

import numpy as np
import pytest

from agentrl.eval.passk import bootstrap_ci, pass_at_k, pass_at_k_per_task, pass_hat_k, pass_hat_k_per_task


def brute_pass_at_k(outcomes: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


def brute_pass_hat_k(outcomes: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(outcomes, k))
    return sum(all(s) for s in subsets) / len(subsets)


def test_hand_computed_values():
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # k=1 is the plain success rate
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    # n - c < k: some correct sample is always drawn
    assert pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(4, 0, 4) == 0.0
    # pass^k, n=5, c=3, k=2: C(3,2)/C(5,2) = 3/10
    assert pass_hat_k(5, 3, 2) == pytest.approx(0.3)
    assert pass_hat_k(5, 1, 2) == 0.0


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_matches_brute_force_enumeration_of_all_k_subsets(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(outcomes, k), abs=1e-12)
            assert pass_hat_k(n, c, k) == pytest.approx(brute_pass_hat_k(outcomes, k), abs=1e-12)


def test_stable_for_large_n_where_binomials_overflow_floats():
    n, c, k = 2000, 7, 100
    exact = 1 - comb(n - c, k) / comb(n, k)  # Python ints: exact
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-9)


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match="sample at least k per task"):
        pass_at_k(4, 1, 8)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(4, 5, 1)


def test_vectorised_and_bootstrap():
    per = pass_at_k_per_task([4, 4, 4], [0, 2, 4], 2)
    assert per.tolist() == pytest.approx([0.0, 1 - 1 / 6, 1.0])
    assert pass_hat_k_per_task([4], [2], 2).tolist() == pytest.approx([1 / 6])
    lo, hi = bootstrap_ci(np.array([0.0, 1.0] * 50), seed=1)
    assert lo < 0.5 < hi and hi - lo < 0.3
    assert bootstrap_ci(np.ones(10)) == (1.0, 1.0)
