"""The statistics of `orchestrator/batch/stats.py` against values worked out by hand (or from
published tables), so a wrong formula cannot pass by agreeing with itself."""

from __future__ import annotations

import math

import pytest

from orchestrator.batch.stats import (
    clustered_stderr,
    mcnemar_exact,
    mean_stderr,
    paired_proportions,
    paired_t,
    pass_at_k,
    t_quantile95,
    t_two_sided,
)


def test_pass_at_k_is_chens_unbiased_estimator() -> None:
    """1 - C(n-c,k)/C(n,k), worked out: n=5 c=2 k=1 → 1 - 3/5; k=2 → 1 - 3/10;
    n=10 c=1 k=5 → 1 - 126/252; no right attempt → 0; fewer wrong than k → 1."""
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(10, 1, 5) == pytest.approx(0.5)
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 3, 3) == 1.0 and pass_at_k(5, 5, 1) == 1.0
    for n, c in ((5, 1), (7, 3), (10, 9)):  # pass@1 is the share right
        assert pass_at_k(n, c, 1) == pytest.approx(c / n)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_clustered_standard_error_is_millers() -> None:
    """Miller 2024 eq. 4 by hand: [1,1 | 0,0] (epochs agree within a task) has SE² = 1/12 +
    1/16; [1,0 | 1,0] (they disagree) 1/12 - 1/16; one value per cluster: the plain SE."""
    assert clustered_stderr([1, 1, 0, 0], ["a", "a", "b", "b"]) == pytest.approx(math.sqrt(7 / 48))
    assert clustered_stderr([1, 0, 1, 0], ["a", "a", "b", "b"]) == pytest.approx(math.sqrt(1 / 48))
    values = [1.0, 0.0, 0.5, 1.0, 0.25]
    plain = math.sqrt(sum((v - 0.55) ** 2 for v in values) / 4 / 5)
    assert mean_stderr(values) == pytest.approx(plain)
    assert clustered_stderr(values, list("abcde")) == pytest.approx(plain)
    assert clustered_stderr([1.0], ["a"]) is None and mean_stderr([]) is None


def test_mcnemar_exact_by_hand() -> None:
    """Two-sided exact binomial over the discordant pairs: 0 vs 5 → 2/32; 1 vs 9 →
    2·(1 + 10)/1024; balanced → 1; none → 1."""
    assert mcnemar_exact(0, 5) == pytest.approx(0.0625)
    assert mcnemar_exact(9, 1) == pytest.approx(22 / 1024)
    assert mcnemar_exact(3, 3) == 1.0 and mcnemar_exact(0, 0) == 1.0


def test_paired_proportions_interval_by_hand() -> None:
    """40 tasks, 1 right in A alone, 9 in B alone: +8/40, SE = sqrt(10 - 64/40)/40."""
    test = paired_proportions(1, 9, 40)
    half = 1.959964 * math.sqrt(8.4) / 40
    assert test.difference == pytest.approx(0.2)
    assert test.ci95 == pytest.approx((0.2 - half, 0.2 + half))
    assert test.p_value == pytest.approx(22 / 1024) and test.test == "mcnemar_exact"


def test_student_t_matches_the_tables() -> None:
    """The 0.975 quantiles of the t tables (df 1, 3, 9, 39) have two-sided p 0.05; df=2 has
    the closed form p = 1 - t/sqrt(t² + 2)."""
    for df, t in ((1, 12.7062), (3, 3.182446), (4, 2.776445), (9, 2.262157), (39, 2.022691)):
        assert t_two_sided(t, df) == pytest.approx(0.05, abs=1e-5)
        assert t_quantile95(df) == pytest.approx(t, abs=1e-4)
    assert t_two_sided(2.0, 2) == pytest.approx(1 - 2 / math.sqrt(6))
    assert t_two_sided(1.959964, 10**6) == pytest.approx(0.05, abs=1e-5)


def test_paired_t_by_hand() -> None:
    """Differences 1, 2, 3, 4: mean 2.5, SE sqrt(5/3)/2, t = 3.873 on 3 df (p 0.0305 by
    numerical integration of the t density), interval 2.5 ± 3.182446·SE."""
    test = paired_t([1, 2, 3, 4])
    se = math.sqrt(5 / 3) / 2
    assert test.difference == 2.5 and test.test == "paired_t"
    assert test.ci95 == pytest.approx((2.5 - 3.182446 * se, 2.5 + 3.182446 * se), abs=1e-5)
    assert test.p_value == pytest.approx(0.03047, abs=1e-4)
    same = paired_t([0.0, 0.0, 0.0])
    assert same.p_value == 1.0 and same.ci95 == (0.0, 0.0)
