"""The run store's index as listings see it: check runs (`validate`'s and a batch preflight's
loads of a payload) are recorded but never pass for real runs, and an index made by an older
version gains what the listings need. No sandbox: rows are written directly."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from orchestrator.errors import ConfigError
from orchestrator.records.store import Store
from orchestrator.view.queries import RunFilter, list_runs
from tests.conftest import cli


def test_check_runs_are_hidden_from_listings_unless_asked_for(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.create_run("r-real", status="succeeded", payload="team", batch="b-1")
    store.create_run("r-check", status="succeeded", payload="checked", kind="check")
    assert [r["run_id"] for r in store.list_runs()] == ["r-real"]
    assert [r["run_id"] for r in store.list_runs(kind="check")] == ["r-check"]
    assert len(store.list_runs(kind=None)) == 2  # what `runs prune` goes through
    page = list_runs(store, RunFilter())  # the viewer's runs page
    assert [r["run_id"] for r in page.rows] == ["r-real"] and page.total == 1
    assert page.facets["payload"] == ["team"]  # no filter value that only checks have
    home = {"ORCHESTRATOR_HOME": str(tmp_path)}
    listed = cli("runs", "list", "--json", env=home)
    assert [r["run_id"] for r in json.loads(listed.stdout)] == ["r-real"], listed.stderr
    checks = cli("runs", "list", "--checks", "--json", env=home)
    assert [r["run_id"] for r in json.loads(checks.stdout)] == ["r-check"], checks.stderr
    shown = cli("runs", "show", "r-check", env=home)  # still found by its id
    assert shown.returncode == 0 and "no step ran" in shown.stdout, shown.stderr


def test_an_older_index_gains_the_kind_column(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / "index.sqlite3") as db:
        db.execute(
            "CREATE TABLE runs (run_id TEXT PRIMARY KEY, created_at REAL NOT NULL, "
            "ended_at REAL, status TEXT NOT NULL, payload TEXT, model TEXT, backend TEXT, "
            "network TEXT, task TEXT, answer TEXT, error TEXT, exit_code INTEGER, "
            "duration REAL, input_tokens INTEGER, output_tokens INTEGER, schedule TEXT, "
            "batch TEXT, owner TEXT, record_dir TEXT NOT NULL)"
        )
        db.execute(
            "INSERT INTO runs (run_id, created_at, status, record_dir) "
            "VALUES ('r-old', 1.0, 'succeeded', 'x')"
        )
    db.close()
    store = Store(tmp_path)
    assert [r["kind"] for r in store.list_runs()] == ["run"]
    Store(tmp_path)  # a second opening finds the column there already
    store.create_run("r-new", status="created", kind="check")
    assert [r["run_id"] for r in store.list_runs(kind="check")] == ["r-new"]


def test_export_refuses_a_missing_folder_and_never_overwrites(tmp_path: Path) -> None:
    home = tmp_path / "home"
    store = Store(home)
    store.create_run("r-20260101-000000-abcdef", status="succeeded")
    env = {"ORCHESTRATOR_HOME": str(home)}
    missing = cli("runs", "export", "abcdef", "-o", str(tmp_path / "no" / "x.tgz"), env=env)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr
    assert "does not exist" in missing.stderr and "mkdir -p" in missing.stderr
    into = tmp_path / "out"
    into.mkdir()
    first = cli("runs", "export", "abcdef", "-o", f"{into}/", env=env)
    assert first.returncode == 0, first.stderr
    archive = Path(first.stdout.strip())
    assert archive == into / "r-20260101-000000-abcdef.tar.gz" and archive.is_file()
    archive.write_bytes(b"kept")
    again = cli("runs", "export", "abcdef", "-o", f"{into}/", env=env)
    assert again.returncode == 2 and "--force" in again.stderr, again.stderr
    assert archive.read_bytes() == b"kept"
    forced = cli("runs", "export", "abcdef", "-o", str(into), "--force", env=env)
    assert forced.returncode == 0 and archive.read_bytes() != b"kept", forced.stderr
    assert [p.name for p in into.iterdir()] == [archive.name]  # no partial file left


def test_run_and_batch_handles_as_the_docs_say(tmp_path: Path) -> None:
    """A run id by its random tail's start, @latest, ambiguity listing the candidates, a
    "did you mean" for a typo; `runs list --batch` by folder or id prefix (before,
    only a suffix or a start of the whole id worked, and --batch only a full id)."""
    home = tmp_path / "home"
    store = Store(home)
    old = "r-20260101-000000-58a6d1e2f3a4"
    new = "r-20260102-000000-9bc0d1e2f3a5"
    store.create_run(old, status="succeeded", batch="b-20260101-000000-aaaa11112222", ended_at=1.0)
    store.create_run(new, status="failed", batch="b-20260102-000000-bbbb33334444", ended_at=2.0)
    store.create_run(
        "r-20260103-000000-ffff00001111", status="succeeded", kind="check", ended_at=3.0
    )
    env = {"ORCHESTRATOR_HOME": str(home)}
    by_tail = cli("runs", "show", "58a6d1", "--json", env=env)
    assert by_tail.returncode == 0, by_tail.stderr
    assert json.loads(by_tail.stdout)["run_id"] == old
    latest = cli("runs", "show", "@latest", "--json", env=env)  # checks aside
    assert json.loads(latest.stdout)["run_id"] == new, latest.stderr
    ambiguous = cli("runs", "show", "r-2026", env=env)
    assert ambiguous.returncode == 2 and old in ambiguous.stderr and new in ambiguous.stderr
    typo = cli("runs", "logs", "58a6d2", env=env)
    assert typo.returncode == 2 and f"Did you mean {old}?" in typo.stderr, typo.stderr
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "batch.json").write_text(json.dumps({"batch_id": "b-20260102-000000-bbbb33334444"}))
    for ref in (str(folder), "b-20260101", "bbbb33334444"):
        listed = cli("runs", "list", "--batch", ref, "--json", env=env)
        assert listed.returncode == 0, listed.stderr
        want = new if ref != "b-20260101" else old
        assert [r["run_id"] for r in json.loads(listed.stdout)] == [want], ref
    both = cli("runs", "list", "--batch", "b-2026", env=env)
    assert both.returncode == 2 and "ambiguous" in both.stderr
    near = cli("runs", "list", "--batch", "b-20260102-000000-bbbb33334445", env=env)
    assert near.returncode == 2 and "Did you mean b-20260102-000000-bbbb33334444" in near.stderr


def test_runs_stop_refuses_a_run_that_is_not_running(tmp_path: Path) -> None:
    home = tmp_path / "home"
    store = Store(home)
    store.create_run("r-20260101-000000-abcdef012345", status="succeeded", ended_at=1.0)
    out = cli("runs", "stop", "abcdef", env={"ORCHESTRATOR_HOME": str(home)})
    assert out.returncode == 2 and "is not running (status: succeeded)" in out.stderr
    assert "runs list --status running" in out.stderr
    import socket

    from orchestrator.records.housekeeping import stop_run

    dead = f"{socket.gethostname()}:{2**22 + 7}:0"  # above Linux's pid_max: never a process
    store.create_run("r-20260101-000001-fedcba987654", status="preparing", owner=dead)
    with pytest.raises(ConfigError, match="has no live orchestrator process"):
        stop_run(store, "fedcba")  # still preparing, but its process is gone
