"""What the pages ask of the store's index, read-only: a filtered page of runs, the values
the filters offer, the batches and schedules the store has seen."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ..errors import ConfigError
from ..records.store import Store

PAGE_SIZE = 50
#: The runs list's columns (the index's long text columns are left out of a list).
LIST_COLUMNS = (
    "run_id, created_at, ended_at, status, payload, model, network, duration, input_tokens, "
    "output_tokens, schedule, batch, exit_code, error"
)


@dataclass
class RunFilter:
    """The runs list's filters, as the query string gives them (empty means any)."""

    status: str = ""
    payload: str = ""
    batch: str = ""
    schedule: str = ""
    since: str = ""  # YYYY-MM-DD, UTC, inclusive
    until: str = ""  # YYYY-MM-DD, UTC, inclusive
    q: str = ""  # a piece of the run id
    page: int = 1

    @classmethod
    def from_query(cls, query: dict[str, str]) -> RunFilter:
        try:
            page = max(1, int(query.get("page") or 1))
        except ValueError:
            page = 1
        names = ("status", "payload", "batch", "schedule", "since", "until", "q")
        return cls(page=page, **{n: (query.get(n) or "").strip()[:200] for n in names})

    def params(self, **change: Any) -> dict[str, str]:
        """The query string of this filter with some fields changed (for links)."""
        values = {**self.__dict__, **change}
        return {k: str(v) for k, v in values.items() if v and not (k == "page" and v == 1)}


@dataclass
class RunPage:
    rows: list[dict[str, Any]]
    total: int
    page: int
    pages: int
    facets: dict[str, list[str]] = field(default_factory=dict)


def _day(text: str, *, end: bool) -> float:
    try:
        day = datetime.strptime(text, "%Y-%m-%d").replace(tzinfo=timezone.utc)
    except ValueError:
        raise ConfigError(f"Not a date: {text!r}.", "Write dates as YYYY-MM-DD.") from None
    return day.timestamp() + (86400 if end else 0)


def list_runs(store: Store, flt: RunFilter) -> RunPage:
    """One page of runs, newest first, and how many match in all (no check runs:
    `validate`'s and batch preflights' loads, store.KINDS)."""
    where, args = ["kind = 'run'"], []
    for column in ("status", "payload", "batch", "schedule"):
        value = getattr(flt, column)
        if value:
            where.append(f"{column} = ?")
            args.append(value)
    if flt.q:
        where.append("run_id LIKE ? ESCAPE '\\'")
        escaped = flt.q.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        args.append(f"%{escaped}%")
    if flt.since:
        where.append("created_at >= ?")
        args.append(_day(flt.since, end=False))
    if flt.until:
        where.append("created_at < ?")
        args.append(_day(flt.until, end=True))
    clause = f"WHERE {' AND '.join(where)}" if where else ""
    with store.connect(write=False) as db:
        total = db.execute(f"SELECT COUNT(*) FROM runs {clause}", args).fetchone()[0]
        pages = max(1, -(-total // PAGE_SIZE))
        page = min(flt.page, pages)
        rows = db.execute(
            f"SELECT {LIST_COLUMNS} FROM runs {clause} ORDER BY created_at DESC LIMIT ? OFFSET ?",
            [*args, PAGE_SIZE, (page - 1) * PAGE_SIZE],
        ).fetchall()
        facets = {
            column: [
                r[0]
                for r in db.execute(
                    f"SELECT DISTINCT {column} FROM runs "
                    f"WHERE {column} IS NOT NULL AND kind = 'run' ORDER BY {column} LIMIT 200"
                )
            ]
            for column in ("status", "payload", "batch", "schedule")
        }
    return RunPage([dict(r) for r in rows], total, page, pages, facets)


def store_batches(store: Store) -> list[dict[str, Any]]:
    """Every batch id the index has runs for: counts by status, first and last run."""
    with store.connect(write=False) as db:
        rows = db.execute(
            "SELECT batch, status, COUNT(*) AS n, MIN(created_at) AS first, "
            "MAX(created_at) AS last FROM runs WHERE batch IS NOT NULL GROUP BY batch, status"
        ).fetchall()
    batches: dict[str, dict[str, Any]] = {}
    for row in rows:
        entry = batches.setdefault(
            row["batch"], {"batch": row["batch"], "counts": {}, "first": row["first"], "last": 0}
        )
        entry["counts"][row["status"]] = row["n"]
        entry["first"] = min(entry["first"], row["first"])
        entry["last"] = max(entry["last"], row["last"])
    return sorted(batches.values(), key=lambda b: b["last"], reverse=True)


def batch_runs(store: Store, batch_id: str) -> list[dict[str, Any]]:
    with store.connect(write=False) as db:
        rows = db.execute(
            f"SELECT {LIST_COLUMNS}, answer, task FROM runs WHERE batch = ? ORDER BY created_at",
            (batch_id,),
        ).fetchall()
    return [dict(r) for r in rows]


def schedule_firings(store: Store, limit: int = 500) -> list[dict[str, Any]]:
    """The newest firings of every schedule (none when no schedule ever fired here)."""
    try:
        with store.connect(write=False) as db:
            rows = db.execute(
                "SELECT f.*, r.status AS run_status, r.duration AS run_duration "
                "FROM schedule_firings f LEFT JOIN runs r ON r.run_id = f.run_id "
                "ORDER BY f.fired_at DESC, f.id DESC LIMIT ?",
                (limit,),
            ).fetchall()
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return []
        raise
    return [dict(r) for r in rows]
