"""Run records a user no longer needs: remove some, prune old ones, export one as an archive.

A run that is still going (its orchestrator process alive) is never removed: its sandbox
would finish into a record that no longer exists. Orphans are closed first by `cleanup.tidy`,
which every command runs, so what is left unfinished here really is running.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..labels import owner_alive
from ..spec import EXIT_CODES
from .handles import resolve_run
from .store import Store

#: Statuses a run has before it ends.
LIVE_STATUSES = ("created", "running")
#: Every status a run can have in the store: before it ends, then its end.
STATUSES = (*LIVE_STATUSES, *EXIT_CODES)

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    """`30d`, `12h`, `90m`, `2w`, `45s` (a bare number is days) -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text or "")
    if not match:
        raise ConfigError(
            f"--older-than {text!r} is not an age.",
            "Write a number and a unit: 45s, 90m, 12h, 30d or 2w.",
        )
    return float(match.group(1)) * _UNITS[match.group(2) or "d"]


def is_live(row: dict[str, Any]) -> bool:
    """Still running: not ended, and its orchestrator process is alive."""
    return row.get("ended_at") is None and owner_alive(row.get("owner") or "")


def remove_runs(store: Store, refs: Iterable[str], *, dry_run: bool = False) -> list[str]:
    """Remove the runs `refs` name (ids, or unique prefixes or suffixes). Every ref is
    resolved first, so one bad ref removes nothing; a live run is refused."""
    rows = [resolve_run(store, ref) for ref in refs]
    live = [r["run_id"] for r in rows if is_live(r)]
    if live:
        raise ConfigError(
            f"Run(s) {', '.join(live)} are still running; nothing was removed.",
            "Wait for them to end (or stop them), then remove them.",
        )
    ids = list(dict.fromkeys(r["run_id"] for r in rows))
    if not dry_run:
        for run_id in ids:
            store.delete_run(run_id)
    return ids


def stop_run(store: Store, ref: str, *, wait: float = 60.0) -> dict[str, Any]:
    """Ask the run `ref` names to stop and wait (up to `wait` seconds) for its orchestrator
    process to end it `cancelled`; returns its row as it is then (still unended if the wait
    ran out). The request is a file in the run's record (`record.STOP_REQUEST`), not a signal:
    the process may run a whole batch or schedule, and only this run is to stop. Raises
    ConfigError (nothing asked) for a run that has ended, or whose process is gone."""
    from .record import STOP_REQUEST

    row = resolve_run(store, ref)
    if row.get("ended_at") is not None:  # before: preparing, starting, running
        raise ConfigError(
            f"Run {row['run_id']} is not running (status: {row['status']}); nothing to stop.",
            "List the runs going on with `orchestrator runs list --status running`.",
        )
    if not is_live(row):
        raise ConfigError(
            f"Run {row['run_id']} has no live orchestrator process ({row.get('owner')}).",
            "Run `orchestrator cleanup` to close it and remove what it left.",
        )
    (Path(row["record_dir"]) / STOP_REQUEST).write_text(f"{time.time()}\n")
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        now = store.get_run(row["run_id"]) or row
        if now.get("ended_at") is not None or not is_live(now):
            return now
        time.sleep(0.2)
    return store.get_run(row["run_id"]) or row


def prune_runs(
    store: Store,
    *,
    older_than: float,
    statuses: Iterable[str] = (),
    dry_run: bool = False,
    now: float | None = None,
) -> list[dict[str, Any]]:
    """Remove ended runs created more than `older_than` seconds ago (only those with one of
    `statuses`, when given); return their index rows, oldest last."""
    wanted = ",".join(statuses) or None
    cutoff = (now if now is not None else time.time()) - older_than
    rows = [
        r
        for r in store.list_runs(limit=0, status=wanted, before=cutoff, kind=None)
        if r["status"] not in LIVE_STATUSES or not is_live(r)
    ]
    if not dry_run:
        for row in rows:
            store.delete_run(row["run_id"])
    return rows


def export_run(
    store: Store, ref: str, destination: str | Path | None = None, *, force: bool = False
) -> Path:
    """Write the run's record as a `.tar.gz`: its folder (events, logs, result.json) under
    the run id, plus `index.json` (the store's row). Default: `./<run_id>.tar.gz`; a folder
    (existing, or written with a trailing `/`) gets `<run_id>.tar.gz` inside. Raises
    ConfigError (nothing written) when the folder is missing or the archive exists (unless
    `force`), and when it cannot be written."""
    row = resolve_run(store, ref)
    run_id = row["run_id"]
    path = Path(destination) if destination else Path(f"{run_id}.tar.gz")
    if path.is_dir() or str(destination or "").endswith(("/", "\\")):
        path = path / f"{run_id}.tar.gz"
    if not path.parent.is_dir():
        raise ConfigError(
            f"Cannot write {path}: the folder {path.parent} does not exist.",
            f"Create it first (mkdir -p {path.parent}), or pass another --output.",
        )
    if path.exists() and not force:
        raise ConfigError(
            f"{path} exists already; the export would replace it.",
            "Pass --force to replace it, or another --output.",
        )
    record = Path(row["record_dir"])
    index = json.dumps(row, indent=2, default=str).encode()
    partial = path.with_name(f".{path.name}.partial")
    try:
        with tarfile.open(partial, "w:gz") as archive:
            if record.is_dir():
                archive.add(record, arcname=run_id)
            info = tarfile.TarInfo(f"{run_id}/index.json")
            info.size, info.mtime, info.mode = len(index), int(time.time()), 0o644
            archive.addfile(info, io.BytesIO(index))
        partial.replace(path)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise ConfigError(
            f"Cannot write {path}: {exc.strerror or exc}.",
            "Pass an --output in a folder you can write to (with free space).",
        ) from exc
    return path
