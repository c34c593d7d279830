"""The statistics of an evaluation, written out with `math` (no SciPy): pass@k's unbiased
estimator, a mean's standard error clustered by task, and the paired tests that say whether
two batches over the same tasks differ (McNemar's exact test, the paired t interval).

References (named in docs/guides/batch.md): Chen et al. 2021, "Evaluating Large Language
Models Trained on Code" (pass@k); Miller 2024, "Adding Error Bars to Evals" (clustered
standard errors); McNemar 1947 (the paired test of two proportions)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

#: The two-sided 95 % normal quantile.
Z95 = 1.959964


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k attempts drawn from n (c of them right) is right:
    1 - C(n-c, k) / C(n, k), unbiased for pass@k (Chen et al. 2021). ValueError for k > n."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n and 0 <= c <= n (n={n}, c={c})")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_stderr(values: Sequence[float]) -> float | None:
    """The standard error of a mean of independent values: sample sd / sqrt(n); None for
    fewer than two."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def clustered_stderr(values: Sequence[float], clusters: Sequence[Hashable]) -> float | None:
    """The standard error of the mean of `values` when values of one cluster (the epochs of
    one task) are not independent (Miller 2024, eq. 4):

        SE² = SE_CLT² + (1/n²) Σ_c Σ_i Σ_{j≠i} (s_ic - s̄)(s_jc - s̄)

    with SE_CLT the ordinary standard error (`mean_stderr`). Each value its own cluster: the
    ordinary standard error. None for fewer than two values."""
    plain = mean_stderr(values)
    if plain is None:
        return None
    n = len(values)
    mean = sum(values) / n
    sums: dict[Hashable, float] = {}
    squares: dict[Hashable, float] = {}
    for value, cluster in zip(values, clusters, strict=True):
        sums[cluster] = sums.get(cluster, 0.0) + (value - mean)
        squares[cluster] = squares.get(cluster, 0.0) + (value - mean) ** 2
    # Σ_{i≠j} r_i r_j over a cluster = (Σ r)² - Σ r².
    cross = sum(sums[c] ** 2 - squares[c] for c in sums)
    return math.sqrt(max(0.0, plain**2 + cross / n**2))


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value (McNemar 1947): under "no difference" each discordant
    task is a fair coin, so the smaller count is binomial(n, 1/2); 1.0 when none is."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(only_a, only_b) + 1)) / 2**n
    return min(1.0, 2 * tail)


def t_two_sided(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with `df` (a whole number >= 1) degrees of freedom, by
    the finite series for whole df (Abramowitz & Stegun 26.7.3-4); past 1000 df the normal
    tail (they agree to 1e-3 there, and the series' length grows with df)."""
    if df > 1000:
        return math.erfc(abs(t) / math.sqrt(2))
    theta = math.atan(abs(t) / math.sqrt(df))
    s, c = math.sin(theta), math.cos(theta)
    if df % 2:  # odd: 2/π (θ + sin θ (cos θ + 2/3 cos³θ + ...)), the sum up to cos^(df-2)
        term, total = c, c if df > 1 else 0.0
        for j in range(3, df - 1, 2):
            term *= c * c * (j - 1) / j
            total += term
        inside = 2 / math.pi * (theta + s * total)
    else:  # even: sin θ (1 + 1/2 cos²θ + 1·3/(2·4) cos⁴θ + ...), up to cos^(df-2)
        term = total = 1.0
        for j in range(2, df - 1, 2):
            term *= c * c * (j - 1) / j
            total += term
        inside = s * total
    return min(1.0, max(0.0, 1.0 - inside))


def t_quantile95(df: int) -> float:
    """The t with P(|T| >= t) = 0.05 for `df` degrees of freedom (bisection on `t_two_sided`)."""
    low, high = 0.0, 20.0 if df > 1 else 20.0 + 1e3
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if t_two_sided(middle, df) > 0.05 else (low, middle)
    return (low + high) / 2


@dataclass(frozen=True)
class PairedTest:
    """A paired difference (B - A, per task), its 95 % interval, and a test's p-value."""

    difference: float
    ci95: tuple[float, float]
    p_value: float
    test: str


def paired_proportions(only_a: int, only_b: int, n: int) -> PairedTest:
    """Pass/fail over the same n tasks, `only_a` right in A alone, `only_b` in B alone: the
    difference (only_b - only_a)/n, its Wald interval for paired proportions (SE =
    sqrt(b + c - (b - c)²/n) / n, Agresti 2002 §10.1) and McNemar's exact p-value."""
    difference = (only_b - only_a) / n
    se = math.sqrt(max(0.0, only_a + only_b - (only_b - only_a) ** 2 / n)) / n
    interval = (difference - Z95 * se, difference + Z95 * se)
    return PairedTest(difference, interval, mcnemar_exact(only_a, only_b), "mcnemar_exact")


def paired_t(differences: Sequence[float]) -> PairedTest:
    """Scores over the same tasks: the mean per-task difference, its t interval
    (mean ± t₀.₉₇₅,ₙ₋₁ · sd/√n) and the paired t test's two-sided p-value. All differences
    equal: an interval of width 0, p = 1 when they are 0, else 0. ValueError for n < 2."""
    n = len(differences)
    if n < 2:
        raise ValueError("a paired t test needs at least two tasks")
    mean = sum(differences) / n
    se = mean_stderr(differences) or 0.0
    if se == 0:
        return PairedTest(mean, (mean, mean), 1.0 if mean == 0 else 0.0, "paired_t")
    half = t_quantile95(n - 1) * se
    return PairedTest(mean, (mean - half, mean + half), t_two_sided(mean / se, n - 1), "paired_t")
