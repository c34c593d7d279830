"""A batch's output folder: its lock, append-only result files and resume state."""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import OrchestratorError
from .plan import BatchSummary

#: Statuses that are the agent's own outcome: a result, never retried, kept on resume.
FINISHED = ("succeeded", "failed", "timed_out", "oom_killed")


class BatchLocked(OrchestratorError):
    """Another batch is writing to the same output directory."""


def safe_name(task_id: str) -> str:
    """A file name for a task id (ids are free text); unique because a hash is added when
    anything had to be replaced."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", task_id)[:80]
    if name != task_id or name in (".", ".."):
        name += "-" + hashlib.sha256(task_id.encode()).hexdigest()[:8]
    return name


class BatchDir:
    """The output directory: the lock, the append-only files and the resume state."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.results_path = path / "results.jsonl"
        self.attempts_path = path / "attempts.jsonl"
        self._lock = threading.Lock()
        self._file_lock: Any = None

    @contextmanager
    def locked(self) -> Iterator[BatchDir]:
        """Hold the directory's lock file: a second batch on the same directory would write
        tasks twice. The OS drops the lock when the process dies, even by SIGKILL."""
        from filelock import FileLock, Timeout

        self.path.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(self.path / ".lock"), timeout=0)
        try:
            lock.acquire()
        except Timeout:
            raise BatchLocked(
                f"Another batch is running with the output directory {self.path}.",
                "Wait for it to end (or stop it), or use another --output directory.",
            ) from None
        try:
            yield self
        finally:
            lock.release()

    def read_meta(self) -> dict[str, Any] | None:
        path = self.path / "batch.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def write_meta(self, meta: dict[str, Any]) -> None:
        _atomic_write(self.path / "batch.json", json.dumps(meta, indent=2) + "\n")

    def load_results(self) -> dict[str, dict[str, Any]]:
        """Result lines by task id. A torn last line (the process died mid-write) is dropped
        here and rewritten away, so it can never be mistaken for a result."""
        results: dict[str, dict[str, Any]] = {}
        if not self.results_path.is_file():
            return results
        torn = False
        for line in self.results_path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
                results[str(row["id"])] = row
            except (ValueError, KeyError, TypeError):
                torn = True
        if torn:
            self.rewrite_results(list(results.values()))
        return results

    def load_attempts(self) -> list[dict[str, Any]]:
        rows = []
        if self.attempts_path.is_file():
            for line in self.attempts_path.read_text(encoding="utf-8").splitlines():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue  # a torn last line: that attempt's run record still exists
        return rows

    def rewrite_results(self, rows: list[dict[str, Any]]) -> None:
        """Replace results.jsonl atomically (old or new, never half), before re-running tasks
        whose old lines must go so that no task is ever written twice."""
        text = "".join(json.dumps(row, default=str) + "\n" for row in rows)
        _atomic_write(self.results_path, text)

    def append_result(self, row: dict[str, Any]) -> None:
        self._append(self.results_path, row)

    def append_attempt(self, row: dict[str, Any]) -> None:
        self._append(self.attempts_path, row)

    def _append(self, path: Path, row: dict[str, Any]) -> None:
        """One write(2) per line with O_APPEND, then fsync: a line is on disk before the
        batch moves on, and a kill can at worst tear the line being written."""
        data = (json.dumps(row, default=str) + "\n").encode()
        with self._lock:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)

    def link_record(self, task_id: str, record_dir: str) -> None:
        """`runs/<task>` → the run record of the task's final attempt (replaced atomically)."""
        if not record_dir:
            return
        runs = self.path / "runs"
        runs.mkdir(exist_ok=True)
        link = runs / safe_name(task_id)
        tmp = runs / f".{link.name}.{os.getpid()}.tmp"
        try:
            if tmp.is_symlink():
                tmp.unlink()
            tmp.symlink_to(record_dir)
            os.replace(tmp, link)
        except OSError:
            pass  # the record path is in results.jsonl anyway

    def write_summary(self, summary: BatchSummary) -> None:
        _atomic_write(self.path / "summary.json", json.dumps(summary.to_dict(), indent=2) + "\n")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
