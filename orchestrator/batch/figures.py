"""The figures every view of a batch shows, computed in one place from its task rows: counts by
status, how many were scored and how well (accuracy with its 95 % Wilson interval and its
standard error) and how long they took. The summary a batch writes (`ledger.summarize`) and the
report read back from its folder (`report.build_report`) both take them from here, so the two
cannot disagree on what a figure means."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields
from typing import Any

from .epochs import accuracy_stderr
from .output import FINISHED
from .scoring import percentile, wilson_interval


@dataclass(kw_only=True)
class Figures:
    """The figures, and the fields `BatchSummary` and `BatchReport` share (they extend it)."""

    counts: dict[str, int]
    scored: int
    correct: float
    accuracy: float | None
    accuracy_ci95: list[float] | None
    duration_p50: float | None
    duration_p95: float | None
    #: The mean score's standard error, clustered by task when epochs repeat one
    #: (`epochs.accuracy_stderr`).
    accuracy_stderr: float | None = None

    def accuracy_text(self, scorer: str) -> str | None:
        """The accuracy as one line (`72.0% (18/25 scored, 95% CI 52.4%–85.7%, scorer
        exact)`), or None when no task was scored."""
        if self.accuracy is None or not self.accuracy_ci95:
            return None
        low, high = self.accuracy_ci95
        return (
            f"{self.accuracy:.1%} ({self.correct:g}/{self.scored} scored, "
            f"95% CI {low:.1%}–{high:.1%}, scorer {scorer})"
        )

    def fields(self) -> dict[str, Any]:
        """The figures as keyword arguments of `BatchSummary` and `BatchReport`."""
        return {name: getattr(self, name) for name in FIGURES}


def batch_figures(rows: list[dict[str, Any]]) -> Figures:
    """The figures of task rows (each with `id`, `status`, and `score` and `duration` where
    known; one row per task, or per (task, epoch)). Every status a run can end with is counted,
    at 0 when no row has it."""
    counts = {status: 0 for status in (*FINISHED, "infra_error")}
    counts.update(Counter(str(row["status"]) for row in rows))
    scores = [float(row["score"]) for row in rows if row.get("score") is not None]
    correct = sum(scores)
    durations = [float(row["duration"]) for row in rows if row.get("duration") is not None]
    return Figures(
        counts=counts,
        scored=len(scores),
        correct=correct,
        accuracy=correct / len(scores) if scores else None,
        accuracy_ci95=list(wilson_interval(correct, len(scores))) if scores else None,
        duration_p50=percentile(durations, 50),
        duration_p95=percentile(durations, 95),
        accuracy_stderr=accuracy_stderr(rows),
    )


#: The names of the figures (the fields of `Figures`).
FIGURES = tuple(f.name for f in fields(Figures))
