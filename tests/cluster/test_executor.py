"""Batches on a real Ray cluster: a head and a second node on this machine, each
with its own Ray temp dir, node id and orchestrator state directory; the second node killed
mid-batch (raylet and workers, SIGKILL), then the driver killed mid-batch and resumed."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.labels import LABEL_STORE, store_id
from orchestrator.records.store import Store
from tests.conftest import REPO, TEST_PAYLOADS, cli, files_holding, start_cli, wait_for
from tests.ray_cluster import RayNode, free_port, start_node

MATH = TEST_PAYLOADS / "batch_math"
#: Each task's time limit: a killed node's sandboxes stop at their keeper's deadline, this
#: plus 10 s after they started.
TIMEOUT = 30


def sleepers(n: int, prefix: str, seconds: float = 1) -> list[dict]:
    return [
        {
            "id": f"{prefix}{i:02d}",
            "task": f"sleep {i}",
            "expected": "woke",
            "additional_args": {"op": "sleep", "seconds": seconds},
        }
        for i in range(n)
    ]


def write_tasks(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def lines_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def node_containers(docker_client, home: Path, *, running: bool = False) -> list[dict]:
    label = f"{LABEL_STORE}={store_id(home)}"
    return docker_client.api.containers(all=not running, filters={"label": [label]})


def node_networks(docker_client, home: Path) -> list[dict]:
    return docker_client.api.networks(filters={"label": [f"{LABEL_STORE}={store_id(home)}"]})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("ray")
    nodes: list[RayNode] = []
    try:
        head, address = start_node(tmp, "head", sandboxes=2)
        nodes.append(head)
        extra, _ = start_node(tmp, "extra", sandboxes=2, head_address=address)
        nodes.append(extra)
        ids = {"head_id": head.node_id(), "extra_id": extra.node_id()}
        yield {"address": address, "head": head, "extra": extra, "tmp": tmp, **ids}
    finally:
        for node in nodes:
            node.kill()
        for node in nodes:  # a test that failed halfway leaves nothing either
            cli("cleanup", env={"ORCHESTRATOR_HOME": str(node.home)})


def batch_command(tasks: Path, out: Path, address: str) -> list[str]:
    return [
        "batch",
        str(MATH),
        str(tasks),
        "-o",
        str(out),
        "--ray",
        address,
        "-q",
        "--backoff",
        "0.2",
        "--timeout",
        str(TIMEOUT),
    ]


@pytest.mark.docker
def test_a_killed_node_and_a_killed_driver_lose_nothing(
    cluster: dict, tmp_path: Path, agent_image: str, docker_client, nothing_left
) -> None:
    """A node killed mid-batch: every task answered once, its attempts retried on the other
    node, the records complete in the driver's store; then the driver SIGKILLed mid-batch,
    and the same command resumes it."""
    head, extra, address = cluster["head"], cluster["extra"], cluster["address"]
    t0 = time.monotonic()
    mark = lambda what: print(f"{time.monotonic() - t0:6.1f}s {what}")  # noqa: E731
    head_id, extra_id = cluster["head_id"], cluster["extra_id"]
    assert head_id != extra_id and head.home != extra.home

    # 1. 10 tasks on two nodes; the extra node killed while it runs some of them (two
    # or more answered by then, up to four running, the rest still to give out).
    tasks = write_tasks(tmp_path / "tasks.jsonl", sleepers(10, "t"))
    out = tmp_path / "out"
    driver = start_cli(*batch_command(tasks, out, address))
    extra_store = Store(extra.home / "ray-node")
    try:
        wait_for(lambda: len(lines_of(out / "results.jsonl")) >= 2, 180)
        wait_for(
            lambda: (
                extra_store.unfinished_runs()
                and node_containers(docker_client, extra.home, running=True)
            ),
            60,
        )
        mark("killing the extra node")
        killed_at = time.time()
        extra.kill()
        # read after the kill: a run that ended just before it was not cut
        cut = {r["run_id"] for r in extra_store.unfinished_runs()}
        stdout, stderr = driver.communicate(timeout=240)
        mark("first batch ended")
    finally:
        driver.kill()
    assert driver.returncode == 0, stderr
    results = lines_of(out / "results.jsonl")
    assert sorted(r["id"] for r in results) == [f"t{i:02d}" for i in range(10)]  # each once
    bad = [r for r in results if r["status"] != "succeeded" or r["score"] != 1.0]
    assert not bad, [(r["id"], r["status"], r["error"], r["attempt_history"]) for r in bad]
    ends = [a for a in lines_of(out / "attempts.jsonl") if a["event"] == "end"]
    lost = [a for a in ends if a["status"] == "infra_error"]
    # The killed node's attempts (those running at the kill, and any it had just reserved)...
    assert cut <= {a["run_id"] for a in lost}, (lost, cut)
    print(f"node loss seen {max(a['ts'] for a in lost) - killed_at:.1f}s after the kill")
    for attempt in lost:
        assert (
            attempt["error"]["type"] == "node_lost" and extra_id[:12] in attempt["error"]["message"]
        )
        record = Store().get_run(attempt["run_id"])
        assert record is not None and record["status"] == "infra_error"
        assert Store.read_result(record["record_dir"])["node"]["node_id"] == extra_id
        row = next(r for r in results if r["id"] == attempt["id"])  # ... were retried
        assert row["attempts"] >= 2 and row["run_id"] != attempt["run_id"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["counts"]["succeeded"] == 10 and summary["pending"] == 0
    assert summary["retries"] == len(lost) and summary["attempts"] == 10 + len(lost)
    nodes = {Store.read_result(r["record_dir"])["node"]["node_id"] for r in results}
    assert nodes <= {head_id, extra_id} and head_id in nodes

    # Records that came from a node are complete in the driver's store, naming the node.
    ran = results[0]["run_id"]
    shown = cli("runs", "show", ran)
    assert shown.returncode == 0 and "Ray node" in shown.stdout, shown.stdout
    logs = cli("runs", "logs", ran)
    assert logs.returncode == 0 and "final answer" in logs.stdout, logs.stdout
    assert "woke" in cli("runs", "show", ran, "--json").stdout
    exported = cli("view", "--export", str(tmp_path / "html"), ran)
    assert exported.returncode == 0, exported.stderr
    pages = "".join(p.read_text() for p in (tmp_path / "html").rglob("*.html"))
    node_of_ran = Store.read_result(results[0]["record_dir"])["node"]["node_id"]
    assert f"Ray node {node_of_ran}" in pages
    assert not list(Path(head.home, "ray-node", "runs").iterdir())  # the node's copies went

    # The killed node's sandboxes stop at their deadline by themselves; its next worker (or
    # `cleanup` there) removes them. The head's are gone already.
    assert not node_containers(docker_client, head.home)
    wait_for(lambda: not node_containers(docker_client, extra.home, running=True), TIMEOUT + 30)
    mark("the killed node's sandboxes stopped")
    tidy = cli("cleanup", env={"ORCHESTRATOR_HOME": str(extra.home)})
    assert tidy.returncode == 0, tidy.stderr
    assert not node_containers(docker_client, extra.home)
    assert not node_networks(docker_client, extra.home)

    # 2. The driver SIGKILLed mid-batch (on the head alone now); the same command resumes.
    tasks2 = write_tasks(tmp_path / "tasks2.jsonl", sleepers(6, "u"))
    out2 = tmp_path / "out2"
    command = batch_command(tasks2, out2, address)
    driver = start_cli(*command)
    try:
        wait_for(lambda: len(lines_of(out2 / "results.jsonl")) >= 1, 180)
        wait_for(lambda: node_containers(docker_client, head.home, running=True), 60)
        mark("killing the driver")
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(timeout=10)
    finally:
        driver.kill()
    snapshot = {r["id"]: r for r in lines_of(out2 / "results.jsonl")}
    assert 1 <= len(snapshot) < 6
    again = cli(*command, timeout=240)
    mark("resumed batch ended")
    assert again.returncode == 0, again.stderr
    final = lines_of(out2 / "results.jsonl")
    assert sorted(r["id"] for r in final) == [f"u{i:02d}" for i in range(6)]
    for row in final:
        assert row["status"] == "succeeded"
        if row["id"] in snapshot:
            assert row == snapshot[row["id"]]
    attempts = lines_of(out2 / "attempts.jsonl")
    rerun = {a["id"] for a in attempts if a["event"] == "start" and a["session"] == 2}
    assert rerun and not rerun & set(snapshot)
    assert not node_containers(docker_client, head.home)  # the dead driver's too
    assert not node_networks(docker_client, head.home)


def test_without_ray_the_option_exits_2_saying_how_to_install(tmp_path: Path) -> None:
    """`ray` is an optional extra."""
    hide = tmp_path / "no-ray" / "ray"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ImportError(\"No module named 'ray'\")\n")
    tasks = write_tasks(tmp_path / "tasks.jsonl", sleepers(1, "x"))
    env = {"PYTHONPATH": f"{hide.parent}{os.pathsep}{REPO}"}
    done = cli("batch", str(MATH), str(tasks), "-o", str(tmp_path / "out"), "--ray", env=env)
    assert done.returncode == 2, done.stderr
    assert "pip install 'orchestrator[ray]'" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.docker
def test_a_killed_worker_is_replaced_on_its_node(
    cluster: dict, tmp_path: Path, agent_image: str, docker_client, nothing_left
) -> None:
    """A node's worker dies while the node lives on (Ray's restarts are off): its attempts
    are `infra_error` and retried, a new worker of ours takes over there and removes what
    the dead one left, and the batch ends complete."""
    head = cluster["head"]
    tasks = write_tasks(tmp_path / "tasks.jsonl", sleepers(6, "w"))
    out = tmp_path / "out"
    command = [a for a in batch_command(tasks, out, cluster["address"]) if a != "-q"]
    driver = start_cli(*command)  # not quiet: its messages say what happened
    try:
        wait_for(
            lambda: (
                node_containers(docker_client, head.home, running=True)
                and lines_of(out / "results.jsonl")
            ),
            180,
        )
        (worker,) = wait_for(lambda: head.processes("ray::NodeWorker"), 30)
        os.kill(worker, signal.SIGKILL)
        _, stderr = driver.communicate(timeout=240)
    finally:
        driver.kill()
    assert driver.returncode == 0, stderr
    assert "lost (" in stderr and "a new worker takes attempts" in stderr, stderr
    results = lines_of(out / "results.jsonl")
    assert sorted(r["id"] for r in results) == [f"w{i:02d}" for i in range(6)]
    assert all(r["status"] == "succeeded" for r in results), results
    ends = [a for a in lines_of(out / "attempts.jsonl") if a["event"] == "end"]
    assert [a["error"]["type"] for a in ends if a["status"] == "infra_error"] in (
        ["node_lost"],
        ["node_lost"] * 2,
        ["node_lost"] * 3,
    )
    assert not node_containers(docker_client, head.home)  # the new worker removed them


@pytest.mark.docker
def test_a_secret_reaches_its_node_only_inside_the_call(
    cluster: dict, tmp_path: Path, agent_image: str, orchestrator_home: Path, nothing_left
) -> None:
    """The run's secret is used on its node (the leaky payload proves it
    saw it) and masked in the record, and no file the nodes, Ray or the driver wrote (Ray's
    session logs and spill folders, the nodes' state directories, the batch) holds it."""
    secret = f"Ray-Secret-{uuid.uuid4().hex}"
    tasks = write_tasks(tmp_path / "tasks.jsonl", [{"id": "s", "task": "leak it"}])
    out = tmp_path / "out"
    done = cli(
        "batch",
        str(TEST_PAYLOADS / "leaky"),
        str(tasks),
        "-o",
        str(out),
        "--ray",
        cluster["address"],
        "-q",
        env={"LEAKY_SECRET": secret},
    )
    assert done.returncode == 0, done.stderr
    (row,) = lines_of(out / "results.jsonl")
    assert row["status"] == "succeeded" and f"secret-length={len(secret)}" in row["answer"]
    assert Store.read_result(row["record_dir"])["node"]["node_id"]
    assert files_holding(f"secret-length={len(secret)}", out)  # the scan finds what is there
    assert not files_holding(secret, cluster["tmp"], out, orchestrator_home)


@pytest.mark.docker
def test_schedule_serve_fires_on_the_cluster(
    cluster: dict, tmp_path: Path, agent_image: str, nothing_left
) -> None:
    """`schedule serve --ray`: a firing runs on a node (the lock and the
    overlap rules stay with serve); its record is in this machine's store, naming the node."""
    import threading
    from datetime import timedelta

    import ray

    from orchestrator.cluster import RayExecutor
    from orchestrator.schedules.file import load_schedules
    from orchestrator.schedules.serve import Scheduler
    from tests.schedules.test_schedules import FakeClock, at, firings, sync, unique, write_schedules

    name = unique("ray")
    args = {"op": "mul", "a": 6, "b": 7}
    path = write_schedules(
        tmp_path, {"name": name, "cron": "0 * * * *", "payload": str(MATH), "additional_args": args}
    )
    t = at("2024-06-01T10:00:00+00:00")
    executor = RayExecutor(cluster["address"])
    try:
        scheduler = Scheduler(
            load_schedules(path).schedules,
            executor=executor,
            spawn=sync,
            log=print,
            clock=FakeClock(t - timedelta(seconds=1), t + timedelta(seconds=1)),
        )
        scheduler.serve(threading.Event())
    finally:
        executor.close()
        ray.shutdown()
    (row,) = firings(scheduler.store, name)
    assert row["outcome"] == "succeeded" and row["run_id"], row
    result = Store.read_result(Store().get_run(row["run_id"])["record_dir"])
    assert result["answer"] == 42
    live = {cluster["head_id"], cluster["extra_id"]}
    assert result["node"]["node_id"] in live

    # The command: joins the cluster at start (a wrong address is refused at once), stops on
    # SIGTERM.
    serve = start_cli("schedule", "serve", "--file", str(path), "--ray", cluster["address"])
    try:
        assert "serve started" in serve.stdout.readline()
        serve.send_signal(signal.SIGTERM)
        _, err = serve.communicate(timeout=60)
    finally:
        serve.kill()
    assert serve.returncode == 0 and "1 sandbox" not in err and "firing on the Ray" in err, err
    wrong = cli(
        "schedule", "serve", "--file", str(path), "--ray", f"127.0.0.1:{free_port()}", timeout=120
    )
    assert wrong.returncode == 2 and "Cannot join the Ray cluster" in wrong.stderr, wrong.stderr


@pytest.mark.docker
def test_an_attempt_cancelled_before_any_node_takes_it_is_recorded(
    cluster: dict, nothing_left
) -> None:
    """Every node's room taken and the attempt's cancel set: it never reaches a node, and
    its record is in this machine's store all the same, `cancelled`, as any attempt's is."""
    import threading

    import ray

    from orchestrator.cluster import RayExecutor
    from orchestrator.execution.executor import Attempt
    from orchestrator.lifecycle.runner import RunObservers, prepare
    from orchestrator.spec import RunSpec

    args = {"op": "mul", "a": 6, "b": 7}
    prepared = prepare(RunSpec(payload=MATH, task="6*7", additional_args=args))
    store, cancel = Store(), threading.Event()
    cancel.set()
    executor = RayExecutor(cluster["address"])
    held = []
    try:
        room = executor.max_concurrency(prepared) or 0
        held = [executor.reserve(prepared) for _ in range(room)]  # every node full
        result = executor.run(Attempt(prepared), RunObservers(store=store, cancel=cancel))
    finally:
        for attempt in held:
            executor.release(attempt)
        executor.close()
        ray.shutdown()
    assert room >= 1 and result.status == "cancelled" and result.run_id == prepared.run_id
    row = store.get_run(prepared.run_id)
    assert row is not None and row["status"] == "cancelled", row
    recorded = Store.read_result(row["record_dir"])
    assert recorded["status"] == "cancelled" and recorded["error"]["type"] == "cancelled"
