"""The run store under contention: many writers and readers across threads and processes,
schema creation racing on a fresh directory, and processes forked from one that has the
store open. No exception, no lost or doubled row, and SQLite's integrity check passes.

Real processes (spawn, and fork where inheritance is the point) and real threads on a real
file; the whole module runs in a few seconds.
"""

from __future__ import annotations

import gc
import multiprocessing
import sqlite3
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

from orchestrator.records import store as store_module
from orchestrator.records.store import Store

SPAWN = multiprocessing.get_context("spawn")
#: Every wait in this module is bounded: a deadlock fails the test instead of hanging it.
WAIT = 20.0


def _guarded(problems: list[str], label: str, target: Any, *args: Any) -> threading.Thread:
    def run() -> None:
        try:
            target(*args)
        except BaseException:
            problems.append(f"{label}: {traceback.format_exc()}")

    thread = threading.Thread(target=run, name=label)
    thread.start()
    return thread


def _write_runs(store: Store, prefix: str, count: int, problems: list[str]) -> None:
    """The life of `count` runs, as the runner and the orphan sweeper write them."""
    for i in range(count):
        run_id = f"{prefix}-{i:04d}"
        store.create_run(run_id, status="preparing", payload="p", batch=prefix.split("-")[0])
        store.update_run(run_id, status="running")
        if not store.claim_end(run_id, time.time()):
            problems.append(f"{run_id}: claim_end refused a run nobody had ended")
        if store.claim_end(run_id, time.time()):
            problems.append(f"{run_id}: claim_end granted twice")
        store.update_run(run_id, status="succeeded", duration=0.5, answer=str(i))


def _read_until(store: Store, stop: threading.Event, problems: list[str]) -> None:
    reads = 0
    while not stop.is_set() or reads < 3:
        rows = store.list_runs(limit=40)
        for row in rows[:5]:
            got = store.get_run(row["run_id"])
            if got is None or got["run_id"] != row["run_id"]:
                problems.append(f"get_run({row['run_id']}) returned {got}")
        for row in store.unfinished_runs():
            if row["ended_at"] is not None:
                problems.append(f"unfinished_runs() returned ended run {row['run_id']}")
        reads += 1


def _contended_process(
    root: str, number: int, writers: int, runs: int, start: Any, out: Any
) -> None:
    """One process: the store opened at a barrier (racing schema creation), `writers`
    writer threads and a reader thread until they are done."""
    problems: list[str] = []
    try:
        start.wait(WAIT)
        store = Store(Path(root))
        stop = threading.Event()
        reader = _guarded(problems, f"p{number}-reader", _read_until, store, stop, problems)
        threads = [
            _guarded(
                problems, f"p{number}-w{t}", _write_runs, store, f"p{number}-w{t}", runs, problems
            )
            for t in range(writers)
        ]
        for thread in threads:
            thread.join(WAIT)
        stop.set()
        reader.join(WAIT)
        if any(t.is_alive() for t in [*threads, reader]):
            problems.append(f"p{number}: a thread was still running after {WAIT}s")
    except BaseException:
        problems.append(f"p{number}: {traceback.format_exc()}")
    out.put((number, problems))


def _collect(processes: list[Any], out: Any) -> list[str]:
    problems: list[str] = []
    reported = 0
    deadline = time.monotonic() + WAIT * 2
    while reported < len(processes) and time.monotonic() < deadline:
        try:
            _, found = out.get(timeout=1)
        except Exception:
            if not any(p.is_alive() for p in processes):
                break
            continue
        reported += 1
        problems += found
    for process in processes:
        process.join(5)
        if process.is_alive():
            process.kill()
            problems.append(f"{process.name} did not end")
        elif process.exitcode != 0:
            problems.append(f"{process.name} exited with {process.exitcode}")
    if reported < len(processes):
        problems.append(f"only {reported} of {len(processes)} processes reported")
    return problems


def _check_file(root: Path, expected: int) -> list[dict[str, Any]]:
    store = Store(root)
    rows = store.list_runs(limit=expected + 100)
    assert len(rows) == expected, f"{len(rows)} rows, {expected} expected"
    assert len({r["run_id"] for r in rows}) == expected
    assert all(r["status"] == "succeeded" and r["ended_at"] is not None for r in rows)
    assert store.unfinished_runs() == []
    db = sqlite3.connect(root / "index.sqlite3")
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        db.close()
    return rows


# --- the tests ------------------------------------------------------------------------------


def test_writers_and_readers_across_processes_and_threads(tmp_path: Path) -> None:
    """4 processes x 2 writer threads (8 writers) plus a reader thread in each process and
    one in this process, all opening the store at once on a fresh directory."""
    processes_n, writers, runs = 4, 2, 40
    root = tmp_path / "store"
    start = SPAWN.Barrier(processes_n + 1)
    out = SPAWN.Queue()
    processes = [
        SPAWN.Process(
            target=_contended_process,
            args=(str(root), n, writers, runs, start, out),
            name=f"store-p{n}",
        )
        for n in range(processes_n)
    ]
    for process in processes:
        process.start()
    problems: list[str] = []
    start.wait(WAIT)
    store = Store(root)
    stop = threading.Event()
    reader = _guarded(problems, "parent-reader", _read_until, store, stop, problems)
    problems += _collect(processes, out)
    stop.set()
    reader.join(WAIT)
    assert not problems, "\n".join(problems)
    _check_file(root, processes_n * writers * runs)


def _open_fresh(roots: list[str], number: int, start: Any, out: Any) -> None:
    problems: list[str] = []
    for round_, root in enumerate(roots):
        try:
            start.wait(WAIT)
            store = Store(Path(root))
            _write_runs(store, f"p{number}-r{round_}", 1, problems)
        except BaseException:
            problems.append(f"p{number} round {round_}: {traceback.format_exc()}")
    out.put((number, problems))


def test_schema_creation_races_on_a_fresh_directory(tmp_path: Path) -> None:
    """6 processes open the store at the same instant on a directory that does not exist
    yet, 8 times over: creating the folder, the file, WAL mode and the schema all race."""
    processes_n, rounds = 6, 8
    roots = [str(tmp_path / f"fresh{r}" / "home") for r in range(rounds)]
    start = SPAWN.Barrier(processes_n)
    out = SPAWN.Queue()
    processes = [
        SPAWN.Process(target=_open_fresh, args=(roots, n, start, out), name=f"schema-p{n}")
        for n in range(processes_n)
    ]
    for process in processes:
        process.start()
    problems = _collect(processes, out)
    assert not problems, "\n".join(problems)
    for root in roots:
        _check_file(Path(root), processes_n)


def _forked_child(store: Store, number: int, runs: int, started: Any, out: Any) -> None:
    """In a forked child: the parent's Store object, with whatever it had open."""
    problems: list[str] = []
    try:
        _write_runs(store, f"child{number}", 1, problems)
        started.release()
        _write_runs(store, f"child{number}-more", runs, problems)
        mine = store.list_runs(limit=1000, batch=f"child{number}")
        if len(mine) != 1 + runs:
            problems.append(f"child{number}: {len(mine)} of its {1 + runs} runs in the index")
    except BaseException:
        problems.append(f"child{number}: {traceback.format_exc()}")
    out.put((number, problems))


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork")
def test_processes_forked_with_the_store_open(tmp_path: Path) -> None:
    """A parent that used the store (connections open in two threads) forks 3 children that
    keep using the same Store object while the parent writes too, then lets the store go
    while they are still writing. A connection carried across fork shares SQLite's lock
    state with the parent's: the child must open its own, and the parent's close must not
    take the write-ahead log from under the children."""
    fork = multiprocessing.get_context("fork")
    root = tmp_path / "store"
    store = Store(root)
    problems: list[str] = []
    _write_runs(store, "parent", 2, problems)
    side = _guarded(problems, "side", _write_runs, store, "side", 2, problems)
    side.join(WAIT)  # the side thread is done but alive-or-not, its connection was opened
    children_n, runs = 3, 60
    started = fork.Semaphore(0)
    out = fork.Queue()
    children = [
        fork.Process(target=_forked_child, args=(store, n, runs, started, out), name=f"forked-{n}")
        for n in range(children_n)
    ]
    for child in children:
        child.start()
    for _ in range(children_n):
        assert started.acquire(timeout=WAIT), "a forked child could not write its first run"
    _write_runs(store, "parent-more", 10, problems)
    del store  # the parent's connections close while the children write
    gc.collect()
    problems += _collect(children, out)
    assert not problems, "\n".join(problems)
    _check_file(root, 2 + 2 + 10 + children_n * (1 + runs))


def _forked_writer(store: Store, number: int, runs: int, out: Any) -> None:
    problems: list[str] = []
    try:
        store_module.BUSY_TIMEOUT = 3.0  # a lock the child can never get fails in seconds
        _write_runs(store, f"forked{number}", runs, problems)
    except BaseException:
        problems.append(f"forked{number}: {traceback.format_exc()}")
    out.put((number, problems))


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork")
def test_a_fork_while_another_thread_is_writing(tmp_path: Path) -> None:
    """Another thread is inside a write transaction when the main thread forks: the fork
    waits for it to end, so the children do not inherit a connection that (as far as their
    copy of SQLite knows) holds the write lock; they write, and nothing is lost."""
    fork = multiprocessing.get_context("fork")
    root = tmp_path / "store"
    store = Store(root)
    problems: list[str] = []
    _write_runs(store, "parent", 1, problems)
    inside = threading.Event()

    def hold_a_transaction() -> None:
        with store.connect() as db:
            db.execute("UPDATE runs SET status = 'succeeded' WHERE run_id = 'parent-0000'")
            inside.set()
            time.sleep(0.3)

    holder = _guarded(problems, "holder", hold_a_transaction)
    assert inside.wait(WAIT)
    children_n, runs = 3, 20
    out = fork.Queue()
    children = [
        fork.Process(target=_forked_writer, args=(store, n, runs, out), name=f"forked-{n}")
        for n in range(children_n)
    ]
    for child in children:
        child.start()
    holder.join(WAIT)
    _write_runs(store, "parent-more", 5, problems)
    problems += _collect(children, out)
    assert not problems, "\n".join(problems)
    _check_file(root, 1 + 5 + children_n * runs)
