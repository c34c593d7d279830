"""Run records: one directory per run (events, logs, result) and a row in an SQLite index."""

from __future__ import annotations

import json
import secrets as _random
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .config import home_dir

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id      TEXT PRIMARY KEY,
    created_at  REAL NOT NULL,
    ended_at    REAL,
    status      TEXT NOT NULL,
    payload     TEXT,
    model       TEXT,
    backend     TEXT,
    network     TEXT,
    task        TEXT,
    answer      TEXT,
    error       TEXT,
    exit_code   INTEGER,
    duration    REAL,
    input_tokens  INTEGER,
    output_tokens INTEGER,
    schedule    TEXT,
    batch       TEXT,
    owner       TEXT,
    record_dir  TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS runs_created ON runs(created_at);
CREATE INDEX IF NOT EXISTS runs_schedule ON runs(schedule, created_at);
"""

COLUMNS = (
    "run_id", "created_at", "ended_at", "status", "payload", "model", "backend", "network",
    "task", "answer", "error", "exit_code", "duration", "input_tokens", "output_tokens",
    "schedule", "batch", "owner", "record_dir",
)  # fmt: skip

_TEXT_LIMIT = 2000


def new_run_id() -> str:
    """Sortable, unique enough across processes: time plus 48 random bits."""
    return time.strftime("r-%Y%m%d-%H%M%S-", time.gmtime()) + _random.token_hex(6)


class Store:
    """The run store under the state directory; safe to share between threads and processes."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or home_dir()
        self.runs_dir = self.root / "runs"
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        self.db_path = self.root / "index.sqlite3"
        self._local = threading.local()
        with self.connect() as db:  # not executescript: it COMMITs the open transaction
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)

    @contextmanager
    def connect(self) -> Iterator[sqlite3.Connection]:
        """A per-thread connection; commits on success. WAL lets readers run beside writers."""
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.db_path, timeout=30, isolation_level=None)
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA busy_timeout=30000")
            self._local.db = db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        else:
            db.execute("COMMIT")

    def run_dir(self, run_id: str) -> Path:
        return self.runs_dir / run_id

    def create_run(self, run_id: str, **fields: Any) -> Path:
        directory = self.run_dir(run_id)
        directory.mkdir(parents=True, exist_ok=False)
        row = {"run_id": run_id, "created_at": time.time(), "status": "created"}
        row.update(fields)
        row["record_dir"] = str(directory)
        self._write(row, insert=True)
        return directory

    def update_run(self, run_id: str, **fields: Any) -> None:
        self._write({"run_id": run_id, **fields}, insert=False)

    def _write(self, row: dict[str, Any], *, insert: bool) -> None:
        unknown = set(row) - set(COLUMNS)
        if unknown:
            raise ValueError(f"unknown run columns: {sorted(unknown)}")
        clean = {k: _cell(v) for k, v in row.items()}
        with self.connect() as db:
            if insert:
                names = ", ".join(clean)
                marks = ", ".join("?" for _ in clean)
                db.execute(f"INSERT INTO runs ({names}) VALUES ({marks})", list(clean.values()))
            else:
                sets = ", ".join(f"{k} = ?" for k in clean if k != "run_id")
                values = [v for k, v in clean.items() if k != "run_id"]
                db.execute(f"UPDATE runs SET {sets} WHERE run_id = ?", [*values, row["run_id"]])

    def get_run(self, run_id: str) -> dict[str, Any] | None:
        with self.connect() as db:
            row = db.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            if row is None:  # allow unique prefixes, as git does
                rows = db.execute(
                    "SELECT * FROM runs WHERE run_id LIKE ? LIMIT 2", (run_id + "%",)
                ).fetchall()
                row = rows[0] if len(rows) == 1 else None
        return dict(row) if row else None

    def list_runs(
        self,
        *,
        limit: int = 20,
        status: str | None = None,
        schedule: str | None = None,
        batch: str | None = None,
    ) -> list[dict[str, Any]]:
        where, args = [], []
        for column, value in (("status", status), ("schedule", schedule), ("batch", batch)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        with self.connect() as db:
            rows = db.execute(
                f"SELECT * FROM runs {clause} ORDER BY created_at DESC LIMIT ?", [*args, limit]
            ).fetchall()
        return [dict(r) for r in rows]

    def claim_end(self, run_id: str, ended_at: float) -> bool:
        """Mark a run ended if nobody has yet; True for the one caller that did (two commands
        closing the same orphan at once write its record once)."""
        with self.connect() as db:
            cursor = db.execute(
                "UPDATE runs SET ended_at = ? WHERE run_id = ? AND ended_at IS NULL",
                (ended_at, run_id),
            )
        return cursor.rowcount == 1

    def unfinished_runs(self) -> list[dict[str, Any]]:
        with self.connect() as db:
            rows = db.execute(
                "SELECT * FROM runs WHERE ended_at IS NULL ORDER BY created_at"
            ).fetchall()
        return [dict(r) for r in rows]

    @staticmethod
    def read_result(record_dir: str | Path) -> dict[str, Any] | None:
        path = Path(record_dir) / "result.json"
        return json.loads(path.read_text()) if path.is_file() else None


def _cell(value: Any) -> Any:
    if value is None or isinstance(value, (int, float)):
        return value
    if not isinstance(value, str):
        value = json.dumps(value, default=str)
    return value if len(value) <= _TEXT_LIMIT else value[: _TEXT_LIMIT - 1] + "…"
