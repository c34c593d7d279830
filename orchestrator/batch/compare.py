"""Two batches over the same tasks, compared pairwise: which tasks flipped, the accuracy
difference, and McNemar's exact test (a paired test: the same task scored twice is not two
independent samples, so comparing two Wilson intervals would understate the evidence)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from math import comb
from typing import Any

from .report import BatchReport


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value: under "no difference" each discordant task is a fair
    coin, so the smaller count is binomial(n, 1/2); 1.0 when no task is discordant."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(comb(n, k) for k in range(min(only_a, only_b) + 1)) / 2**n
    return min(1.0, 2 * tail)


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare(a: BatchReport, b: BatchReport) -> Comparison:
    """Pair the tasks of `a` and `b` by id; a task counts as right when its score is >= 0.5
    (the built-in scorers give 0 or 1). Tasks unscored in either batch are left out."""
    rows_a = {r["id"]: r for r in a.rows}
    rows_b = {r["id"]: r for r in b.rows}
    pairs = [
        (rows_a[i], rows_b[i])
        for i in rows_a
        if i in rows_b and rows_a[i].get("score") is not None and rows_b[i].get("score") is not None
    ]
    to_wrong: list[dict[str, Any]] = []
    to_right: list[dict[str, Any]] = []
    right_a = right_b = 0
    for ra, rb in pairs:
        ok_a, ok_b = float(ra["score"]) >= 0.5, float(rb["score"]) >= 0.5
        right_a += ok_a
        right_b += ok_b
        if ok_a != ok_b:
            flip = {
                "id": ra["id"],
                "answer_a": ra.get("answer"),
                "answer_b": rb.get("answer"),
                "expected": rb.get("expected"),
                "run_a": ra.get("run_id"),
                "run_b": rb.get("run_id"),
            }
            (to_wrong if ok_a else to_right).append(flip)
    n = len(pairs)
    return Comparison(
        a=a.batch_id,
        b=b.batch_id,
        paired=n,
        accuracy_a=right_a / n if n else None,
        accuracy_b=right_b / n if n else None,
        difference=(right_b - right_a) / n if n else None,
        to_wrong=to_wrong,
        to_right=to_right,
        p_value=mcnemar_exact(len(to_wrong), len(to_right)),
        only_in_a=sorted(set(rows_a) - set(rows_b)),
        only_in_b=sorted(set(rows_b) - set(rows_a)),
    )
