"""pass@k, pass^k and their confidence intervals: pure functions over per-task (n, c) counts.

pass@k is the probability that at least one of k samples drawn without replacement from a
task's n samples is correct, c of them correct (Chen et al., 2021, "Evaluating Large Language
Models Trained on Code", eq. 1):

    pass@k = 1 - C(n - c, k) / C(n, k)

computed in the numerically stable product form of the paper's reference code,
1 - prod_{i = n-c+1}^{n} (1 - k / i), which never forms a binomial coefficient. pass^k ("pass
hat k", Yao et al., 2024, tau-bench) is the probability that all k samples succeed:
C(c, k) / C(n, k) = prod_{i=0}^{k-1} (c - i) / (n - i).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _check(n: int, c: int, k: int) -> None:
    if not (0 <= c <= n):
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not (1 <= k <= n):
        raise ValueError(
            f"need 1 <= k <= n to estimate pass@{k} from n={n} samples; sample at least k per task"
        )


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one task with n samples of which c are correct."""
    _check(n, c, k)
    if n - c < k:
        return 1.0
    # prod over the c correct samples' slots: (1 - k/i) for i in n-c+1..n
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_hat_k(n: int, c: int, k: int) -> float:
    """pass^k: probability that k samples drawn without replacement are all correct."""
    _check(n, c, k)
    if c < k:
        return 0.0
    i = np.arange(k)
    return float(np.prod((c - i) / (n - i)))


def pass_at_k_per_task(n: Sequence[int] | np.ndarray, c: Sequence[int] | np.ndarray, k: int) -> np.ndarray:
    """Vectorised over tasks: pass@k of each task, shape [num_tasks]."""
    n_arr, c_arr = np.asarray(n, dtype=np.int64), np.asarray(c, dtype=np.int64)
    return np.array([pass_at_k(int(a), int(b), k) for a, b in zip(n_arr, c_arr, strict=True)])


def pass_hat_k_per_task(n: Sequence[int] | np.ndarray, c: Sequence[int] | np.ndarray, k: int) -> np.ndarray:
    n_arr, c_arr = np.asarray(n, dtype=np.int64), np.asarray(c, dtype=np.int64)
    return np.array([pass_hat_k(int(a), int(b), k) for a, b in zip(n_arr, c_arr, strict=True)])


def bootstrap_ci(
    per_task: np.ndarray, *, confidence: float = 0.95, reps: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap over tasks of the mean of `per_task` values: (low, high)."""
    per_task = np.asarray(per_task, dtype=np.float64)
    if per_task.size == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, per_task.size, size=(reps, per_task.size))  # [reps, T]
    means = per_task[idx].mean(axis=1)  # [reps]
    alpha = (1.0 - confidence) / 2
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))
