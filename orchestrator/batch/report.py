"""A finished (or stopped) batch read back from its folder: the figures, and which tasks went
wrong, without running anything. Used by `batch report`, `batch rescore` and the viewer."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..spec import RunError
from .epochs import epoch_metrics, epochs_of, per_task
from .figures import Figures, batch_figures
from .output import BatchDir
from .scoring import scorer_names

#: The order of a report: what needs a look first (then by line of the tasks file).
RANK = {"failed": 0, "wrong": 1, "partial": 2, "unscored": 3, "correct": 4}

CSV_FIELDS = (
    "id",
    "line",
    "verdict",
    "status",
    "score",
    "answer",
    "expected",
    "error",
    "duration",
    "input_tokens",
    "output_tokens",
    "steps",
    "attempts",
    "run_id",
    "record_dir",
)


def verdict(row: dict[str, Any]) -> str:
    """One word for a task: `failed` (no answer of the agent's: failed, timed out, out of
    memory, infra error), `wrong`, `partial` (a score between 0 and 1), `correct`, or
    `unscored` (no expected answer, or the scorer failed)."""
    if row.get("status") != "succeeded":
        return "failed"
    score = row.get("score")
    if score is None:
        return "unscored"
    if score >= 1:
        return "correct"
    return "wrong" if score <= 0 else "partial"


def error_text(error: Any) -> str:
    """A result's error as one line: its message, else its type."""
    if not error:
        return ""
    if isinstance(error, dict):
        error = RunError.from_dict(error)
    if isinstance(error, RunError):
        message, kind = error.message or error.type, error.type
        return f"{kind}: {message}" if kind and message and kind != message else message
    return str(error)


@dataclass(kw_only=True)
class BatchReport(Figures):
    """What a person asks of a batch: how good (accuracy and its 95 % Wilson interval), how it
    ended (counts by status), and which tasks to look at (`rows`, wrong and failed first)."""

    path: str
    batch_id: str
    scorer: str
    payload: str
    model: str
    total: int
    tokens: dict[str, int]
    rows: list[dict[str, Any]] = field(default_factory=list)
    #: Set by a rescore: the scorer the batch originally ran with.
    rescored_from: str | None = None
    #: Times each task ran (its rows: one per epoch), each reducer's figure
    #: (`epochs.epoch_metrics`) and each task's epochs reduced (`epochs.per_task`).
    epochs: int = 1
    epoch_metrics: dict[str, Any] = field(default_factory=dict)
    tasks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def to_review(self) -> list[dict[str, Any]]:
        """The wrong, partly right and failed tasks, in report order."""
        return [r for r in self.rows if r["verdict"] in ("failed", "wrong", "partial")]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_csv(self) -> str:
        out = io.StringIO()
        fields = CSV_FIELDS if self.epochs == 1 else (*CSV_FIELDS[:1], "epoch", *CSV_FIELDS[1:])
        writer = csv.DictWriter(out, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for row in self.rows:
            writer.writerow(
                {**row, "answer": _cell(row.get("answer")), "expected": _cell(row.get("expected"))}
            )
        return out.getvalue()


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def open_batch_dir(path: str | Path) -> BatchDir:
    """The batch folder at `path`, or a ConfigError (exit 2) saying what is missing."""
    folder = Path(path)
    out = BatchDir(folder)
    if not out.results_path.is_file() and not (folder / "batch.json").is_file():
        raise ConfigError(
            f"{folder} is not a batch output folder (no batch.json or results.jsonl in it).",
            "Give the folder passed to `orchestrator batch ... --output DIR`.",
        )
    return out


def task_rows(out: BatchDir) -> list[dict[str, Any]]:
    """results.jsonl as report rows: flat fields, a verdict, the error as text. Read only:
    the file is never rewritten here (a torn last line is skipped, not repaired)."""
    rows: list[dict[str, Any]] = []
    if not out.results_path.is_file():  # a batch whose first task has not ended yet
        return rows
    for line in out.results_path.read_text(encoding="utf-8").splitlines():
        try:
            raw = json.loads(line)
            task_id = str(raw["id"])
        except (ValueError, KeyError, TypeError):
            continue
        tokens = raw.get("tokens") or {}
        row = {
            "id": task_id,
            **({"epoch": raw["epoch"]} if "epoch" in raw else {}),
            "line": raw.get("line"),
            "status": raw.get("status"),
            "score": raw.get("score"),
            "answer": raw.get("answer"),
            "expected": raw.get("expected"),
            "error": error_text(raw.get("error")) or raw.get("score_error") or "",
            "duration": raw.get("duration"),
            "input_tokens": int(tokens.get("input") or 0),
            "output_tokens": int(tokens.get("output") or 0),
            "steps": raw.get("steps"),
            "attempts": raw.get("attempts"),
            "run_id": raw.get("run_id"),
            "record_dir": raw.get("record_dir"),
        }
        for several in ("scores", "grade"):  # several scorers; a judge's grade (`grading.py`)
            if raw.get(several) is not None:
                row[several] = raw[several]
        row["verdict"] = verdict(row)
        rows.append(row)
    return rows


def build_report(path: str | Path, rows: list[dict[str, Any]] | None = None) -> BatchReport:
    """The report of the batch folder at `path` (its own scores unless `rows` are given)."""
    out = open_batch_dir(path)
    meta = out.read_meta() or {}
    summary_path = out.path / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    if rows is None:
        rows = task_rows(out)
    rows = sorted(
        rows, key=lambda r: (RANK[r["verdict"]], r.get("line") or 0, r["id"], r.get("epoch") or 1)
    )
    options = meta.get("options") or {}
    epochs = epochs_of(options)
    return BatchReport(
        path=str(out.path),
        batch_id=str(meta.get("batch_id") or summary.get("batch_id") or out.path.name),
        scorer=str(scorer_names(options.get("scorer") or summary.get("scorer") or "exact")[0]),
        payload=str(summary.get("payload") or ""),
        model=str(summary.get("model") or ""),
        total=int(summary.get("total") or len(rows)),
        **batch_figures(rows).fields(),
        tokens={
            "input": sum(r["input_tokens"] for r in rows),
            "output": sum(r["output_tokens"] for r in rows),
        },
        rows=rows,
        epochs=epochs,
        epoch_metrics=epoch_metrics(rows, epochs),
        tasks=per_task(rows) if epochs > 1 else [],
    )
