"""Faults from the engine's side: a sandbox killed from outside, and many runs at once while
the index is being read."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from orchestrator import RunSpec, run
from orchestrator.records.store import Store

from ..conftest import REPO, TEST_PAYLOADS, running_sandboxes, start_cli, wait_for

pytestmark = pytest.mark.docker

SLEEPER = TEST_PAYLOADS / "sleeper"


def test_a_sandbox_killed_from_outside_ends_infra_error_with_nothing_left(
    agent_image: str, docker_client, store_label: str, no_leftovers
) -> None:
    proc = start_cli("run", str(SLEEPER), "--arg", "seconds=60", "--json", "--quiet")
    sandbox = wait_for(lambda: running_sandboxes(docker_client, store_label), timeout=180)[0]
    docker_client.api.kill(sandbox["Id"])  # `docker kill`
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 5, err
    result = json.loads(out)
    assert result["status"] == "infra_error"
    assert result["error"]["type"] in ("sandbox_lost", "no_result"), result["error"]
    assert result["exit_code"] == 137  # SIGKILL, as the engine recorded it


def test_eight_concurrent_runs_while_the_index_is_read(
    agent_image: str, tmp_path: Path, no_leftovers
) -> None:
    results: list = []
    errors: list[BaseException] = []
    done = threading.Event()

    def one(i: int) -> None:
        try:
            spec = RunSpec(payload=SLEEPER, additional_args={"seconds": 1}, model="mock")
            results.append(run(spec))
        except BaseException as exc:  # reported below
            errors.append(exc)

    def reader() -> None:
        store = Store()
        reads = 0
        while not done.is_set() or reads == 0:
            try:
                for row in store.list_runs(limit=50):
                    store.get_run(row["run_id"])
                store.unfinished_runs()
                reads += 1
            except BaseException as exc:  # reported below
                errors.append(exc)
                return

    readers = [threading.Thread(target=reader) for _ in range(2)]
    runners = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for thread in readers + runners:
        thread.start()
    for thread in runners:
        thread.join(timeout=300)
    done.set()
    for thread in readers:
        thread.join(timeout=60)
    # A reader in another process too (what `runs list` does while a batch writes).
    listed = subprocess.run(
        [sys.executable, "-m", "orchestrator", "runs", "list", "--json", "--limit", "100"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert not errors, errors
    assert len(results) == 8 and all(r.status == "succeeded" for r in results)
    assert listed.returncode == 0, listed.stderr
    rows = {r["run_id"]: r for r in json.loads(listed.stdout)}
    assert all(rows[r.run_id]["status"] == "succeeded" for r in results)
