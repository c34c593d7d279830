"""The gVisor snapshots kept in the state directory (`snapshots/<id>/`: the checkpoint's files
and `snapshot.json`): found, listed, removed, the least recently used evicted beyond the
number kept, and the lock a maker holds. Making and restoring them is snapshots.py's."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from ...paths import home_dir

#: `ORCHESTRATOR_SNAPSHOTS=off` (or 0, no, false) starts every run cold, silently.
SNAPSHOTS_ENV = "ORCHESTRATOR_SNAPSHOTS"
#: `ORCHESTRATOR_SNAPSHOTS_KEEP=N`: how many snapshots a state directory keeps (one per
#: image, runtime, limits and time-to-live used; their size:
#: benchmarks/results/code_figures.md#sizes-on-disk). Making one more removes the least
#: recently used beyond N (none used in the last RECENT_USE seconds).
KEEP_ENV = "ORCHESTRATOR_SNAPSHOTS_KEEP"
DEFAULT_KEEP = 8
#: A snapshot restored this recently is never removed to make room (a restore may be
#: copying its files).
RECENT_USE = 300.0
#: Where the snapshots are kept, under the state directory: one folder per id, holding the
#: checkpoint's files (`checkpoint/`) and what they were made of (`snapshot.json`).
SNAPSHOTS_DIR = "snapshots"
META_FILE = "snapshot.json"


def enabled() -> bool:
    """Whether snapshots are wanted at all ($ORCHESTRATOR_SNAPSHOTS)."""
    return switched_on(SNAPSHOTS_ENV)


def switched_on(variable: str) -> bool:
    """Whether the speed switch `variable` is on: unless set to off, 0, no or false."""
    return os.environ.get(variable, "on").strip().lower() not in ("off", "0", "no", "false")


def snapshots_root() -> Path:
    return home_dir() / SNAPSHOTS_DIR


@dataclass(frozen=True)
class Snapshot:
    """A snapshot on this host: its id, its folder and what it was made of."""

    id: str
    folder: Path
    meta: dict[str, Any]

    @property
    def checkpoint(self) -> Path:
        return self.folder / "checkpoint"


def find(snapshot: str) -> Snapshot | None:
    folder = snapshots_root() / snapshot
    try:
        meta = json.loads((folder / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    return Snapshot(snapshot, folder, meta)


def list_snapshots() -> list[Snapshot]:
    """Every complete snapshot of this state directory (one being made is in a `.partial`
    folder until it is whole; a crash may leave one there)."""
    root = snapshots_root()
    if not root.is_dir():
        return []
    folders = [p for p in sorted(root.iterdir()) if p.is_dir() and "." not in p.name]
    found = [find(path.name) for path in folders]
    return [snapshot for snapshot in found if snapshot is not None]


def remove(snapshot: Snapshot) -> None:
    """The snapshot's folder and its lock file; gone already is fine."""
    shutil.rmtree(snapshot.folder, ignore_errors=True)
    snapshot.folder.with_name(f"{snapshot.id}.lock").unlink(missing_ok=True)


def keep_count() -> int:
    """How many snapshots to keep ($ORCHESTRATOR_SNAPSHOTS_KEEP, default DEFAULT_KEEP).
    Raises ConfigError when it is not a whole number of at least 1."""
    text = os.environ.get(KEEP_ENV, "").strip()
    if not text:
        return DEFAULT_KEEP
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise ConfigError(
            f"${KEEP_ENV} is {text!r}: it must be a whole number of at least 1 (how many "
            "gVisor snapshots to keep)",
            f"set it to a number such as {DEFAULT_KEEP}, or unset it",
        )
    return count


def last_used(snapshot: Snapshot) -> float:
    """When the snapshot was last made or restored (its meta file's mtime, `mark_used`)."""
    try:
        return (snapshot.folder / META_FILE).stat().st_mtime
    except OSError:
        return 0.0


def mark_used(snapshot: Snapshot) -> None:
    with contextlib.suppress(OSError):
        os.utime(snapshot.folder / META_FILE)


def evict(keep: int, now: float | None = None) -> list[str]:
    """Remove the least recently used snapshots beyond `keep`, never one used in the last
    RECENT_USE seconds; returns the ids removed."""
    now = time.time() if now is None else now
    by_use = sorted(((last_used(s), s) for s in list_snapshots()), key=lambda pair: -pair[0])
    gone = []
    for used, snapshot in by_use[keep:]:
        if now - used >= RECENT_USE:
            remove(snapshot)
            gone.append(snapshot.id)
    return gone


@contextlib.contextmanager
def making_lock(snapshot: str, wait: float = 0.0) -> Iterator[bool]:
    """Whether this process may make `snapshot` now (an exclusive lock on its lock file,
    across processes and threads), waiting up to `wait` seconds for another maker: a run
    starts cold rather than wait (`wait` 0), a pool's builder waits and then finds it made."""
    root = snapshots_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{snapshot}.lock", "a+") as handle:
        give_up = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= give_up:
                    yield False
                    return
                time.sleep(0.1)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
