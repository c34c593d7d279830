"""A batch folder written in formats other tools read: Inspect AI's eval log (`inspect view`
opens it; `inspect_ai.log.read_eval_log` loads it) and a plain Parquet table, one row per
attempt (pandas, polars, DuckDB). Nothing runs and the folder's own files are only read.

The eval log is built from Inspect AI's own types and written with its own writer: the
format is theirs and versioned (`EvalLog.version`), so a log typed here by hand would drift
from what their viewer reads. Both libraries are the optional `export` extra, imported only
here and only when an export is asked for.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import ConfigError
from ..paths import VERSION
from .attempt_rows import BatchExport, as_text, load_export, timestamp

FORMATS = ("inspect", "parquet")

#: What a missing library says to do.
INSTALL_FIX = "Install the export extra: pip install 'orchestrator[export]'."


def need(module: str, purpose: str) -> ModuleType:
    """Import `module` (a library of the `export` extra), or a ConfigError (exit 2) naming
    the extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"{purpose} needs the `{module.split('.')[0]}` package, which is not installed "
            f"here ({exc}).",
            INSTALL_FIX,
        ) from exc


# -- Parquet ---------------------------------------------------------------------------------


def score_column(scorer: str, first: bool) -> str:
    """`score` for the batch's own scorer, `score_<name>` for a rescore's."""
    return "score" if first else "score_" + re.sub(r"[^A-Za-z0-9_]+", "_", scorer).strip("_")


def write_parquet(export: BatchExport, path: Path) -> Path:
    """`path` (a Parquet file): one row per attempt, typed columns (a missing value is null).
    Written to a temporary file first, so `path` is the old table or the new one."""
    pa = need("pyarrow", "--format parquet")
    parquet = need("pyarrow.parquet", "--format parquet")
    columns: list[tuple[str, Any]] = [
        ("task_id", pa.string()),
        ("epoch", pa.int64()),
        ("line", pa.int64()),
        ("status", pa.string()),
        ("answer", pa.string()),
        ("expected", pa.string()),
        ("scorer", pa.string()),
        *((score_column(s, i == 0), pa.float64()) for i, s in enumerate(export.scorers)),
        ("input_tokens", pa.int64()),
        ("output_tokens", pa.int64()),
        ("tokens_source", pa.string()),
        ("cost_usd", pa.float64()),
        ("duration", pa.float64()),
        ("ended_at", pa.timestamp("ms", tz="UTC")),
        ("run_id", pa.string()),
        ("error", pa.string()),
        ("attempts", pa.int64()),
        ("steps", pa.int64()),
        ("session", pa.int64()),
        ("record_dir", pa.string()),
        ("batch_id", pa.string()),
    ]
    rows = []
    for a in export.attempts:
        row = {**vars(a), "answer": as_text(a.answer), "expected": as_text(a.expected)}
        row.update(scorer=export.scorers[0], batch_id=export.batch_id, error=a.error or None)
        row["ended_at"] = timestamp(a.ended_at)
        for i, scorer in enumerate(export.scorers):
            row[score_column(scorer, i == 0)] = a.scores.get(scorer)
        rows.append(row)
    schema = pa.schema(columns, metadata={"orchestrator": VERSION, "batch_id": export.batch_id})
    table = pa.Table.from_pylist(rows, schema=schema)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    parquet.write_table(table, tmp)
    os.replace(tmp, path)
    return path


# -- Inspect AI ------------------------------------------------------------------------------


def write_inspect(export: BatchExport, path: Path | None) -> Path:
    """`path` (`.eval`, or `.json`; default `inspect_log.log_path`): the batch as an
    Inspect AI eval log, written by Inspect's own writer."""
    need("inspect_ai", "--format inspect")
    from . import inspect_log  # Inspect AI's types: imported only here (it takes seconds)

    log_module = need("inspect_ai.log", "--format inspect")
    path = path or inspect_log.log_path(export)
    path.parent.mkdir(parents=True, exist_ok=True)
    log_module.write_eval_log(inspect_log.eval_log(export), str(path))
    return path


def export_batch(folder: str | Path, fmt: str, output: str | Path | None = None) -> Path:
    """Write the batch folder `folder` as `fmt` (`inspect` or `parquet`) to `output`, else
    to its default place in the folder; returns where. ConfigError (exit 2): not a batch
    folder, an unknown format, or the `export` extra missing."""
    if fmt not in FORMATS:
        raise ConfigError(f"Unknown export format {fmt!r}.", f"Use one of: {', '.join(FORMATS)}.")
    export = load_export(folder)
    if fmt == "parquet":
        return write_parquet(export, Path(output) if output else export.path / "results.parquet")
    return write_inspect(export, Path(output) if output else None)
