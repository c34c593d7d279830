"""The guide's program as written as a batch on a Ray cluster (`batch
--ray`, a real one-node cluster on this machine). The scripted model server answers with
`fib_team_answer`, so the batch's tasks may run at once; the program's `HF_TOKEN` stays on
the host and reaches the server through each run's gateway.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import cli
from tests.model_server import ScriptedModelServer
from tests.payloads.test_program import (
    FIB_TEAM,
    FIB_TEAM_TRACE,
    agent_trace,
    events_in,
    fib_tasks,
    fib_team_answer,
    fibonacci,
)
from tests.ray_cluster import RayNode, start_node

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def one_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, RayNode]]:
    """A one-node Ray cluster on this machine (its own Ray temp dir and state directory),
    declaring 2 sandboxes; stopped, and what its runs left removed, at the end."""
    tmp = tmp_path_factory.mktemp("ray")  # short: Ray's socket paths must fit 107 bytes
    node, address = start_node(tmp, "head", sandboxes=2)
    try:
        yield address, node
    finally:
        node.kill()
        cli("cleanup", env={"ORCHESTRATOR_HOME": str(node.home)})


def test_a_batch_over_the_guides_program_runs_on_a_ray_cluster(
    one_node: tuple[str, RayNode], tmp_path: Path, agent_image: str, docker_client: Any
) -> None:
    """`batch --ray`: the program's file reaches the node inside the prepared run, each task
    replaces its question, and the node's gateway measures the tokens."""
    from orchestrator.labels import LABEL_STORE, store_id

    address, node = one_node
    numbers = [6, 9, 14, 23]  # not 20, the program's own
    tasks = fib_tasks(tmp_path / "tasks.jsonl", numbers)
    token = f"hf_{secrets.token_hex(16)}"
    out = tmp_path / "out"
    with ScriptedModelServer([], answer=fib_team_answer) as server:
        result = cli(
            "batch",
            str(FIB_TEAM),
            str(tasks),
            "--api-base",
            server.api_base(),
            "--ray",
            address,
            "-o",
            str(out),
            "--json",
            env={"HF_TOKEN": token},
            timeout=600,
        )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["counts"]["succeeded"] == 4 and summary["accuracy"] == 1.0, summary
    assert summary["tokens_source"] == "gateway"
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["answer"] for r in rows) == sorted(fibonacci(n) for n in numbers)
    assert len(server.requests) == 3 * len(numbers)
    assert {r["headers"].get("Authorization") for r in server.requests} == {f"Bearer {token}"}
    served = {"input": server.usage["input_tokens"], "output": server.usage["output_tokens"]}
    assert summary["tokens"] == served
    for row in rows:
        record = json.loads((Path(row["record_dir"]) / "result.json").read_text())
        assert record["node"]["node_id"] and record["token_usage_source"] == "gateway"
        assert agent_trace(events_in(row["record_dir"])) == FIB_TEAM_TRACE
    # The node's sandboxes, gateways and networks are gone with the batch.
    label = {"label": [f"{LABEL_STORE}={store_id(node.home)}"]}
    assert not docker_client.api.containers(all=True, filters=label)
    assert not docker_client.api.networks(filters=label)
