"""Small exact tests for the study's verdicts (no scipy at run time): Fisher's exact test on collapse counts and a
permutation test on per-seed outcomes, plus the smallest difference a study of this size can detect."""

from __future__ import annotations

import itertools
import math

import numpy as np


def fisher_exact(a: int, b: int, c: int, d: int) -> float:
    """Two-sided p of Fisher's exact test on the 2x2 table [[a, b], [c, d]] (e.g. collapsed / not collapsed seeds
    of two arms): the summed probability of every table with the same margins that is no more likely than the
    observed one (the usual two-sided rule, with a relative tolerance of 1e-7 for ties)."""
    if min(a, b, c, d) < 0:
        raise ValueError(f"table [[{a}, {b}], [{c}, {d}]]: counts must be >= 0")
    row1, col1, n = a + b, a + c, a + b + c + d
    if n == 0:
        return 1.0

    def prob(x: int) -> float:
        return math.comb(col1, x) * math.comb(n - col1, row1 - x) / math.comb(n, row1)

    observed = prob(a)
    lo, hi = max(0, row1 + col1 - n), min(row1, col1)
    return float(min(1.0, sum(p for p in (prob(x) for x in range(lo, hi + 1)) if p <= observed * (1 + 1e-7))))


def permutation_p(x, y, *, max_exact: int = 20_000, draws: int = 20_000, seed: int = 0) -> float:
    """Two-sided p of the difference of means of `x` and `y` under random relabelling: exact over every split when
    there are at most `max_exact` of them, else from `draws` seeded random splits."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.size == 0 or y.size == 0:
        raise ValueError("permutation_p needs values on both sides")
    pooled, n = np.concatenate([x, y]), x.size
    observed = abs(x.mean() - y.mean())
    tol = 1e-12 * max(1.0, observed)
    if math.comb(pooled.size, n) <= max_exact:
        splits = (list(c) for c in itertools.combinations(range(pooled.size), n))
    else:
        rng = np.random.default_rng(seed)
        splits = (rng.permutation(pooled.size)[:n] for _ in range(draws))
    hits = total = 0
    for idx in splits:
        chosen = np.zeros(pooled.size, bool)
        chosen[idx] = True
        hits += abs(pooled[chosen].mean() - pooled[~chosen].mean()) >= observed - tol
        total += 1
    return hits / total


def detectable_difference(sd: float, n: int) -> float:
    """The difference of two arms' means (n seeds each, per-seed spread `sd`) that a two-sided test at 5% detects
    with 80% power, by the normal approximation: (1.96 + 0.84) * sd * sqrt(2 / n)."""
    if n < 2:
        return math.inf
    return 2.8 * sd * math.sqrt(2.0 / n)
