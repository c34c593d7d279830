"""Re-scoring a batch's recorded answers with another scorer, running nothing: the new scores
and summary go to a file of their own beside `summary.json`; `results.jsonl` (the record of
what ran, and the source of truth for resume) is never touched."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from .output import FINISHED, atomic_write, safe_name
from .report import BatchReport, build_report, open_batch_dir, task_rows, verdict
from .scoring import make_scorer
from .sources import read_tasks
from .tasks import TaskFileError


def rescore_path(batch_dir: str | Path, scorer: str) -> Path:
    """Where the rescore of `batch_dir` with `scorer` is written (one file per scorer)."""
    module, _, function = scorer.rpartition(":")
    name = f"{Path(module).stem}-{function}" if module else scorer
    name = safe_name(name)
    return Path(batch_dir) / f"summary.rescore-{name}.json"


def _task_views(meta: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What a user scorer saw of each task during the batch, when the tasks file is still
    there; otherwise scorers get the id and expected answer only."""
    path = meta.get("tasks_file")
    if not path:
        return {}
    try:
        fields = (meta.get("options") or {}).get("fields")  # the mapping it was read with
        return {t.id: t.row() for t in read_tasks(path, fields=fields, on_bad_line="skip").tasks}
    except TaskFileError:
        return {}


def rescore(batch_dir: str | Path, scorer: str, *, tolerance: float = 1e-6) -> BatchReport:
    """Score every recorded answer again with `scorer` (the batch's rules: no expected answer
    or an infrastructure error is unscored, an agent that did not answer scores 0) and write
    the report to `rescore_path`. Raises ConfigError (exit 2) for an unknown scorer or a
    folder that is not a batch."""
    out = open_batch_dir(batch_dir)
    score = make_scorer(scorer, tolerance=tolerance)
    tasks = _task_views(out.read_meta() or {})
    rows = task_rows(out)
    for row in rows:
        row.pop("score_error", None)
        if row["expected"] is None or row["status"] not in FINISHED:
            row["score"] = None
        elif row["status"] != "succeeded":
            row["score"] = 0.0
        else:
            task = tasks.get(row["id"]) or {"id": row["id"], "expected": row["expected"]}
            try:
                row["score"] = score(row["answer"], row["expected"], task)
            except Exception as exc:  # one bad answer must not sink the others
                row["score"] = None
                row["error"] = f"the scorer failed: {type(exc).__name__}: {exc}"
        row["verdict"] = verdict(row)
    report = build_report(out.path, rows)
    report.rescored_from, report.scorer = report.scorer, scorer
    document = {
        "rescored_at": time.time(),
        "scorer": scorer,
        "tolerance": tolerance if scorer == "numeric" else None,
        **report.to_dict(),
    }
    atomic_write(rescore_path(out.path, scorer), json.dumps(document, indent=2, default=str) + "\n")
    return report
