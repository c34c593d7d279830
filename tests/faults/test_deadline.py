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
from orchestrator.spec import EXIT_CODES

from ..conftest import TEST_PAYLOADS, cli, our_containers, running_sandboxes, start_cli, wait_for
from ..model_server import ScriptedModelServer

pytestmark = pytest.mark.docker

ADVERSARY = TEST_PAYLOADS / "adversary"
#: The runtime's exit status for a request it could not read whole (its stdin closed early).
EXIT_BAD_REQUEST = 2
LIMIT = 8.0
#: Docker's own start and stop bookkeeping around the container's life.
SLACK = 3.0


#: How long after its sandbox started the orchestrator is killed at the latest. Well before
#: the time limit, which the host counts from a moment before that start: killed at the limit
#: itself, the live host may have stopped the run an instant before it died (exit 137, its own
#: kill), which is not what these tests check. Counted from the sandbox's start, not from the
#: run's creation: on a busy machine making the run's network, gateway and container takes
#: seconds, which are not the runtime's.
KILL_BY = LIMIT - 3


def wait_for_record(docker_client, sandbox: dict, name: str, text: str) -> bool:
    """Wait until the record of the sandbox's run has `text` in its file `name` (written as
    it comes), or at most KILL_BY seconds after the sandbox started: on a machine so busy
    that the runtime has not got that far by then, the keeper must still stop the container
    at its deadline, which is what these tests check. Whether it came."""
    run = Store().get_run(sandbox["Labels"][LABEL_RUN_ID])
    path = Path(run["record_dir"]) / name
    state = docker_client.api.inspect_container(sandbox["Id"])["State"]
    until = engine_time(state["StartedAt"]) + KILL_BY
    while time.time() < until:
        if path.exists() and text in path.read_text():
            return True
        time.sleep(0.1)
    return False


def stop_time(docker_client, container_id: str) -> float:
    """The wall-clock time the container's deadline keeper stops it: `--deadline-at`, set
    once for every container of a run just before the first of them was created; or, for a
    sandbox restored from a gVisor snapshot (`--restorable-idle R --run-seconds S`), S after
    its runtime read the request (the record's `run_start`), at most S after its start plus
    the idle time when no request came."""
    container = docker_client.api.inspect_container(container_id)
    args = container["Args"]
    if "--deadline-at" in args:
        return float(args[args.index("--deadline-at") + 1])
    run_seconds = float(args[args.index("--run-seconds") + 1])
    assert run_seconds <= LIMIT + GRACE_SECONDS, args
    run = Store().get_run(container["Config"]["Labels"][LABEL_RUN_ID])
    events = Path(run["record_dir"]) / "events.jsonl"
    for line in read(events).splitlines():
        event = json.loads(line)
        if event["type"] == "run_start":
            return float(event["ts"]) + run_seconds
    idle = float(args[args.index("--restorable-idle") + 1])
    return engine_time(container["State"]["StartedAt"]) + idle + run_seconds


def check_stopped_at_its_deadline(docker_client, container_id: str) -> None:
    """The container stopped at its keeper's stop time (not before, and within Docker's
    bookkeeping after), and that stop time is at most the time limit and grace after the
    container started: measured from the deadline itself, so the seconds a busy engine takes
    to create the run's containers widen no window."""
    state = docker_client.api.inspect_container(container_id)["State"]
    stop_at = stop_time(docker_client, container_id)
    started, finished = engine_time(state["StartedAt"]), engine_time(state["FinishedAt"])
    assert stop_at - started <= LIMIT + GRACE_SECONDS, (stop_at, started)
    assert stop_at - 1 <= finished <= stop_at + SLACK, (stop_at, finished)


def test_code_in_the_sandbox_cannot_stop_or_ptrace_the_keeper(
    agent_image: str, docker_client, store_label: str, no_leftovers
) -> None:
    # The host is alive here, so the tool's report reaches the record as it comes (the
    # sandbox keeps no engine-side log to read it from later). The time limit is far off: the
    # test waits for the report itself, however long a busy machine takes to get there.
    proc = start_cli("run", str(ADVERSARY), "--arg", 'mode="outlive"', "--timeout", "300", "-q")
    try:
        sandbox = wait_for(
            lambda: (running_sandboxes(docker_client, store_label) or [None])[0], timeout=120
        )
        run = Store().get_run(sandbox["Labels"][LABEL_RUN_ID])
        log = Path(run["record_dir"]) / "stderr.log"
        attack = wait_for(
            lambda: next(
                (line for line in read(log).splitlines() if "deadline attack:" in line), None
            ),
            timeout=120,
        )
        assert "ptrace=Operation not permitted" in attack, attack
        assert "mem=Permission denied" in attack, attack
        # The keeper is still PID 1 of a running container after the attacks.
        state = docker_client.api.inspect_container(sandbox["Id"])["State"]
        assert state["Running"], state
        top = docker_client.api.top(sandbox["Id"], ps_args="-o pid,args")
        keepers = [p for p in top["Processes"] if "--deadline-at" in p[-1]]
        assert keepers and keepers[0][0] == str(state["Pid"]), top
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # the run is cancelled: its containers removed
        proc.wait(timeout=60)
    assert proc.returncode == EXIT_CODES["cancelled"], proc.stderr.read() if proc.stderr else ""
    assert Store().get_run(run["run_id"])["status"] == "cancelled"


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


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
        wait_for_record(docker_client, sandbox, "stderr.log", "deadline attack:")
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
    try:
        # The keeper survived the attacks and stopped the container at its deadline (exit
        # 124), with the tool's double-forked daemon still trying to outlive it.
        assert state["ExitCode"] == 124, state
        check_stopped_at_its_deadline(docker_client, sandbox["Id"])
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
        came = wait_for_record(docker_client, sandbox, "events.jsonl", seen)
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
    stop_at = stop_time(docker_client, sandbox["Id"])
    started = engine_time(docker_client.api.inspect_container(sandbox["Id"])["State"]["StartedAt"])
    if "--deadline-at" in sandbox["Command"]:  # a restored keeper counts from the request
        assert stop_at - started <= LIMIT + GRACE_SECONDS, (stop_at, started)
    wait_for(lambda: not still_running(), timeout=LIMIT + GRACE_SECONDS + 30, interval=0.5)
    stopped_by = time.time()
    assert stopped_by <= stop_at + SLACK + 1, stopped_by - stop_at
    assert stopped_by > killed_at
    # The next command on the store closes the run with a full record and removes the rest.
    listed = cli("runs", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert f"closed run {run_id} as infra_error (orphaned)" in listed.stderr
    row = next(r for r in json.loads(listed.stdout) if r["run_id"] == run_id)
    assert row["status"] == "infra_error" and row["exit_code"] in exits, row
    result = json.loads((Path(row["record_dir"]) / "result.json").read_text())
    assert result["error"]["type"] == "orphaned" and result["exit_code"] == row["exit_code"]
    if result["exit_code"] == 124:  # its end is the sandbox's, stopped at its deadline
        ended = result["timings"]["ended"]
        assert stop_at - 1 <= ended <= stop_at + SLACK, (stop_at, ended)
        assert result["timings"]["duration"] == round(ended - result["timings"]["started"], 3)
    assert not our_containers(docker_client, store_label)
    networks = docker_client.api.networks(filters={"label": [store_label]})
    assert not networks, [n["Name"] for n in networks]
    again = cli("runs", "list")
    assert "closed run" not in again.stderr  # closed once
