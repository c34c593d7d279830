"""Run records: one directory per run (events, logs, result) and a row in an SQLite index.

The index is one SQLite file shared by every thread and process of the state directory
(runs, batches, `schedule serve`, `runs` listings). The rules that keep it whole:

- WAL mode, set once per file when a `Store` opens it (switching modes does not wait on
  busy_timeout, so it is retried while another process holds the file); the schema likewise.
- One connection per thread, never shared; writes take the write lock up front
  (BEGIN IMMEDIATE), reads do not (WAL readers never block writers nor wait for them).
- Never a connection carried across fork: SQLite keeps its POSIX lock state per process, so a
  child using (or closing) its parent's connection writes without the locks it believes it
  holds, and the parent's last close can checkpoint and delete the write-ahead log under it
  (committed rows lost, "database disk image is malformed"). Idle connections are closed
  before a fork; a child never touches what it inherited and opens its own.
"""

from __future__ import annotations

import json
import os
import random
import secrets as _random
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import OrchestratorError
from ..paths import home_dir

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
    record_dir  TEXT NOT NULL,
    kind        TEXT NOT NULL DEFAULT 'run'
);
CREATE INDEX IF NOT EXISTS runs_created ON runs(created_at);
CREATE INDEX IF NOT EXISTS runs_schedule ON runs(schedule, created_at);
"""

COLUMNS = (
    "run_id",
    "created_at",
    "ended_at",
    "status",
    "payload",
    "model",
    "backend",
    "network",
    "task",
    "answer",
    "error",
    "exit_code",
    "duration",
    "input_tokens",
    "output_tokens",
    "schedule",
    "batch",
    "owner",
    "record_dir",
    "kind",
)
#: A run's `kind`: `run` (a task run) or `check` (`validate`'s or a batch preflight's load of
#: a payload's agent tree: no step runs). Checks are recorded (their sandbox is a real one,
#: which `cleanup` must be able to close, and their logs explain a refusal) but kept out of
#: listings unless asked for, so that they never pass for real successes.
KINDS = ("run", "check")

#: The name of the newest run (checks aside), wherever a run id is accepted.
LATEST = "@latest"

_TEXT_LIMIT = 2000
#: Seconds a statement waits for another connection's lock before "database is locked".
BUSY_TIMEOUT = 30.0
#: Seconds a fork waits for other threads' transactions to end, so that it can close their
#: connections first (transactions take milliseconds; the wait is bounded all the same).
FORK_WAIT = 5.0

#: Every open store, for the fork hooks below.
_STORES: weakref.WeakSet[Store] = weakref.WeakSet()
#: Connections a forked child inherited: kept referenced so that they are never closed (or
#: rolled back) from the child, which would act on its parent's locks and shared WAL index.
_INHERITED: list[sqlite3.Connection] = []


class StoreError(OrchestratorError, sqlite3.OperationalError):
    """The run store cannot be opened (disk full, read-only, no permission). Also an
    `sqlite3.OperationalError`, so code handling SQLite errors handles this one too."""

    exit_code = 5

    def __str__(self) -> str:
        return self.cause


#: SQLite's primary result codes that mean "the disk or its permissions", not "busy".
_UNWRITABLE = {3: "PERM", 8: "READONLY", 10: "IOERR", 13: "FULL", 14: "CANTOPEN"}
_UNWRITABLE_TEXT = ("disk I/O error", "disk is full", "unable to open", "readonly database")


@dataclass
class _Connection:
    db: sqlite3.Connection
    pid: int
    busy: int = 0  # inside `connect()` now; only idle connections are ever closed


def new_run_id() -> str:
    """Sortable, unique enough across processes: time plus 48 random bits."""
    return time.strftime("r-%Y%m%d-%H%M%S-", time.gmtime()) + _random.token_hex(6)


class Store:
    """The run store under the state directory; safe to share between threads and processes
    (and across fork: a child opens its own connections)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or home_dir()
        self.runs_dir = self.root / "runs"
        self.db_path = self.root / "index.sqlite3"
        try:
            self.runs_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _unavailable(self.runs_dir, exc.strerror or str(exc)) from exc
        self._guard = threading.Condition()
        self._forking = False  # set by the fork hook: no new transaction until it is done
        self._pid = os.getpid()
        self._connections: dict[int, _Connection] = {}  # by thread id
        _STORES.add(self)
        self._setup()

    def _setup(self) -> None:
        """WAL mode and the schema. Several processes may open a fresh directory at once;
        changing the journal mode fails at once ("database is locked") rather than waiting
        on busy_timeout while another connection reads, so the setup is retried."""
        deadline = time.monotonic() + BUSY_TIMEOUT
        delay = 0.005
        while True:
            try:
                db = self._checkout()
                try:
                    if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                        db.execute("PRAGMA journal_mode=WAL")
                finally:
                    self._checkin(db)
                with self.connect() as db:  # not executescript: it COMMITs the transaction
                    for statement in SCHEMA.split(";"):
                        if statement.strip():
                            db.execute(statement)
                    _migrate(db)
                return
            except sqlite3.OperationalError as exc:
                if _is_unwritable(exc):
                    raise _unavailable(self.db_path, _sqlite_detail(exc)) from exc
                if not _is_busy(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 0.25)

    @contextmanager
    def connect(self, *, write: bool = True) -> Iterator[sqlite3.Connection]:
        """This thread's connection inside a transaction: committed on success, rolled back
        on error. `write` takes the write lock up front (BEGIN IMMEDIATE: no deadlock
        between two readers upgrading); reads pass write=False and never wait for writers."""
        db = self._checkout()
        try:
            db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                yield db
            except BaseException:
                _rollback(db)
                raise
            try:
                db.execute("COMMIT")
            except BaseException:
                _rollback(db)  # a failed COMMIT (disk full) leaves the transaction open
                raise
        finally:
            self._checkin(db)

    def close(self) -> None:
        """Close this process's idle connections (they reopen on the next use)."""
        with self._guard:
            self._close_idle()

    def _close_idle(self) -> None:
        self._forget_inherited()
        for ident, entry in list(self._connections.items()):
            if not entry.busy:
                del self._connections[ident]
                with suppress(sqlite3.Error):
                    entry.db.close()

    def _before_fork(self) -> None:
        """Hold new transactions, let running ones end (bounded; not the forking thread's
        own, if it forks inside one), and close every connection that is idle."""
        me = threading.get_ident()
        with self._guard:
            self._forking = True
            self._guard.wait_for(
                lambda: not any(e.busy for i, e in self._connections.items() if i != me),
                timeout=FORK_WAIT,
            )
            self._close_idle()

    def _after_fork_in_parent(self) -> None:
        with self._guard:
            self._forking = False
            self._guard.notify_all()

    def _after_fork_in_child(self) -> None:
        self._guard = threading.Condition()  # another thread may have held it at the fork
        self._forking = False
        self._forget_inherited()

    def _checkout(self) -> sqlite3.Connection:
        ident = threading.get_ident()
        with self._guard:
            self._guard.wait_for(lambda: not self._forking)
            self._forget_inherited()
            entry = self._connections.get(ident)
            if entry is not None:
                entry.busy += 1
                return entry.db
        db = sqlite3.connect(
            self.db_path,
            timeout=BUSY_TIMEOUT,
            isolation_level=None,
            check_same_thread=False,  # one thread uses it; `close` may come from another
        )
        db.row_factory = sqlite3.Row
        db.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT * 1000)}")
        db.execute("PRAGMA synchronous=NORMAL")  # in WAL mode: durable enough, never corrupt
        with self._guard:
            self._forget_inherited()
            self._close_dead_threads()
            self._connections[ident] = _Connection(db, os.getpid(), busy=1)
        return db

    def _checkin(self, db: sqlite3.Connection) -> None:
        with self._guard:
            entry = self._connections.get(threading.get_ident())
            if entry is not None and entry.db is db:
                entry.busy -= 1
                self._guard.notify_all()

    def _forget_inherited(self) -> None:
        """In a forked child (the pid changed), park the parent's connections for good: those
        another thread was using at the fork. Called with `_guard` held (or in the child's
        fork hook, before any other thread exists)."""
        pid = os.getpid()
        if self._pid != pid:
            _INHERITED.extend(entry.db for entry in self._connections.values())
            self._connections = {}
            self._pid = pid

    def _close_dead_threads(self) -> None:
        alive = {thread.ident for thread in threading.enumerate()}
        for ident, entry in list(self._connections.items()):
            if ident not in alive and not entry.busy:
                del self._connections[ident]
                with suppress(sqlite3.Error):
                    entry.db.close()

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
        """The run `run_id` names (see `find_runs`); None when it names no run or several
        (`handles.resolve_run` says which)."""
        rows = self.find_runs(run_id, limit=2)
        return rows[0] if len(rows) == 1 else None

    def find_runs(self, ref: str, *, limit: int = 10) -> list[dict[str, Any]]:
        """Runs `ref` names, newest first: a full id; `@latest` (the newest run, checks
        aside); or a start or end of an id, or a start of its random tail (as git takes a
        short hash: the tail is what a person copies)."""
        with self.connect(write=False) as db:
            if ref == LATEST:
                row = db.execute(
                    "SELECT * FROM runs WHERE kind = 'run' ORDER BY created_at DESC LIMIT 1"
                ).fetchone()
                return [dict(row)] if row else []
            row = db.execute("SELECT * FROM runs WHERE run_id = ?", (ref,)).fetchone()
            if row is not None or not ref:
                return [dict(row)] if row else []
            pattern = ref.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            rows = db.execute(
                "SELECT * FROM runs WHERE run_id LIKE ? ESCAPE '\\' ORDER BY created_at DESC",
                ("%" + pattern + "%",),
            ).fetchall()
        found = [
            dict(r)
            for r in rows
            if r["run_id"].startswith(ref)
            or r["run_id"].endswith(ref)
            or r["run_id"].rsplit("-", 1)[-1].startswith(ref)
        ]
        return found[:limit]

    def delete_run(self, run_id: str) -> None:
        """Forget a run: its index row, then its folder."""
        import shutil

        with self.connect() as db:
            db.execute("DELETE FROM runs WHERE run_id = ?", (run_id,))
        shutil.rmtree(self.run_dir(run_id), ignore_errors=True)

    def list_runs(
        self,
        *,
        limit: int = 20,
        status: str | None = None,
        schedule: str | None = None,
        batch: str | None = None,
        before: float | None = None,
        kind: str | None = "run",
    ) -> list[dict[str, Any]]:
        """Newest first; `status` may be several, comma-separated; `before`: created before
        this time; `limit` 0 for all; `kind` (see KINDS) None for every kind."""
        where: list[str] = []
        args: list[Any] = []
        if kind is not None:
            where.append("kind = ?")
            args.append(kind)
        if status is not None:
            names = [s for s in status.split(",") if s]
            where.append(f"status IN ({', '.join('?' for _ in names)})")
            args += names
        for column, value in (("schedule", schedule), ("batch", batch)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        if before is not None:
            where.append("created_at < ?")
            args.append(before)
        limit = limit or -1  # SQLite: a negative LIMIT is none
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        with self.connect(write=False) as db:
            rows = db.execute(
                f"SELECT * FROM runs {clause} ORDER BY created_at DESC LIMIT ?", [*args, limit]
            ).fetchall()
        return [dict(r) for r in rows]

    def claim_end(self, run_id: str, ended_at: float) -> bool:
        """Mark a run ended if nobody has yet; True for the one caller that did (two commands
        closing the same orphan at once write its record once)."""
        with self.connect() as db:
            claimed = db.execute(
                "UPDATE runs SET ended_at = ? WHERE run_id = ? AND ended_at IS NULL",
                (ended_at, run_id),
            ).rowcount
        return claimed == 1

    def unfinished_runs(self) -> list[dict[str, Any]]:
        with self.connect(write=False) as db:
            rows = db.execute(
                "SELECT * FROM runs WHERE ended_at IS NULL ORDER BY created_at"
            ).fetchall()
        return [dict(r) for r in rows]

    @staticmethod
    def read_result(record_dir: str | Path) -> dict[str, Any] | None:
        path = Path(record_dir) / "result.json"
        return json.loads(path.read_text()) if path.is_file() else None


def _migrate(db: sqlite3.Connection) -> None:
    """Bring an index made by an older version up to the schema (inside the setup's write
    transaction, so two processes never both add a column)."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(runs)")}
    if "kind" not in columns:
        db.execute("ALTER TABLE runs ADD COLUMN kind TEXT NOT NULL DEFAULT 'run'")


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    return "locked" in str(exc) or "busy" in str(exc)


def _is_unwritable(exc: sqlite3.OperationalError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return code & 0xFF in _UNWRITABLE
    return any(text in str(exc) for text in _UNWRITABLE_TEXT)


def _sqlite_detail(exc: sqlite3.Error) -> str:
    """SQLite's message with its extended code (SQLITE_IOERR_SHORT_READ says more than
    "disk I/O error")."""
    name = getattr(exc, "sqlite_errorname", None)
    return f"{exc} ({name})" if name else str(exc)


def _unavailable(path: Path, detail: str) -> StoreError:
    return StoreError(
        f"The run store cannot be opened: {path}: {detail} (is its disk full, or read-only?).",
        "Free space (or fix permissions) in the state directory ($ORCHESTRATOR_HOME), then "
        "run the command again.",
    )


def _rollback(db: sqlite3.Connection) -> None:
    """Roll back if a transaction is still open (SQLite ends some itself, on disk full)."""
    if db.in_transaction:
        with suppress(sqlite3.Error):
            db.execute("ROLLBACK")


def _before_fork() -> None:
    """Close every connection before a fork: the child then starts with none of SQLite's
    per-process lock state (the SQLite FAQ: do not carry an open database across fork). A
    connection still in use after FORK_WAIT is left open; the child parks it unused."""
    for store in list(_STORES):
        store._before_fork()


def _after_fork_in_parent() -> None:
    for store in list(_STORES):
        store._after_fork_in_parent()


def _after_fork_in_child() -> None:
    for store in list(_STORES):
        store._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )


def _cell(value: Any) -> Any:
    if value is None or isinstance(value, (int, float)):
        return value
    if not isinstance(value, str):
        value = json.dumps(value, default=str)
    return value if len(value) <= _TEXT_LIMIT else value[: _TEXT_LIMIT - 1] + "…"
