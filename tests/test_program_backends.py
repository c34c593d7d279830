"""The guide's program as written (issue 40, item 7) on the other places a run can go: an E2B
sandbox (the project's E2B test server, through the real `e2b` SDK) and a batch on a Ray
cluster (`batch --ray`, a real one-node cluster on this machine).

Both use the scripted model server with `fib_team_answer`, which answers each conversation
from its own messages (so a batch's tasks may run at once); the program's `HF_TOKEN` stays
on the host and reaches the server through the run's gateway.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import cli
from .e2b_server import E2BTestServer
from .model_server import ScriptedModelServer, docker_bridge_address
from .ray_cluster import RayNode, start_node
from .test_e2b_backend import e2b_env, e2b_test_server  # noqa: F401 - fixtures
from .test_e2b_gateway import ALLOW_LOCAL
from .test_program import FIB_TEAM, fib_team_answer, fibonacci

pytestmark = pytest.mark.docker


def events_in(record_dir: str) -> list[dict[str, Any]]:
    lines = (Path(record_dir) / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def agent_trace(events: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
    """The steps and managed-agent calls of a run, by agent."""
    kinds = ("step", "managed_agent_call", "managed_agent_result")
    return [(e["type"], e.get("agent")) for e in events if e["type"] in kinds]


#: What the guide's program does with `fib_team_answer`: the manager calls coder_agent,
#: which computes the number in one step; the manager then answers with its report.
FIB_TEAM_TRACE = [
    ("managed_agent_call", "coder_agent"),
    ("step", "coder_agent"),
    ("managed_agent_result", "coder_agent"),
    ("step", "manager"),
    ("step", "manager"),
]


# ---- E2B ---------------------------------------------------------------------------------------


def test_the_guides_program_runs_unchanged_on_e2b(
    e2b_env: E2BTestServer,  # noqa: F811 - the fixture
) -> None:
    """`--backend e2b`: the program and its arguments travel in the uploaded request, its
    model calls go through the gateway's own E2B sandbox with the host's key."""
    token = f"hf_{secrets.token_hex(16)}"
    with ScriptedModelServer([], answer=fib_team_answer) as server:
        api_base = server.api_base(docker_bridge_address())  # as E2B's sandboxes reach it
        result = cli(
            "run", str(FIB_TEAM), "--backend", "e2b", "--api-base", api_base, "--json",
            env={"HF_TOKEN": token, ALLOW_LOCAL: "1"}, timeout=600,
        )  # fmt: skip
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    assert outcome["status"] == "succeeded" and outcome["answer"] == 6765, outcome
    assert outcome["backend"] == "e2b"
    assert len(server.requests) == 3
    assert {r["headers"].get("Authorization") for r in server.requests} == {f"Bearer {token}"}
    assert outcome["token_usage_source"] == "gateway"
    assert {k: outcome["token_usage"][k] for k in server.usage} == server.usage
    events = events_in(outcome["record_dir"])
    assert agent_trace(events) == FIB_TEAM_TRACE
    start = next(e for e in events if e["type"] == "run_start")
    assert start["program"] == {"path": "fib_team.py", "argv": []}
    assert {a["name"]: a["model"]["routed_to"] for a in start["agents"]} == {
        "manager": "gateway", "coder_agent": "gateway"
    }  # fmt: skip
    # Two sandboxes (the gateway's, the run's), neither given the key, both gone.
    assert len(e2b_env.create_requests) == 2
    assert token not in json.dumps(e2b_env.create_requests)
    assert token not in json.dumps([c.envs for c in e2b_env.commands])
    assert e2b_env.alive_count() == 0


# ---- Ray ---------------------------------------------------------------------------------------


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
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(
        json.dumps({"id": f"fib{n}", "task": f"What's the {n}th Fibonacci number?",
                    "expected": str(fibonacci(n))}) + "\n"
        for n in numbers
    ))  # fmt: skip
    token = f"hf_{secrets.token_hex(16)}"
    out = tmp_path / "out"
    with ScriptedModelServer([], answer=fib_team_answer) as server:
        result = cli(
            "batch", str(FIB_TEAM), str(tasks), "--api-base", server.api_base(),
            "--ray", address, "-o", str(out), "--json",
            env={"HF_TOKEN": token}, timeout=600,
        )  # fmt: skip
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
