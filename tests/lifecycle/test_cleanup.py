"""Closing orphaned runs (no engine needed: runs on E2B are closed without one)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

from orchestrator.labels import owner_label
from orchestrator.lifecycle.cleanup import close_orphaned_runs
from orchestrator.records.store import Store

DEAD_OWNER = f"{socket.gethostname()}:4194301:0"  # above pid_max: never a live process


def open_run(store: Store, run_id: str, owner: str) -> Path:
    return store.create_run(run_id, status="running", backend="e2b", owner=owner)


def test_a_dead_owners_run_is_closed_once_with_a_full_record(tmp_path: Path) -> None:
    store = Store(tmp_path)
    record = open_run(store, "r-dead", DEAD_OWNER)
    open_run(store, "r-live", owner_label())
    assert close_orphaned_runs(store) == ["r-dead"]
    row = store.get_run("r-dead")
    assert row["status"] == "infra_error" and row["ended_at"] and row["duration"] is not None
    result = json.loads((record / "result.json").read_text())
    assert result["status"] == "infra_error" and result["error"]["type"] == "orphaned"
    assert "E2B lifetime" in result["error"]["message"]
    assert store.get_run("r-live")["ended_at"] is None  # a live owner's run is left alone
    assert close_orphaned_runs(store) == []  # closed once


def test_a_finished_run_whose_index_update_was_lost_keeps_its_result(tmp_path: Path) -> None:
    store = Store(tmp_path)
    record = open_run(store, "r-done", DEAD_OWNER)
    ended = time.time()
    written = {
        "run_id": "r-done",
        "status": "succeeded",
        "answer": "42",
        "exit_code": 0,
        "timings": {"created": ended - 2, "started": ended - 1, "ended": ended, "duration": 1.0},
        "record_dir": str(record),
    }
    (record / "result.json").write_text(json.dumps(written))
    assert close_orphaned_runs(store) == []  # not an orphan: it ended, the index missed it
    row = store.get_run("r-done")
    assert row["status"] == "succeeded" and row["ended_at"] == ended and row["exit_code"] == 0
    assert json.loads((record / "result.json").read_text()) == written  # never overwritten


def test_a_run_on_a_backend_no_longer_installed_is_closed_saying_why(tmp_path: Path) -> None:
    """Its backend's package was uninstalled since: the record is closed all the same, and
    says why what it left was not removed (nothing is made, nothing raises)."""
    store = Store(tmp_path)
    record = store.create_run("r-gone", status="running", backend="gone", owner=DEAD_OWNER)
    assert close_orphaned_runs(store) == ["r-gone"]
    result = json.loads((record / "result.json").read_text())
    assert result["error"]["type"] == "orphaned"
    assert "could not be removed" in result["error"]["message"]
    assert "Unknown backend 'gone'" in result["error"]["message"]
