"""A batch folder's attempts read back for export (`export.py`, `inspect_log.py`): one row
per attempt from `results.jsonl`, with the task's text from its tasks file, each rescore's
scores and each attempt's recorded cost. Read only."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .epochs import key
from .output import BatchDir
from .report import error_text, open_batch_dir
from .rescore import rescore_path
from .sources import recorded_tasks
from .tasks import Task


@dataclass
class AttemptRow:
    """One scored attempt of a task as the batch recorded it (a `results.jsonl` line): the
    row both formats are made of. `epoch` is the line's own (1 for a batch without epochs);
    `scores` holds the batch's scorer first, then each `batch rescore`'s."""

    task_id: str
    epoch: int
    line: int | None
    status: str
    answer: Any
    expected: Any
    scores: dict[str, float | None]
    input_tokens: int
    output_tokens: int
    tokens_source: str | None
    cost_usd: float | None
    duration: float | None
    ended_at: float | None
    run_id: str | None
    error: str
    attempts: int | None
    steps: int | None
    session: int | None
    record_dir: str | None


@dataclass
class BatchExport:
    """A batch folder read for export: its books (`batch.json`, `summary.json`), its tasks
    (when the tasks file is still there) and its attempts in the tasks file's order."""

    path: Path
    meta: dict[str, Any]
    summary: dict[str, Any]
    scorers: list[str]
    attempts: list[AttemptRow]
    tasks: dict[str, Task] = field(default_factory=dict)

    @property
    def batch_id(self) -> str:
        return str(self.meta.get("batch_id") or self.summary.get("batch_id") or self.path.name)

    @property
    def payload(self) -> str:
        folder = (self.meta.get("options") or {}).get("payload") or ""
        return str(self.summary.get("payload") or Path(folder).name or "batch")

    @property
    def model(self) -> str:
        return str(self.summary.get("model") or (self.meta.get("options") or {}).get("model"))


def load_export(path: str | Path) -> BatchExport:
    """The batch folder at `path` read for export. ConfigError (exit 2): not a batch folder."""
    out = open_batch_dir(path)
    meta = out.read_meta() or {}
    summary_path = out.path / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    scorer = str((meta.get("options") or {}).get("scorer") or summary.get("scorer") or "exact")
    extra = rescored(out.path, skip=scorer)
    costs = attempt_costs(out)
    tasks = {t.id: t for t in recorded_tasks(meta)}
    attempts = []
    for raw in result_lines(out):
        task_id, epoch = key(raw)
        scores = {scorer: raw.get("score")}
        scores.update({name: by_task.get((task_id, epoch)) for name, by_task in extra.items()})
        tokens = raw.get("tokens") or {}
        attempts.append(
            AttemptRow(
                task_id=task_id,
                epoch=epoch,
                line=raw.get("line"),
                status=str(raw.get("status")),
                answer=raw.get("answer"),
                expected=raw.get("expected"),
                scores=scores,
                input_tokens=int(tokens.get("input") or 0),
                output_tokens=int(tokens.get("output") or 0),
                tokens_source=tokens.get("source"),
                cost_usd=costs.get(str(raw.get("run_id"))),
                duration=raw.get("duration"),
                ended_at=raw.get("ended_at"),
                run_id=raw.get("run_id"),
                error=error_text(raw.get("error")) or str(raw.get("score_error") or ""),
                attempts=raw.get("attempts"),
                steps=raw.get("steps"),
                session=raw.get("session"),
                record_dir=raw.get("record_dir"),
            )
        )
    order = {t: i for i, t in enumerate(tasks)}
    attempts.sort(key=lambda a: (order.get(a.task_id, len(order)), a.line or 0, a.epoch))
    return BatchExport(out.path, meta, summary, [scorer, *extra], attempts, tasks)


def result_lines(out: BatchDir) -> Iterator[dict[str, Any]]:
    """`results.jsonl`'s lines, read only (a torn last line is skipped, not repaired)."""
    if not out.results_path.is_file():
        return
    for line in out.results_path.read_text(encoding="utf-8").splitlines():
        try:
            raw = json.loads(line)
        except ValueError:
            continue
        if isinstance(raw, dict) and "id" in raw:
            yield raw


def attempt_costs(out: BatchDir) -> dict[str, float]:
    """Each ended attempt's cost in US dollars by run id (recorded with --max-cost only)."""
    return {
        str(entry.get("run_id")): float(entry["cost_usd"])
        for entry in out.load_attempts()
        if entry.get("event") == "end" and entry.get("cost_usd") is not None
    }


def rescored(folder: Path, *, skip: str) -> dict[str, dict[tuple[str, int], float | None]]:
    """The scores of each `batch rescore` of the folder, by scorer, then by (task, epoch)."""
    found: dict[str, dict[tuple[str, int], float | None]] = {}
    for path in sorted(folder.glob("summary.rescore-*.json")):
        try:
            document = json.loads(path.read_text())
            name = str(document["scorer"])
            rows = document.get("rows") or []
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if name == skip or rescore_path(folder, name).name != path.name:
            continue
        found[name] = {key(r): r.get("score") for r in rows}
    return found


def as_text(value: Any) -> str | None:
    """An answer or expected answer as text: itself when text, else its JSON."""
    if value is None:
        return None
    return value if isinstance(value, str) else json.dumps(value, default=str)


def timestamp(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, timezone.utc)
