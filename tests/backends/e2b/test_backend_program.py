"""The guide's program as written on E2B: the project's E2B test server,
through the real `e2b` SDK. Named to run right after test_backend.py, meant to reuse its
template; in a fresh-clone CI run it still took 105 s, most of it a template build of its own
(why the template differs is not known yet).

The scripted model server answers with `fib_team_answer` (each conversation from its own
messages); the program's `HF_TOKEN` stays on the host and reaches the server through the
run's gateway, itself an E2B sandbox.
"""

from __future__ import annotations

import json
import secrets

import pytest

from tests.backends.e2b.test_backend import e2b_env  # noqa: F401 - fixture
from tests.backends.e2b.test_gateway import ALLOW_LOCAL
from tests.conftest import cli
from tests.e2b_server import E2BTestServer
from tests.model_server import ScriptedModelServer, docker_bridge_address
from tests.payloads.test_program import (
    FIB_TEAM,
    FIB_TEAM_TRACE,
    agent_trace,
    events_in,
    fib_team_answer,
)

pytestmark = pytest.mark.docker


def test_the_guides_program_runs_unchanged_on_e2b(
    e2b_env: E2BTestServer,  # noqa: F811 - the fixture
) -> None:
    """`--backend e2b`: the program and its arguments travel in the uploaded request, its
    model calls go through the gateway's own E2B sandbox with the host's key."""
    token = f"hf_{secrets.token_hex(16)}"
    with ScriptedModelServer([], answer=fib_team_answer) as server:
        api_base = server.api_base(docker_bridge_address())  # as E2B's sandboxes reach it
        result = cli(
            "run",
            "--backend",
            "e2b",
            "--api-base",
            api_base,
            "--json",
            str(FIB_TEAM),
            env={"HF_TOKEN": token, ALLOW_LOCAL: "1"},
            timeout=600,
        )
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
        "manager": "gateway",
        "coder_agent": "gateway",
    }
    # Two sandboxes (the gateway's, the run's), neither given the key, both gone.
    assert len(e2b_env.create_requests) == 2
    assert token not in json.dumps(e2b_env.create_requests)
    assert token not in json.dumps([c.envs for c in e2b_env.commands])
    assert e2b_env.alive_count() == 0
