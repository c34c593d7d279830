"""Write failures are clean: an output file that cannot be written (the disk is full) leaves
no torn line, stops the batch with exit 5 and one line saying what to do, removes every
sandbox, and the same command resumes once space is freed, running every task exactly once.

The file system is a real, tiny tmpfs (CI runs as root); a mount that fails fails the test.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from orchestrator.batch.output import BatchDir, OutputWriteError
from orchestrator.records.store import Store, StoreError

from ..conftest import TEST_PAYLOADS, cli

PAGE = 4096


@contextmanager
def tmpfs(path: Path, size_kb: int) -> Iterator[Path]:
    """A tmpfs of `size_kb` KiB mounted at `path` (unmounted on the way out)."""
    path.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kb}k,mode=0755", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mount.returncode != 0:
        pytest.fail(
            f"cannot mount a tmpfs at {path} (this test needs root, as CI has): "
            f"{(mount.stderr or mount.stdout).strip()}"
        )
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path, leave_pages: int) -> Path:
    """A filler file taking all the space of `path`'s file system but `leave_pages` pages."""
    stat = os.statvfs(path)
    free = stat.f_bavail * stat.f_frsize
    filler = path / "filler"
    size = free - leave_pages * PAGE
    assert size > 0, f"the tmpfs at {path} has only {free} bytes free"
    with open(filler, "wb") as file:
        file.write(b"\0" * size)
    stat = os.statvfs(path)
    assert stat.f_bavail * stat.f_frsize == leave_pages * PAGE
    return filler


# --- the output folder's writes (no engine) -------------------------------------------------


def test_append_on_a_full_disk_leaves_no_torn_line(tmp_path: Path) -> None:
    """A line that does not fit (the write is cut short at the page boundary, then ENOSPC)
    is cut back whole: the file is exactly what it was, and the error names the path."""
    with tmpfs(tmp_path / "out", 16) as out:
        batch = BatchDir(out)
        first = {"id": "a", "status": "succeeded", "pad": "x" * 3000}
        batch.append_result(first)
        before = batch.results_path.read_bytes()
        assert len(before) < PAGE  # the file's one page has room for part of the next line
        fill(out, 0)
        with pytest.raises(OutputWriteError) as info:
            batch.append_result({"id": "b", "status": "succeeded", "pad": "y" * 3000})
        assert batch.results_path.read_bytes() == before
        error = info.value
        assert error.exit_code == 5 and str(batch.results_path) in error.cause
        assert "No space left on device" in error.cause and "re-run the same command" in error.fix
        assert batch.load_results() == {("a", 1): first}  # (task id, epoch)
        # The same for the attempts log, the summary and batch.json (atomic writes).
        with pytest.raises(OutputWriteError, match="attempts.jsonl"):
            batch.append_attempt({"event": "start", "id": "b", "pad": "z" * 5000})
        assert batch.attempts_path.read_bytes() == b""
        with pytest.raises(OutputWriteError, match="batch.json"):
            batch.write_meta({"batch_id": "b-x", "pad": "m" * 5000})
        assert sorted(p.name for p in out.iterdir()) == [
            "attempts.jsonl",
            "filler",
            "results.jsonl",
        ]
        # Space again: the next append is whole, after the first line.
        (out / "filler").unlink()
        batch.append_result({"id": "b", "status": "failed"})
        assert [json.loads(line)["id"] for line in batch.results_path.read_text().splitlines()] == [
            "a",
            "b",
        ]


def test_a_short_write_is_cut_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Half a line written, then an error on the rest (what a full disk or a signal does):
    nothing of that line stays; a read-only failure at open names the path too."""
    batch = BatchDir(tmp_path)
    batch.append_result({"id": "a", "status": "succeeded"})
    before = batch.results_path.read_bytes()
    real_write = os.write
    calls = []

    def short_write(fd: int, data: bytes) -> int:
        if os.readlink(f"/proc/self/fd/{fd}") != str(batch.results_path):
            return real_write(fd, data)
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", short_write)
    with pytest.raises(OutputWriteError, match="results.jsonl: No space left on device"):
        batch.append_result({"id": "b", "status": "succeeded", "answer": "a long answer"})
    monkeypatch.undo()
    assert len(calls) == 2  # the rest was tried, then refused
    assert batch.results_path.read_bytes() == before

    batch.results_path.chmod(0o444)
    if os.geteuid() != 0:  # root writes through permissions
        with pytest.raises(OutputWriteError, match="Permission denied"):
            batch.append_result({"id": "c"})


def test_a_run_store_on_a_full_disk_is_a_clear_error(tmp_path: Path) -> None:
    """Opening the store needs room (its shared-memory index is 32 KiB): on a full disk the
    error names the file and exits 5, and is still an sqlite3 error for those handling one."""
    with tmpfs(tmp_path / "home", 256) as home:
        Store(home).close()  # the store exists; its last connection closed
        fill(home, 0)
        with pytest.raises(StoreError) as info:
            Store(home)
        error = info.value
        assert isinstance(error, sqlite3.Error) and error.exit_code == 5
        assert str(home / "index.sqlite3") in error.cause and "disk" in error.cause
        assert "Free space" in error.fix
        (home / "filler").unlink()
        store = Store(home)
        store.create_run("r-1")
        assert [row["run_id"] for row in store.list_runs()] == ["r-1"]
        store.close()


# --- a whole batch filling its disk (real engine, real CLI) ---------------------------------

BATCH_TASKS = 16


def math_tasks(n: int) -> list[dict]:
    return [
        {
            "id": f"q{i:03d}",
            "task": f"What is {i + 2} * 3?",
            "additional_args": {"op": "mul", "a": i + 2, "b": 3},
            "expected": (i + 2) * 3,
        }
        for i in range(n)
    ]


@pytest.mark.docker
def test_a_full_disk_stops_the_batch_cleanly_and_it_resumes(
    tmp_path: Path, agent_image: str, no_leftovers
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in math_tasks(BATCH_TASKS)))
    out = tmp_path / "out"
    command = ["batch", str(TEST_PAYLOADS / "batch_math"), str(tasks), "-o", str(out), "-j", "4"]
    with tmpfs(out, 256):
        # Room for batch.json and a page each of attempts.jsonl and results.jsonl: the disk
        # fills a few tasks in, with tasks running.
        filler = fill(out, 3)
        full = cli(*command, timeout=600)
        assert full.returncode == 5, full.stderr
        assert "Traceback" not in full.stderr, full.stderr
        said = [line for line in full.stderr.splitlines() if "re-run the same command" in line]
        assert len(said) == 1, full.stderr
        (line,) = said
        assert line.startswith(f"orchestrator: stopped: cannot write {out}/"), line
        assert "No space left on device" in line and "to resume: orchestrator batch" in line
        failed = line.split("cannot write ", 1)[1].split(":", 1)[0]
        assert Path(failed).name in ("results.jsonl", "attempts.jsonl", "summary.json"), line
        assert not no_leftovers(), "sandboxes left after the batch stopped"

        results = out / "results.jsonl"
        rows = [json.loads(line) for line in results.read_text().splitlines()]  # none torn
        assert 0 < len(rows) < BATCH_TASKS, f"the disk filled too late or too early: {len(rows)}"
        assert len({r["id"] for r in rows}) == len(rows)
        for text in (out / "attempts.jsonl").read_text().splitlines():
            json.loads(text)

        filler.unlink()
        resumed = cli(*command, timeout=600)
        assert resumed.returncode == 0, resumed.stderr
        rows = [json.loads(line) for line in results.read_text().splitlines()]
        ids = sorted(r["id"] for r in rows)
        assert ids == [t["id"] for t in math_tasks(BATCH_TASKS)]  # each exactly once
        assert all(r["status"] == "succeeded" and r["score"] == 1.0 for r in rows)
        summary = json.loads((out / "summary.json").read_text())
        assert summary["state"] == "complete" and summary["pending"] == 0
    assert not no_leftovers()
