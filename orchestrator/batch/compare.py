"""Two batches over the same tasks, compared pairwise: which tasks flipped, the difference in
accuracy (or mean score) with its 95 % interval, and a paired test that says whether the
difference is real. Paired, because the same task scored twice is not two independent
samples: comparing two Wilson intervals would understate the evidence.

Pass/fail with one epoch: McNemar's exact test and the Wald interval for paired proportions;
scores between 0 and 1, or epochs (each task's epochs averaged first): the paired t test
and interval (`stats.py`). A p-value of 0.05 or more is "not distinguishable"."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .epochs import PASS, scores_by_task
from .report import BatchReport
from .stats import PairedTest, mcnemar_exact, paired_proportions, paired_t

__all__ = ["Comparison", "compare", "mcnemar_exact"]

#: Below this p-value two batches are said to differ.
ALPHA = 0.05


@dataclass
class Comparison:
    a: str
    b: str
    #: Tasks scored in both batches (the pairs the test is over).
    paired: int
    accuracy_a: float | None
    accuracy_b: float | None
    difference: float | None  # b - a, over the paired tasks
    #: Right in A and wrong in B (`to_wrong`), and the other way round (`to_right`).
    to_wrong: list[dict[str, Any]] = field(default_factory=list)
    to_right: list[dict[str, Any]] = field(default_factory=list)
    p_value: float = 1.0
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    #: The difference's 95 % interval (None: too few pairs), and the test behind `p_value`:
    #: `mcnemar_exact` (pass/fail, one epoch) or `paired_t` (scores, or epochs averaged).
    ci95: list[float] | None = None
    test: str = "mcnemar_exact"
    #: `distinguishable` when p < 0.05, else `not distinguishable`.
    verdict: str = "not distinguishable"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare(a: BatchReport, b: BatchReport) -> Comparison:
    """Pair the tasks of `a` and `b` by id (a task's epochs averaged); a task counts as right
    when its score is >= 0.5 (the built-in scorers give 0 or 1). Tasks unscored in either
    batch are left out."""
    rows_a = {r["id"]: r for r in a.rows}
    rows_b = {r["id"]: r for r in b.rows}
    scores_a, scores_b = scores_by_task(a.rows), scores_by_task(b.rows)
    ids = [i for i in scores_a if i in scores_b]
    mean_a = {i: sum(scores_a[i]) / len(scores_a[i]) for i in ids}
    mean_b = {i: sum(scores_b[i]) / len(scores_b[i]) for i in ids}
    to_wrong: list[dict[str, Any]] = []
    to_right: list[dict[str, Any]] = []
    for i in ids:
        ok_a, ok_b = mean_a[i] >= PASS, mean_b[i] >= PASS
        if ok_a != ok_b:
            ra, rb = rows_a[i], rows_b[i]
            flip = {
                "id": i,
                "answer_a": ra.get("answer"),
                "answer_b": rb.get("answer"),
                "expected": rb.get("expected"),
                "run_a": ra.get("run_id"),
                "run_b": rb.get("run_id"),
            }
            (to_wrong if ok_a else to_right).append(flip)
    n = len(ids)
    test = paired_test(ids, scores_a, scores_b, len(to_wrong), len(to_right))
    return Comparison(
        a=a.batch_id,
        b=b.batch_id,
        paired=n,
        accuracy_a=sum(mean_a.values()) / n if n else None,
        accuracy_b=sum(mean_b.values()) / n if n else None,
        difference=test.difference if test else None,
        to_wrong=to_wrong,
        to_right=to_right,
        p_value=test.p_value if test else 1.0,
        only_in_a=sorted(set(rows_a) - set(rows_b)),
        only_in_b=sorted(set(rows_b) - set(rows_a)),
        ci95=list(test.ci95) if test else None,
        test=test.test if test else "mcnemar_exact",
        verdict="distinguishable" if test and test.p_value < ALPHA else "not distinguishable",
    )


def paired_test(
    ids: list[str],
    scores_a: dict[str, list[float]],
    scores_b: dict[str, list[float]],
    only_a: int,
    only_b: int,
) -> PairedTest | None:
    """McNemar for pass/fail tasks of one epoch each, else the paired t test over the tasks'
    mean scores; None without a pair (or, for the t test, with only one)."""
    if not ids:
        return None
    single = all(len(scores_a[i]) == len(scores_b[i]) == 1 for i in ids)
    binary = all(s in (0.0, 1.0) for i in ids for s in (*scores_a[i], *scores_b[i]))
    if single and binary:
        return paired_proportions(only_a, only_b, len(ids))
    if len(ids) < 2:
        return None
    return paired_t(
        [sum(scores_b[i]) / len(scores_b[i]) - sum(scores_a[i]) / len(scores_a[i]) for i in ids]
    )
