"""Schedule history: every firing, skip and miss, in the run store's SQLite file."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from filelock import FileLock

from ..records.store import Store
from ..spec import EXIT_CODES, RunResult

SCHEMA = """
CREATE TABLE IF NOT EXISTS schedule_firings (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    schedule      TEXT NOT NULL,
    scheduled_for REAL,             -- the cron instant (UTC epoch), NULL for on-demand runs
    fired_at      REAL NOT NULL,
    trigger       TEXT NOT NULL,    -- serve | cron | catch-up | manual
    outcome       TEXT NOT NULL,    -- running | <run status> | skipped | missed | error | lost
    reason        TEXT,
    run_id        TEXT,
    exit_code     INTEGER,
    ended_at      REAL,
    owner         TEXT,             -- host:pid:start of the process that fired
    cancel_requested INTEGER NOT NULL DEFAULT 0
);
CREATE UNIQUE INDEX IF NOT EXISTS schedule_firings_once
    ON schedule_firings(schedule, scheduled_for) WHERE scheduled_for IS NOT NULL;
CREATE INDEX IF NOT EXISTS schedule_firings_by_name ON schedule_firings(schedule, fired_at);
CREATE TABLE IF NOT EXISTS schedule_notifications (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    firing_id INTEGER NOT NULL,
    schedule  TEXT NOT NULL,
    run_id    TEXT,
    outcome   TEXT,
    kind      TEXT NOT NULL,        -- command | webhook
    target    TEXT NOT NULL,
    at        REAL NOT NULL,
    ok        INTEGER NOT NULL,
    detail    TEXT
);
"""


@dataclass
class Firing:
    """What one firing did; `exit_code` is what `schedule run` exits with."""

    id: int | None
    schedule: str
    outcome: str
    trigger: str
    scheduled_for: datetime | None = None
    fired_at: datetime | None = None
    run_id: str | None = None
    exit_code: int = 0
    reason: str | None = None
    duration: float | None = None
    result: RunResult | None = None


def _epoch(instant: datetime | None) -> float | None:
    return None if instant is None else instant.timestamp()


class ScheduleStore:
    """The schedule tables, in the run store's SQLite file (one history for all processes)."""

    def __init__(self, store: Store | None = None) -> None:
        self.store = store or Store()
        self.locks_dir = self.store.root / "schedules" / "locks"
        self.locks_dir.mkdir(parents=True, exist_ok=True)
        with self.store.connect() as db:  # not executescript: it COMMITs the transaction
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)

    def lock(self, name: str) -> FileLock:
        """The per-schedule lock; flock-based, so a dead holder never keeps it."""
        return FileLock(str(self.locks_dir / f"{name}.lock"))

    def claim(
        self,
        name: str,
        scheduled_for: datetime | None,
        fired_at: datetime,
        trigger: str,
        owner: str,
        outcome: str = "running",
        reason: str | None = None,
        run_id: str | None = None,
    ) -> int | None:
        """Insert a firing row; None when this fire time was already handled elsewhere."""
        with self.store.connect() as db:
            cursor = db.execute(
                "INSERT OR IGNORE INTO schedule_firings (schedule, scheduled_for, fired_at, "
                "trigger, outcome, reason, owner, run_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    name,
                    _epoch(scheduled_for),
                    _epoch(fired_at),
                    trigger,
                    outcome,
                    reason,
                    owner,
                    run_id,
                ),
            )
            return cursor.lastrowid if cursor.rowcount == 1 else None

    def update(self, firing_id: int, **fields: Any) -> None:
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self.store.connect() as db:
            db.execute(
                f"UPDATE schedule_firings SET {sets} WHERE id = ?", [*fields.values(), firing_id]
            )

    def running(self, name: str) -> list[dict[str, Any]]:
        with self.store.connect() as db:
            rows = db.execute(
                "SELECT * FROM schedule_firings WHERE schedule = ? AND outcome = 'running' "
                "ORDER BY fired_at",
                (name,),
            ).fetchall()
        return [dict(r) for r in rows]

    def reap_lost(self, name: str, keep: int) -> None:
        """Close `running` rows whose process died (kill -9, power loss) as `lost`."""
        from ..labels import owner_alive

        for row in self.running(name):
            if row["id"] != keep and not owner_alive(row["owner"] or ""):
                self.update(
                    row["id"],
                    outcome="lost",
                    ended_at=time.time(),
                    exit_code=EXIT_CODES["infra_error"],
                    reason="the firing process died during the run",
                )

    def request_cancel(self, name: str, requester: int) -> None:
        """Flag every other running firing of `name` for cancellation (`replace`)."""
        with self.store.connect() as db:
            db.execute(
                "UPDATE schedule_firings SET cancel_requested = 1 "
                "WHERE schedule = ? AND outcome = 'running' AND id != ?",
                (name, requester),
            )

    def cancel_requested(self, firing_id: int) -> bool:
        with self.store.connect() as db:
            row = db.execute(
                "SELECT cancel_requested FROM schedule_firings WHERE id = ?", (firing_id,)
            ).fetchone()
        return bool(row and row[0])

    def last_scheduled_for(self, name: str) -> datetime | None:
        """The latest fire time handled (fired, skipped or recorded missed) by anyone."""
        with self.store.connect() as db:
            row = db.execute(
                "SELECT MAX(scheduled_for) FROM schedule_firings WHERE schedule = ?", (name,)
            ).fetchone()
        return None if row[0] is None else datetime.fromtimestamp(row[0], timezone.utc)

    def history(self, name: str | None = None, limit: int = 20) -> list[dict[str, Any]]:
        where, args = ("WHERE schedule = ?", [name]) if name else ("", [])
        with self.store.connect() as db:
            rows = db.execute(
                f"SELECT * FROM schedule_firings {where} ORDER BY fired_at DESC, id DESC LIMIT ?",
                [*args, limit],
            ).fetchall()
        return [dict(r) for r in rows]

    def last_firing(self, name: str) -> dict[str, Any] | None:
        rows = self.history(name, limit=1)
        return rows[0] if rows else None

    def record_notification(
        self, firing: Firing, kind: str, target: str, ok: bool, detail: str
    ) -> None:
        with self.store.connect() as db:
            db.execute(
                "INSERT INTO schedule_notifications (firing_id, schedule, run_id, outcome, kind, "
                "target, at, ok, detail) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    firing.id or 0,
                    firing.schedule,
                    firing.run_id,
                    firing.outcome,
                    kind,
                    target,
                    time.time(),
                    int(ok),
                    detail[:2000],
                ),
            )

    def notifications(self, name: str, limit: int = 20) -> list[dict[str, Any]]:
        with self.store.connect() as db:
            rows = db.execute(
                "SELECT * FROM schedule_notifications WHERE schedule = ? ORDER BY id DESC LIMIT ?",
                (name, limit),
            ).fetchall()
        return [dict(r) for r in rows]
