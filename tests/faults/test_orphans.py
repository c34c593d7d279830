"""SIGKILL of every long-lived command, then the next command: the dead command's runs are
closed `orphaned` with a full record and nothing of theirs is left. And a sandbox frozen by
`docker pause` still ends at its limit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from orchestrator.labels import LABEL_RUN_ID, owner_label
from orchestrator.records.store import Store
from orchestrator.schedules.store import ScheduleStore

from ..conftest import TEST_PAYLOADS, cli, our_containers, running_sandboxes, start_cli, wait_for

pytestmark = pytest.mark.docker

SLEEPER = TEST_PAYLOADS / "sleeper"


def kill_all(proc: subprocess.Popen[str]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)


def assert_closed_as_orphans(run_ids: set[str], stderr: str) -> None:
    for run_id in run_ids:
        assert f"closed run {run_id} as infra_error (orphaned)" in stderr, stderr
        row = Store().get_run(run_id)
        assert row["status"] == "infra_error" and row["ended_at"] and row["duration"] is not None
        result = json.loads((Path(row["record_dir"]) / "result.json").read_text())
        assert result["error"]["type"] == "orphaned", result


def assert_nothing_left(docker_client, store_label: str) -> None:
    assert not our_containers(docker_client, store_label)
    assert not docker_client.api.networks(filters={"label": [store_label]})


def test_sigkill_of_a_batch_then_the_next_command(
    tmp_path: Path, agent_image: str, docker_client, store_label: str
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    lines = [
        {"id": f"t{i}", "task": "sleep", "additional_args": {"seconds": 120}} for i in range(4)
    ]
    tasks.write_text("".join(json.dumps(line) + "\n" for line in lines))
    proc = start_cli(
        "batch", str(SLEEPER), str(tasks), "-o", str(tmp_path / "out"), "-j", "2", "-q"
    )

    def running_runs() -> list[dict]:  # idle warm sandboxes run no run yet: not counted
        return [
            c
            for c in running_sandboxes(docker_client, store_label)
            if Store().get_run(c["Labels"][LABEL_RUN_ID]) is not None
        ]

    try:
        wait_for(lambda: len(running_runs()) == 2, timeout=180)
    finally:
        kill_all(proc)
    # The batch's runs (its idle warm sandboxes, made for runs that never started, are no runs).
    run_ids = {c["Labels"][LABEL_RUN_ID] for c in our_containers(docker_client, store_label)}
    run_ids = {run_id for run_id in run_ids if Store().get_run(run_id) is not None}
    assert len(run_ids) == 2
    listed = cli("runs", "list")
    assert listed.returncode == 0, listed.stderr
    assert_closed_as_orphans(run_ids, listed.stderr)
    assert_nothing_left(docker_client, store_label)


def write_schedule(directory: Path, name: str, **fields: str) -> Path:
    table = {
        "name": name,
        "cron": "* * * * *",
        "payload": str(SLEEPER),
        "model": "mock",
        "missed": "run-once",
        **fields,
    }
    body = "".join(f"{k} = {json.dumps(v)}\n" for k, v in table.items())
    path = directory / "schedules.toml"
    path.write_text(f"[[schedule]]\n{body}additional_args = {{ seconds = 120 }}\n")
    return path


def test_sigkill_of_schedule_run_then_a_restarted_serve_closes_it(
    tmp_path: Path, agent_image: str, docker_client, store_label: str
) -> None:
    name = f"killed-run-{os.getpid()}"
    path = write_schedule(tmp_path, name, cron="0 0 1 1 *")
    proc = start_cli("schedule", "run", name, "--file", str(path), "--quiet")
    try:
        sandbox = wait_for(lambda: running_sandboxes(docker_client, store_label), timeout=180)[0]
    finally:
        kill_all(proc)
    run_id = sandbox["Labels"][LABEL_RUN_ID]
    serve = start_cli("schedule", "serve", "--file", str(path))
    try:
        wait_for(lambda: Store().get_run(run_id)["status"] == "infra_error", timeout=60)
    finally:
        serve.send_signal(signal.SIGTERM)
        out, err = serve.communicate(timeout=60)
    assert serve.returncode == 0, err
    assert_closed_as_orphans({run_id}, out + err)
    assert_nothing_left(docker_client, store_label)


def test_sigkill_of_serve_then_the_next_firing(
    tmp_path: Path, agent_image: str, docker_client, store_label: str
) -> None:
    name = f"killed-serve-{os.getpid()}"
    path = write_schedule(tmp_path, name)
    # A firing recorded ten minutes ago: serve catches up at once (missed = run-once).
    past = datetime.now(timezone.utc) - timedelta(minutes=10)
    ScheduleStore().claim(name, past, past, "serve", owner_label(), outcome="succeeded")
    serve = start_cli("schedule", "serve", "--file", str(path))
    try:
        sandbox = wait_for(lambda: running_sandboxes(docker_client, store_label), timeout=180)[0]
    finally:
        kill_all(serve)
    run_id = sandbox["Labels"][LABEL_RUN_ID]
    # The next firing (a manual one) closes the dead one's run, then fires: its lock was
    # dropped by the OS with the dead process.
    fired = start_cli("schedule", "run", name, "--file", str(path), "--quiet")
    try:
        wait_for(lambda: Store().get_run(run_id)["status"] == "infra_error", timeout=60)
        wait_for(lambda: running_sandboxes(docker_client, store_label), timeout=120)
    finally:
        fired.send_signal(signal.SIGTERM)
        _, err = fired.communicate(timeout=60)
    assert fired.returncode == 130, err
    assert_closed_as_orphans({run_id}, err)
    assert_nothing_left(docker_client, store_label)


def test_a_paused_sandbox_ends_at_its_limit_and_is_removed(
    agent_image: str, docker_client, store_label: str
) -> None:
    proc = start_cli("run", str(SLEEPER), "--arg", "seconds=120", "--timeout", "6", "--json", "-q")
    sandbox = wait_for(lambda: running_sandboxes(docker_client, store_label), timeout=180)[0]
    docker_client.api.pause(sandbox["Id"])
    paused_at = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err  # timed_out
    assert json.loads(out)["status"] == "timed_out"
    assert time.monotonic() - paused_at < 6 + 10
    assert_nothing_left(docker_client, store_label)
