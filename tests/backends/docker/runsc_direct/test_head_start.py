"""A run's sandbox restored while `orchestrator run` starts (runsc_direct/head_start.py):
which command lines may have one, what a hint must hold to be used, and, with the real CLI,
runsc and engine, that a payload's second run is restored from its first's snapshot while
the command starts, and that a head start its run does not take (another shape, a refused
payload, an orchestrator SIGKILLed) leaves nothing behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from orchestrator.backends.docker.runsc_direct import bundle, head_start, records
from orchestrator.backends.docker.runsc_direct.snapshot import META_FILE, SNAPSHOTS_DIR
from orchestrator.labels import LABEL_OWNER, LABEL_RUN_ID
from tests.backends.docker.runsc_direct.conftest import nothing_of_ours_left
from tests.conftest import REPO, cli, start_cli, wait_for

PAYLOAD = REPO / "tests" / "payloads" / "batch_math"
TASK = ("mul", "--arg", 'op="mul"', "--arg", "a=6", "--arg", "b=7")


@pytest.mark.parametrize(
    ("words", "env", "payload"),
    [
        (["run", "tests/payloads/batch_math", "task"], {}, "tests/payloads/batch_math"),
        (["run", "--json", "tests/payloads/batch_math"], {}, "tests/payloads/batch_math"),
        (["run", "tests/payloads/batch_math", "--sandbox-runtime=runsc-direct"], {}, "x"),
        (["run", "tests/payloads/batch_math", "--sandbox-runtime", "runc"], {}, None),
        (["run", "tests/payloads/batch_math"], {"ORCHESTRATOR_SANDBOX_RUNTIME": "runc"}, None),
        (
            ["run", "tests/payloads/batch_math", "--sandbox-runtime", "auto"],
            {"ORCHESTRATOR_SANDBOX_RUNTIME": "runc"},
            "x",
        ),
        (["run", "tests/payloads/batch_math", "--backend", "e2b"], {}, None),
        (["run", "tests/payloads/batch_math"], {"ORCHESTRATOR_BACKEND": "e2b"}, None),
        (["run", "tests/payloads/batch_math", "--network=allowlist"], {}, None),
        (["run", "tests/payloads/batch_math", "--help"], {}, None),
        (["run", "no/such/payload"], {}, None),
        (["batch", "tests/payloads/batch_math", "tasks.jsonl"], {}, None),
        ([], {}, None),
    ],
)
def test_only_a_run_that_may_be_restored_here_names_its_payload(
    words: list[str], env: dict[str, str], payload: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The payload a head start would restore for: none for another command, help, a
    missing payload, or an option (or its variable) that rules this path out; an option
    given wins over its variable. ("x": the payload, whatever its spelling.)"""
    monkeypatch.chdir(REPO)
    for name in ("ORCHESTRATOR_SANDBOX_RUNTIME", "ORCHESTRATOR_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    found = head_start.payload_of(words)
    if payload == "x":
        assert found == "tests/payloads/batch_math"
    else:
        assert found == payload


@pytest.mark.parametrize(
    ("hint", "where"),
    [
        ({"key": "0123456789abcdef"}, "gone"),
        ({"key": "k"}, "outside"),
        ({"key": "other"}, "store"),
        ({"key": "k"}, "climbing"),
        ({}, "store"),
        ({"key": "k", "limits": "many"}, "store"),
        ("not an object", "store"),
    ],
    ids=["gone", "outside-the-store", "other-name", "climbing", "no-key", "bad-limits", "text"],
)
def test_a_hint_that_names_no_complete_snapshot_of_the_store_starts_nothing_and_goes(
    hint: Any, where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hint whose snapshot is gone, is not one of this state directory's snapshots (even
    a complete one elsewhere), or is malformed restores nothing (no record, no process) and
    is removed, so the next run writes a good one."""
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("ORCHESTRATOR_SANDBOX_RUNTIME", raising=False)
    stored = bundle.images_root() / ("0" * 64) / SNAPSHOTS_DIR / "k"
    outside = tmp_path / "k"
    climbed = bundle.images_root().parent / SNAPSHOTS_DIR / "k"
    for folder in (stored, outside, climbed):  # complete: a checkpoint and its note
        (folder / "checkpoint").mkdir(parents=True, exist_ok=True)
        (folder / META_FILE).write_text("{}")
    if isinstance(hint, dict):
        folder = {
            "gone": stored.with_name("0123456789abcdef"),
            "outside": outside,
            "climbing": bundle.images_root() / ".." / SNAPSHOTS_DIR / "k",  # runsc/snapshots/k
            "store": stored,
        }[where]
        hint = {
            "folder": str(folder),
            "limits": {"memory_mb": 256, "cpus": 1.0, "pids": 64},
            **hint,
        }
    path = head_start.hint_path(str(PAYLOAD))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(hint))
    before = records.list_records({})
    try:
        head_start.begin(["run", str(PAYLOAD)])
        assert head_start._session is not None and head_start._session.begun is None
        assert not path.exists()
        assert records.list_records({}) == before
    finally:
        head_start.finish()
        shutil.rmtree(stored.parent.parent)
        shutil.rmtree(climbed.parent)


def test_the_hints_kept_are_bounded(tmp_path: Path) -> None:
    """At most HINTS_KEPT hints: writing one more removes the least recently written."""
    hints = tmp_path / "hints"
    for n in range(head_start.HINTS_KEPT + 3):
        path = hints / f"{n:04d}.json"
        head_start._write_hint(path, {"n": n})
        os.utime(path, (n, n))
    head_start._write_hint(hints / "last.json", {"n": "last"})
    kept = sorted(p.name for p in hints.glob("*.json"))
    assert len(kept) == head_start.HINTS_KEPT
    assert "last.json" in kept and "0000.json" not in kept and "0003.json" not in kept


def run_json(*args: str, payload: Path = PAYLOAD) -> tuple[int, dict[str, Any]]:
    done = cli("run", str(payload), *TASK, "--sandbox-runtime", "runsc-direct", "--json", *args)
    return done.returncode, json.loads(done.stdout or "{}")


@pytest.mark.docker
def test_a_payloads_second_run_is_restored_while_the_command_starts(
    agent_image: str, leaves_nothing: None
) -> None:
    """The first run writes its payload's hint; the second is restored from the same
    snapshot, begun at the command's start, and answers as the first did."""
    head_start.hint_path(str(PAYLOAD)).unlink(missing_ok=True)  # whatever ran it before
    code, first = run_json()
    assert code == 0 and first["answer"] == 42, first
    assert "restore_begun" not in first["sandbox"], first["sandbox"]
    hint = json.loads(head_start.hint_path(str(PAYLOAD)).read_text())
    assert hint["key"] == first["sandbox"]["snapshot"], hint
    code, second = run_json()
    assert code == 0 and second["answer"] == 42, second
    assert second["sandbox"].get("restore_begun") == "at the command's start", second["sandbox"]
    assert second["sandbox"]["snapshot"] == first["sandbox"]["snapshot"]
    assert second["run_id"] != first["run_id"]


@pytest.mark.docker
def test_a_head_start_of_another_shape_is_removed_and_the_hint_follows_the_run(
    agent_image: str, leaves_nothing: None
) -> None:
    """A run with other limits than its payload's last one restores a snapshot of its own:
    the head start (the last run's shape) is removed, and the hint names the new shape."""
    code, first = run_json()
    assert code == 0, first
    code, other = run_json("--memory", "320")
    assert code == 0 and other["answer"] == 42, other
    assert "restore_begun" not in other["sandbox"], other["sandbox"]
    assert other["sandbox"]["snapshot"] != first["sandbox"]["snapshot"]
    hint = json.loads(head_start.hint_path(str(PAYLOAD)).read_text())
    assert hint["key"] == other["sandbox"]["snapshot"] and hint["limits"]["memory_mb"] == 320


@pytest.mark.docker
def test_a_refused_payload_leaves_nothing_of_its_head_start(
    agent_image: str, leaves_nothing: None, tmp_path: Path
) -> None:
    """A payload broken after its last run: the command refuses it (exit 2), the head start
    begun for it is removed with its hint, and nothing of it is left."""
    payload = tmp_path / "payload"
    shutil.copytree(PAYLOAD, payload)
    code, first = run_json(payload=payload)
    assert code == 0, first
    assert head_start.hint_path(str(payload)).exists()
    (payload / "manifest.toml").write_text("[payload\nname = ")
    code, refused = run_json(payload=payload)
    assert code == 2, refused
    assert not head_start.hint_path(str(payload)).exists()


@pytest.mark.docker
def test_a_head_start_of_a_sigkilled_orchestrator_is_cleaned_up(
    agent_image: str, leaves_nothing: None
) -> None:
    """SIGKILLed while its run makes a snapshot of another shape (its head start still
    untaken): the head start names the dead process as its owner, and `cleanup` removes it
    with everything else of the run."""
    code, first = run_json()
    assert code == 0, first
    proc = start_cli(
        "run", str(PAYLOAD), *TASK, "--sandbox-runtime", "runsc-direct", "--memory", "352"
    )

    def begun() -> list[records.SandboxRecord]:
        untaken = records.list_records({LABEL_RUN_ID: head_start.UNTAKEN})
        return [r for r in untaken if r.labels[LABEL_OWNER].split(":")[1] == str(proc.pid)]

    try:
        wait_for(lambda: [r for r in begun() if r.running()], timeout=60, interval=0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert begun(), "the killed orchestrator's head start was removed by no one"
    done = cli("cleanup")
    assert done.returncode == 0, done.stderr
    assert not begun() and not nothing_of_ours_left(), nothing_of_ours_left()
