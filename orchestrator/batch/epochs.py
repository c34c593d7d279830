"""Epochs: a task run N times, each attempt its own sandbox and result line. Here the lines
of one task are reduced to one figure per reducer (`mean`, `max`, `mode`, `pass_at_k` for
every k up to N), and a batch's mean score gets its standard error, clustered by task.

How an epoch is stored: a batch run with `--epochs N` (N > 1) writes `"epoch": 1..N` in
every results.jsonl line and attempts.jsonl line (and records `"epochs": N` in batch.json's
options); a batch of one epoch writes no `epoch` at all, as batches always did. A line
without it is epoch 1 (`key`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any, TypeVar

from .stats import clustered_stderr, mean_stderr, pass_at_k

#: A score at or above this is a pass (what pass@k and McNemar count; built-in scorers give
#: 0 or 1).
PASS = 0.5

#: The reducers, in the order they are shown.
REDUCERS = ("mean", "max", "mode")

Key = tuple[str, int]
T = TypeVar("T")


def key(row: dict[str, Any]) -> Key:
    """A result or attempt line's (task id, epoch); no `epoch`: 1."""
    return str(row["id"]), int(row.get("epoch") or 1)


def units(tasks: Iterable[T], epochs: int) -> list[tuple[T, int]]:
    """A batch's units of work, (task, epoch), epoch by epoch: a batch stopped early leaves
    every task with about as many epochs."""
    tasks = list(tasks)
    return [(task, epoch) for epoch in range(1, epochs + 1) for task in tasks]


def epochs_of(options: dict[str, Any]) -> int:
    """The epochs a batch was started with, from batch.json's options (absent: 1)."""
    return int(options.get("epochs") or 1)


def scores_by_task(rows: Iterable[dict[str, Any]]) -> dict[str, list[float]]:
    """The scored epochs of each task (unscored ones left out), in first-seen task order."""
    out: dict[str, list[float]] = {}
    for row in rows:
        if row.get("score") is not None:
            out.setdefault(str(row["id"]), []).append(float(row["score"]))
    return out


def reduce(scores: list[float], reducer: str) -> float:
    """One task's epochs as one score: their mean, their best, or their most common (ties:
    the higher, so that the figure does not depend on the order epochs ended in)."""
    if reducer == "mean":
        return sum(scores) / len(scores)
    if reducer == "max":
        return max(scores)
    counts = Counter(scores)
    return max(counts, key=lambda s: (counts[s], s))


def accuracy_stderr(rows: list[dict[str, Any]]) -> float | None:
    """The standard error of the batch's mean score: over tasks when each has one line, and
    clustered by task when epochs repeat one (Miller 2024)."""
    scored = [r for r in rows if r.get("score") is not None]
    return clustered_stderr([float(r["score"]) for r in scored], [str(r["id"]) for r in scored])


def epoch_metrics(rows: list[dict[str, Any]], epochs: int) -> dict[str, Any]:
    """The batch's figures per reducer, each the mean over tasks of the tasks' reduced scores
    with its standard error across tasks: `mean`, `max`, `mode`, and `pass_at_K` for every K
    up to `epochs` (1 - C(n-c,K)/C(n,K) per task, n scored epochs, c of them passes; a task
    with fewer than K scored epochs is left out of pass@K). Empty for one epoch."""
    if epochs <= 1:
        return {}
    tasks = scores_by_task(rows)
    reducers: dict[str, dict[str, Any]] = {}
    for name in REDUCERS:
        values = [reduce(s, name) for s in tasks.values()]
        reducers[name] = figure(values)
    for k in range(1, epochs + 1):
        values = [
            pass_at_k(len(s), sum(v >= PASS for v in s), k) for s in tasks.values() if len(s) >= k
        ]
        reducers[f"pass_at_{k}"] = figure(values)
    return {"epochs": epochs, "tasks": len(tasks), "reducers": reducers}


def figure(values: list[float]) -> dict[str, Any]:
    """A mean over tasks, its standard error and the tasks it is over."""
    return {
        "value": sum(values) / len(values) if values else None,
        "stderr": mean_stderr(values),
        "tasks": len(values),
    }


def per_task(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each task's epochs reduced: how many were scored and passed, each reducer, and its
    epochs' scores side by side (`by_epoch`, in epoch order; None: unscored)."""
    by_epoch: dict[str, dict[int, Any]] = {}
    for row in rows:
        by_epoch.setdefault(str(row["id"]), {})[int(row.get("epoch") or 1)] = row.get("score")
    out = []
    for task_id, scores in scores_by_task(rows).items():
        marks = by_epoch.get(task_id, {})
        entry: dict[str, Any] = {
            "id": task_id,
            "epochs": len(scores),
            "passed": sum(s >= PASS for s in scores),
            "by_epoch": [marks[e] for e in sorted(marks)],
        }
        entry.update({name: reduce(scores, name) for name in REDUCERS})
        out.append(entry)
    return out


def describe(metrics: dict[str, Any]) -> list[tuple[str, str]]:
    """The reducers as (label, text) lines for a terminal: `pass@3  62.0% ± 4.1% SE`."""
    lines = []
    for name, fig in (metrics.get("reducers") or {}).items():
        if fig["value"] is None:
            continue
        label = name.replace("pass_at_", "pass@") if name.startswith("pass_at_") else name
        se = f" ± {fig['stderr']:.1%} SE" if fig["stderr"] is not None else ""
        lines.append((label, f"{fig['value']:.1%}{se} ({fig['tasks']} tasks)"))
    return lines
