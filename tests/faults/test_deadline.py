"""Nothing outlives its deadline: with every orchestrator process SIGKILLed, a run's
containers stop by themselves at time limit + grace, whatever the code inside tries."""

from __future__ import annotations

import json
import os
import signal
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from orchestrator.backends.docker.deadline import GRACE_SECONDS
from orchestrator.backends.docker.engine import engine_time
from orchestrator.labels import LABEL_RUN_ID
from orchestrator.payloads.manifest import load_manifest
from orchestrator.records.store import Store

from ..conftest import TEST_PAYLOADS, cli, our_containers, running_sandboxes, start_cli, wait_for
from ..model_server import ScriptedModelServer

pytestmark = pytest.mark.docker

ADVERSARY = TEST_PAYLOADS / "adversary"
#: The runtime's exit status for a request it could not read whole (its stdin closed early).
EXIT_BAD_REQUEST = 2
LIMIT = 8.0
#: Docker's own start and stop bookkeeping around the container's life.
SLACK = 3.0


#: How long after its run was created the orchestrator is killed at the latest. Well before
#: the time limit, which the host counts from a moment after that: killed at the limit itself,
#: the live host may have stopped the run an instant before it died (exit 137, its own kill),
#: which is not what these tests check.
KILL_BY = LIMIT - 3


def wait_for_record(sandbox: dict, name: str, text: str) -> bool:
    """Wait until the record of the sandbox's run has `text` in its file `name` (written as
    it comes), or at most KILL_BY seconds after the run was created: on a machine so busy
    that the runtime has not got that far by then, the keeper must still stop the container
    at its deadline, which is what these tests check. Whether it came."""
    run = Store().get_run(sandbox["Labels"][LABEL_RUN_ID])
    path = Path(run["record_dir"]) / name
    until = run["created_at"] + KILL_BY
    while time.time() < until:
        if path.exists() and text in path.read_text():
            return True
        time.sleep(0.1)
    return False


def test_code_in_the_sandbox_cannot_stop_or_ptrace_the_keeper(
    agent_image: str, no_leftovers
) -> None:
    # The host is alive here, so the tool's report reaches the record (the sandbox keeps no
    # engine-side log to read it from later).
    out = cli("run", str(ADVERSARY), "--arg", 'mode="outlive"', "--timeout", str(LIMIT), "--json")
    result = json.loads(out.stdout)
    assert result["status"] == "timed_out", result
    log = (Path(result["record_dir"]) / "stderr.log").read_text()
    attack = next(line for line in log.splitlines() if "deadline attack:" in line)
    assert "ptrace=Operation not permitted" in attack, attack
    assert "mem=Permission denied" in attack, attack


def test_code_in_the_sandbox_cannot_outlive_the_deadline(
    agent_image: str, docker_client, store_label: str
) -> None:
    proc = start_cli(
        "run", str(ADVERSARY), "--arg", 'mode="outlive"', "--timeout", str(LIMIT), "-q"
    )
    try:
        sandbox = wait_for(
            lambda: (running_sandboxes(docker_client, store_label) or [None])[0], timeout=120
        )
        # The tool has attacked PID 1 (its daemon is forked right after the report).
        wait_for_record(sandbox, "stderr.log", "deadline attack:")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # every orchestrator process of this run
        proc.wait(timeout=30)
    state = wait_for(
        lambda: (
            (s := docker_client.api.inspect_container(sandbox["Id"])["State"])["Running"] is False
            and s
        ),
        timeout=LIMIT + GRACE_SECONDS + 30,
    )
    lived = engine_time(state["FinishedAt"]) - engine_time(state["StartedAt"])
    try:
        # The keeper survived the attacks and stopped the container at its deadline (exit
        # 124), with the tool's double-forked daemon still trying to outlive it.
        assert state["ExitCode"] == 124, state
        assert LIMIT + GRACE_SECONDS - 2 <= lived <= LIMIT + GRACE_SECONDS + SLACK, lived
    finally:
        cli("cleanup")
    assert not our_containers(docker_client, store_label)


@pytest.mark.gvisor
@pytest.mark.parametrize("network", ["none", "allowlist", "gateway"])
def test_killed_orchestrator_leaves_nothing_running_past_the_deadline(
    agent_image: str, docker_client, store_label: str, network: str
) -> None:
    """`gateway`: an openai model through the run's model gateway (a third container)."""
    args = ["--arg", "seconds=600", "--timeout", str(LIMIT)]
    script = load_manifest(TEST_PAYLOADS / "sleeper").mock_scripts["manager"]
    with ExitStack() as stack:
        exits = (124,)  # stopped by its keeper at the deadline
        if network == "gateway":
            server = stack.enter_context(ScriptedModelServer(script))
            args += ["--model", "openai:scripted", "--api-base", server.api_base()]
            env = {**os.environ, "OPENAI_API_KEY": "sk-deadline-test"}
            # A gateway whose host is gone serves nobody: if the kill comes before the model
            # has answered, the sandbox's call fails and it ends sooner, with exit code 1.
            exits = (124, 1)
        else:
            args += ["--network", network]
            env = dict(os.environ)
        if network == "allowlist":
            args += ["--allow-host", "example.com"]
        # Killed once the runtime has its request; with a gateway, once the model answered.
        seen = '"type": "model_call"' if network == "gateway" else '"type": "run_start"'
        _kill_mid_run_and_check(docker_client, store_label, args, env, exits, seen)


def _kill_mid_run_and_check(
    docker_client,
    store_label: str,
    args: list[str],
    env: dict[str, str],
    exits: tuple[int, ...],
    seen: str,
) -> None:
    proc = start_cli("run", str(TEST_PAYLOADS / "sleeper"), *args, "-q", env=env)
    try:
        sandbox = wait_for(
            lambda: (running_sandboxes(docker_client, store_label) or [None])[0], timeout=180
        )
        came = wait_for_record(sandbox, "events.jsonl", seen)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    if not came:  # killed so early that the runtime may not have had its whole request
        exits = (*exits, EXIT_BAD_REQUEST)
    run_id = sandbox["Labels"][LABEL_RUN_ID]
    killed_at = time.time()

    def still_running() -> list[str]:
        return [
            c["Names"][0]
            for c in our_containers(docker_client, store_label)
            if c["Labels"].get(LABEL_RUN_ID) == run_id and c["State"] == "running"
        ]

    # (Killed before the runtime had its whole request, it may end at once: stdin closed.)
    assert not came or still_running(), "the run should still be going when its orchestrator dies"
    started = engine_time(docker_client.api.inspect_container(sandbox["Id"])["State"]["StartedAt"])
    wait_for(lambda: not still_running(), timeout=LIMIT + GRACE_SECONDS + 30, interval=0.5)
    stopped_by = time.time()
    assert stopped_by - started <= LIMIT + GRACE_SECONDS + SLACK + 1, stopped_by - started
    assert stopped_by > killed_at
    # The next command on the store closes the run with a full record and removes the rest.
    listed = cli("runs", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert f"closed run {run_id} as infra_error (orphaned)" in listed.stderr
    row = next(r for r in json.loads(listed.stdout) if r["run_id"] == run_id)
    assert row["status"] == "infra_error" and row["exit_code"] in exits, row
    result = json.loads((Path(row["record_dir"]) / "result.json").read_text())
    assert result["error"]["type"] == "orphaned" and result["exit_code"] == row["exit_code"]
    if result["exit_code"] == 124:
        duration = result["timings"]["duration"]
        assert LIMIT + GRACE_SECONDS - 2 <= duration <= LIMIT + GRACE_SECONDS + 3, duration
    assert not our_containers(docker_client, store_label)
    networks = docker_client.api.networks(filters={"label": [store_label]})
    assert not networks, [n["Name"] for n in networks]
    again = cli("runs", "list")
    assert "closed run" not in again.stderr  # closed once
