"""The batches a viewer knows: the output folders it was given (scores, expected answers,
comparisons) and, for the others, what the store's index says of their runs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..batch.compare import Comparison, compare
from ..batch.report import BatchReport, build_report, open_batch_dir
from ..records.store import Store
from . import charts
from .queries import batch_runs, store_batches


@dataclass
class BatchView:
    batch_id: str
    report: BatchReport | None  # None: only the store's runs are known (no folder given)
    runs: list[dict[str, Any]]
    charts: dict[str, str | None]
    #: `batch rescore` results beside the summary: scorer, accuracy, interval, file.
    rescores: list[dict[str, Any]] = field(default_factory=list)
    #: What each task asked, by task id: `text` and `args` (JSON), as far as known.
    tasks: dict[str, dict[str, str]] = field(default_factory=dict)


def rescores(folder: Path) -> list[dict[str, Any]]:
    found = []
    for path in sorted(folder.glob("summary.rescore-*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being written, or not ours
        found.append(
            {
                key: data.get(key)
                for key in ("scorer", "accuracy", "accuracy_ci95", "scored", "rescored_at")
            }
            | {"file": path.name}
        )
    return found


def task_texts(
    folder: Path, rows: list[dict[str, Any]], runs: list[dict[str, Any]]
) -> dict[str, dict[str, str]]:
    """Each task's text and arguments, by id: from the batch's tasks file when it is still
    there, else the text its run recorded (the store's, masked). Read only; best effort."""
    from ..batch.sources import recorded_tasks

    found: dict[str, dict[str, str]] = {}
    by_run = {r["run_id"]: r.get("task") or "" for r in runs}
    for row in rows:
        if row.get("run_id") in by_run:
            found[row["id"]] = {"text": by_run[row["run_id"]], "args": ""}
    meta = open_batch_dir(folder).read_meta() or {}
    for task in recorded_tasks(meta, local_only=True):
        args = json.dumps(task.additional_args, sort_keys=True) if task.additional_args else ""
        found[task.id] = {"text": task.task, "args": args}
    return found


class Batches:
    """Batch folders by batch id; a folder is read again on every page (a batch may still be
    running, or be rescored meanwhile)."""

    def __init__(self, store: Store, folders: list[Path] | None = None) -> None:
        self.store = store
        self.folders: dict[str, Path] = {}
        for folder in folders or []:
            self.add(folder)

    def add(self, folder: Path) -> str:
        """Know the batch folder `folder`; ConfigError (exit 2) when it is not one."""
        out = open_batch_dir(folder)
        batch_id = str((out.read_meta() or {}).get("batch_id") or folder.name)
        self.folders[batch_id] = folder.resolve()
        return batch_id

    def listing(self) -> list[dict[str, Any]]:
        """Every batch, newest first: the store's, with the folder and accuracy when known."""
        seen = {entry["batch"]: entry for entry in store_batches(self.store)}
        for batch_id in self.folders:
            seen.setdefault(batch_id, {"batch": batch_id, "counts": {}, "first": 0, "last": 0})
        listing = []
        for batch_id, entry in seen.items():
            folder = self.folders.get(batch_id)
            report = build_report(folder) if folder else None
            listing.append({**entry, "folder": str(folder) if folder else None, "report": report})
        return sorted(listing, key=lambda e: e["last"], reverse=True)

    def get(self, batch_id: str) -> BatchView | None:
        folder = self.folders.get(batch_id)
        report = build_report(folder) if folder else None
        runs = batch_runs(self.store, batch_id)
        if report is None and not runs:
            return None
        if report is not None:  # by verdict: all succeeded is not all right
            rows = report.rows
            counts: dict[str, int] = {}
            for r in rows:
                counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
        else:
            rows = [
                {
                    "id": r["run_id"],
                    "input_tokens": r["input_tokens"] or 0,
                    "output_tokens": r["output_tokens"] or 0,
                    "duration": r["duration"],
                }
                for r in runs
            ]
            counts = {}
            for r in runs:
                counts[r["status"]] = counts.get(r["status"], 0) + 1
        durations = [float(r["duration"]) for r in rows if r.get("duration") is not None]
        return BatchView(
            batch_id=batch_id,
            report=report,
            runs=runs,
            charts={
                "duration": charts.duration_histogram(durations),
                "tokens": charts.tokens_per_task(rows),
                "status": charts.status_breakdown(
                    counts, "Tasks by verdict" if report is not None else "Tasks by status"
                ),
            },
            rescores=rescores(folder) if folder else [],
            tasks=task_texts(folder, report.rows, runs) if folder and report else {},
        )

    def label(self, batch_id: str) -> str:
        """How a person tells batches apart: the output folder's name and what it ran with
        (its id when no folder is known)."""
        folder = self.folders.get(batch_id)
        if folder is None:
            return batch_id
        report = build_report(folder)
        return f"{folder.name} ({report.model}, scorer {report.scorer})"

    def compare(self, a: str, b: str) -> Comparison | None:
        if a not in self.folders or b not in self.folders:
            return None
        return compare(build_report(self.folders[a]), build_report(self.folders[b]))
