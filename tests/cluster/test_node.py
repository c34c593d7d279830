"""Each node of a Ray cluster runs as many attempts at once as its own host carries, under
what it declares: a node that declares more than two per core of this
machine, a batch of CPU-bound mock tasks, and the most attempts that overlapped.

A module of its own: its one-node cluster must not share the machine's Ray ports with
cluster/test_executor.py's two-node cluster while that one is up."""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import pytest

from tests.conftest import TEST_PAYLOADS, cli
from tests.ray_cluster import start_node

MATH = TEST_PAYLOADS / "batch_math"


def most_at_once(attempts: list[dict]) -> int:
    """The most attempts between their `start` and `end` lines at any moment."""
    edges = sorted((a["ts"], 1 if a["event"] == "start" else -1) for a in attempts)
    going = most = 0
    for _ts, step in edges:  # an end and a start at the same instant: the end first
        going += step
        most = max(most, going)
    return most


@pytest.mark.docker
def test_a_node_runs_what_its_host_carries_not_all_it_declares(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, agent_image: str
) -> None:
    cores = os.cpu_count() or 1
    declared = 2 * cores + 4  # the node's limit starts at two per core (then adapts)
    rows = [
        {
            "id": f"m{i:02d}",
            "task": "mul",
            "expected": i * 7,
            "additional_args": {"op": "mul", "a": i, "b": 7},
        }
        for i in range(declared + 4)
    ]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    # A short directory: Ray's socket paths under it must fit in 107 bytes.
    node, address = start_node(tmp_path_factory.mktemp("ray"), "head", sandboxes=declared)
    try:
        done = cli(
            "batch",
            str(MATH),
            str(tasks),
            "-o",
            str(out),
            "--ray",
            address,
            "--timeout",
            "120",
            timeout=600,
        )
        assert done.returncode == 0, done.stderr
        said = re.search(
            rf"(\d+) at once to start with, of the {declared} it declares",
            done.stdout + done.stderr,
        )
        assert said and 1 <= int(said[1]) <= 2 * cores, done.stdout + done.stderr
        lines = (out / "attempts.jsonl").read_text().splitlines()
        attempts = [json.loads(line) for line in lines]
        ended = [a for a in attempts if a["event"] == "end"]
        assert [a["status"] for a in ended] == ["succeeded"] * len(rows)
        most = most_at_once(attempts)
        # Without the node's own limit the driver sent it all it declares at once.
        assert 2 <= most < declared, (most, declared)
    finally:
        node.kill()
        cli("cleanup", env={"ORCHESTRATOR_HOME": str(node.home)})


def test_the_driver_sends_a_node_what_it_says_it_carries_within_what_it_declares() -> None:
    from orchestrator.cluster.connect import NodeInfo
    from orchestrator.cluster.executor import RayExecutor, _Node

    executor = RayExecutor("127.0.0.1:1")  # never joins: the driver's books alone
    node = _Node(NodeInfo("node-1", "10.0.0.5", "box", capacity=8), actor=None)
    executor._nodes = [node]
    assert node.slots == 8  # a node that said nothing: what it declares
    for wrong in (0, -1, 9, "4", 4.0, True, None):  # not the node's to stretch or to break
        executor._limit(node, wrong)
        assert node.slots == 8, wrong
    executor._limit(node, 3)
    assert node.slots == 3
    taken = [executor._take_slot(None) for _ in range(3)]
    assert taken == [node] * 3 and node.busy == 3
    stop = threading.Event()
    stop.set()
    assert executor._take_slot(stop) is None  # a fourth waits (here: stopped while waiting)
    executor._free(node)
    assert executor._take_slot(None) is node
