"""A batch's output folder: its lock, append-only result files and resume state."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from ..errors import OrchestratorError
from .epochs import Key, key

#: Statuses that are the agent's own outcome: a result, never retried, kept on resume.
FINISHED = ("succeeded", "failed", "timed_out", "oom_killed")


#: What to do when an output file cannot be written (shown with the path and the OS error).
WRITE_FIX = (
    "Free space on that file system (or fix its permissions), then re-run the same command "
    "to resume: finished tasks are kept, the others run again."
)


class BatchLocked(OrchestratorError):
    """Another batch is writing to the same output directory."""


class OutputWriteError(OrchestratorError):
    """A file of the output directory could not be written (disk full, read-only, no
    permission). Nothing half-written is left behind: a re-run resumes cleanly."""

    exit_code = 5

    def __init__(self, path: Path, error: OSError) -> None:
        self.path = path
        self.error = error
        detail = error.strerror or str(error)
        if error.errno is not None:
            detail = f"{detail} (errno {error.errno})"
        super().__init__(f"cannot write {path}: {detail}", WRITE_FIX)


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

    @contextmanager
    def locked(self) -> Iterator[BatchDir]:
        """Hold the directory's lock file: a second batch on the same directory would write
        tasks twice. The OS drops the lock when the process dies, even by SIGKILL."""
        from filelock import FileLock, Timeout

        lock_path = self.path / ".lock"
        lock = FileLock(str(lock_path), timeout=0)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            lock.acquire()
        except Timeout:  # before OSError: Timeout is a TimeoutError
            raise BatchLocked(
                f"Another batch is running with the output directory {self.path}.",
                "Wait for it to end (or stop it), or use another --output directory.",
            ) from None
        except OSError as exc:  # read-only, no permission, no inodes left
            raise OutputWriteError(lock_path, exc) from exc
        try:
            yield self
        finally:
            lock.release()

    def read_meta(self) -> dict[str, Any] | None:
        path = self.path / "batch.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def write_meta(self, meta: dict[str, Any]) -> None:
        atomic_write(self.path / "batch.json", json.dumps(meta, indent=2) + "\n")

    def done_ids(self, *, rerun_failed: bool = False) -> set[Key]:
        """The (task, epoch) pairs a resume keeps (an agent outcome; only successes with
        `rerun_failed`), read without the lock and without rewriting (a torn line counts as
        no result)."""
        keep = {"succeeded"} if rerun_failed else set(FINISHED)
        done: set[Key] = set()
        with suppress(OSError):
            for line in self.results_path.read_text(encoding="utf-8").splitlines():
                with suppress(ValueError, KeyError, TypeError, AttributeError):
                    row = json.loads(line)
                    if row.get("status") in keep:
                        done.add(key(row))
        return done

    def load_results(self) -> dict[Key, dict[str, Any]]:
        """Result lines by (task id, epoch). A torn last line (the process died mid-write) is
        dropped here and rewritten away, so it can never be mistaken for a result."""
        results: dict[Key, dict[str, Any]] = {}
        if not self.results_path.is_file():
            return results
        torn = False
        for line in self.results_path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
                results[key(row)] = row
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
        atomic_write(self.results_path, text)

    def append_result(self, row: dict[str, Any]) -> None:
        self._append(self.results_path, row)

    def append_attempt(self, row: dict[str, Any]) -> None:
        self._append(self.attempts_path, row)

    def _append(self, path: Path, row: dict[str, Any]) -> None:
        """One write(2) per line with O_APPEND, then fsync: a line is on disk before the
        batch moves on, and a kill can at worst tear the line being written.

        A line is whole or absent: when the write or the fsync fails (disk full, read-only,
        a short write) the file is cut back to its size before, and `OutputWriteError`
        (path and OS error) is raised."""
        data = (json.dumps(row, default=str) + "\n").encode()
        with self._lock:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError as exc:
                raise OutputWriteError(path, exc) from exc
            try:
                size = os.fstat(fd).st_size  # the lock: nobody else appends meanwhile
                try:
                    written = 0
                    while written < len(data):
                        count = os.write(fd, data[written:])
                        if count <= 0:
                            raise OSError(errno.ENOSPC, f"short write ({written} bytes)")
                        written += count
                    os.fsync(fd)
                except OSError as exc:
                    with suppress(OSError):  # shrinking needs no space
                        os.ftruncate(fd, size)
                    raise OutputWriteError(path, exc) from exc
            finally:
                os.close(fd)

    def link_record(self, task_id: str, record_dir: str, epoch: int | None = None) -> None:
        """`runs/<task>` (with epochs: `runs/<task>/<epoch>`) → the run record of the task's
        final attempt (replaced atomically)."""
        if not record_dir:
            return
        runs = self.path / "runs"
        if epoch is not None:
            runs = runs / safe_name(task_id)
        link = runs / (safe_name(task_id) if epoch is None else str(epoch))
        tmp = runs / f".{link.name}.{os.getpid()}.tmp"
        try:
            runs.mkdir(parents=True, exist_ok=True)
            if tmp.is_symlink():
                tmp.unlink()
            tmp.symlink_to(record_dir)
            os.replace(tmp, link)
        except OSError:
            pass  # the record path is in results.jsonl anyway

    def write_summary(self, summary: dict[str, Any]) -> None:
        """summary.json: `BatchSummary.to_dict()`, whole or not at all."""
        atomic_write(self.path / "summary.json", json.dumps(summary, indent=2) + "\n")


def atomic_write(path: Path, text: str) -> None:
    """Old content or new, never half: a temporary file, fsynced, renamed over `path`. On
    failure the temporary file is removed and `OutputWriteError` names `path`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        try:
            with open(tmp, "w", encoding="utf-8") as file:
                file.write(text)
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, path)
        except OSError:
            with suppress(OSError):
                tmp.unlink()
            raise
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise OutputWriteError(path, exc) from exc
