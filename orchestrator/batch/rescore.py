"""Re-scoring a batch's recorded answers with another scorer, running nothing: the new scores
and summary go to a file of their own beside `summary.json`; `results.jsonl` (the record of
what ran, and the source of truth for resume) is never touched."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .grading import Scoring
from .judge import JudgeOptions, JudgeReply
from .output import atomic_write, safe_name
from .report import BatchReport, build_report, open_batch_dir, task_rows, verdict
from .scoring import MODEL_SCORER
from .sources import recorded_tasks


def rescore_path(batch_dir: str | Path, scorer: str) -> Path:
    """Where the rescore of `batch_dir` with `scorer` is written (one file per scorer)."""
    module, _, function = scorer.rpartition(":")
    name = f"{Path(module).stem}-{function}" if module else scorer
    name = safe_name(name)
    return Path(batch_dir) / f"summary.rescore-{name}.json"


def rescore(
    batch_dir: str | Path,
    scorer: str,
    *,
    tolerance: float = 1e-6,
    judge: JudgeOptions | None = None,
) -> BatchReport:
    """Score every recorded answer again with `scorer` (the batch's rules: no expected answer
    or an infrastructure error is unscored, an agent that did not answer scores 0) and write
    the report to `rescore_path`. `judge`: the `model` scorer's, whose grades come from the
    batch's grade cache when the same answer, expected answer, template and judge were graded
    before (new calls are added to it). Raises ConfigError (exit 2) for an unknown scorer or a
    folder that is not a batch."""
    out = open_batch_dir(batch_dir)
    calls: list[JudgeReply] = []
    scoring = Scoring(
        [scorer],
        tolerance=tolerance,
        judge=judge if scorer == MODEL_SCORER else None,
        folder=out.path,
        on_call=lambda reply: calls.append(reply),
        by="rescore",
    )
    tasks = {t.id: t.row() for t in recorded_tasks(out.read_meta() or {})}
    rows = task_rows(out)
    for row in rows:
        row.pop("score_error", None)
        task = tasks.get(row["id"]) or {"id": row["id"], "expected": row["expected"]}
        task = {**task, "expected": row["expected"]}  # graded against what was recorded
        scored = scoring.score(task, str(row["status"]), row["answer"])
        row["score"] = scored.score
        if scored.error:
            failed = "" if scorer == MODEL_SCORER else "the scorer failed: "
            row["error"] = failed + scored.error
        if scored.grade is not None:
            row["grade"] = scored.grade
        row["verdict"] = verdict(row)
    report = build_report(out.path, rows)
    report.rescored_from, report.scorer = report.scorer, scorer
    document = {
        "rescored_at": time.time(),
        "scorer": scorer,
        "tolerance": tolerance if scorer == "numeric" else None,
        **report.to_dict(),
    }
    if scoring.judge is not None:
        graded = [r for r in rows if r.get("grade")]
        document["judge"] = {
            "judge": scoring.judge.describe,
            "calls": len(calls),
            "cached": sum(bool(r["grade"].get("cached")) for r in graded),
            "tokens": sum(c.input_tokens + c.output_tokens for c in calls),
        }
    atomic_write(rescore_path(out.path, scorer), json.dumps(document, indent=2, default=str) + "\n")
    return report
