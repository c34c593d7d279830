"""MCP tools from a remote server, its bearer token bound at egress: a program
(tests/programs/mcp_remote.py) connects to a FastMCP server over streamable HTTP, or over
SSE, as smolagents' guide does (`ToolCollection.from_mcp({"url": ..., "transport": ...,
"headers": {"Authorization": f"Bearer {os.environ['MCP_TOKEN']}"}})`), with `MCP_TOKEN`
bound to the server's host in its PEP 723 block. The sandbox holds a placeholder; the run's
interceptor puts the value on the wire over TLS to that host alone; the server, which wants
the real token, saw it on every request; the agent answers from the tool's reply.

The server (tests/mcp_upstream.py: uvicorn over TLS with its own CA, on this host) has a
name no resolver knows: the interceptor reaches it through the stand-in for squid
(`InterceptorRoute`, the test seam tests/backends/docker/test_secret_runs.py uses). The
model is the scripted server, through the run's gateway, as in tests/payloads/test_mcp.py."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from orchestrator import RunSpec, run
from orchestrator.backends.docker.backend import DockerBackend
from orchestrator.backends.docker.interceptor import InterceptorRoute, ensure_interceptor_image
from tests.conftest import REPO, events_of, files_holding
from tests.mcp_upstream import McpServer, mcp_server
from tests.model_server import ScriptedModelServer, docker_bridge_address

PROGRAM = REPO / "tests" / "programs" / "mcp_remote.py"
HOST = "almanac.example.com"  # the program's [tool.orchestrator.network] hosts and binding
VALUE = "mcp-real-token-3c9e51a7d2"
PREFIX = "orchestrator-bound-MCP_TOKEN-"
#: What the almanac's tool answers for Dune (its nonce: the answer came from the server).
FACTS = re.compile(r"Dune was written by Frank Herbert in 1965 \(almanac [0-9a-f]{16}\)")

pytestmark = [pytest.mark.docker, pytest.mark.gvisor]


@pytest.fixture(scope="module")
def interceptor_image(docker_client: docker.DockerClient) -> str:
    return ensure_interceptor_image(docker_client, print)


def almanac_answer(body: dict[str, Any]) -> str:
    """A model that calls the MCP tool, then answers with what the tool said."""
    said = FACTS.search(json.dumps(body["messages"]))
    if said is None:
        return 'Action: {"name": "book_facts", "arguments": {"title": "Dune"}}'
    return "Action: " + json.dumps({"name": "final_answer", "arguments": {"answer": said[0]}})


@pytest.fixture
def almanac(
    tmp_path: Path, docker_client: docker.DockerClient
) -> Iterator[tuple[McpServer, DockerBackend]]:
    """The remote MCP server, wanting VALUE, and a backend whose interceptors reach it."""
    address = docker_bridge_address()
    with mcp_server(tmp_path, HOST, VALUE, address) as server:
        upstream = server.upstream
        route = InterceptorRoute(f"http://{address}:{upstream.proxy_port}", upstream.ca.read_text())
        yield server, DockerBackend(docker_client, interceptor_route=route)


@pytest.mark.parametrize("transport", ["streamable-http", "sse"])
def test_a_remote_mcp_servers_token_is_put_on_the_wire_at_egress_only(
    agent_image: str,
    interceptor_image: str,
    almanac: tuple[McpServer, DockerBackend],
    monkeypatch: pytest.MonkeyPatch,
    nothing_left: None,
    transport: str,
) -> None:
    server, backend = almanac
    monkeypatch.setenv("MCP_TOKEN", VALUE)
    monkeypatch.setenv("HF_TOKEN", "hf_scripted_model_key")
    with ScriptedModelServer([], answer=almanac_answer) as model:
        spec = RunSpec(payload=PROGRAM, api_base=model.api_base(), program_args=(transport,))
        result = run(spec, backend=backend)
    assert result.status == "succeeded", (result.status, result.error)
    assert result.answer == server.facts("Dune")  # from the tool's reply, quoted by the model
    assert "book_facts" in json.dumps(model.requests[0]["body"])  # listed over MCP

    # The sandbox held the placeholder: its hash, not the value's.
    logs = (Path(result.record_dir) / "stderr.log").read_text()
    (held,) = re.findall(r"^MCP_TOKEN (\S+) sha256 ([0-9a-f]{64})$", logs, re.MULTILINE)
    placeholder, digest = held
    assert placeholder.startswith(PREFIX) and digest == sha256(placeholder)
    assert digest != sha256(VALUE)

    # The server saw the value on every request (a session opened, tools listed and called),
    # and never the placeholder; nothing was refused.
    seen = server.upstream.requests
    paths = {"streamable-http": {"/mcp"}, "sse": {"/sse", "/messages/"}}[transport]
    assert {r["path"] for r in seen} == paths and len(seen) >= 4, seen
    assert [r["headers"]["authorization"] for r in seen] == [f"Bearer {VALUE}"] * len(seen)
    assert all(r["host"] == HOST for r in seen)
    assert server.upstream.holding(PREFIX) == []
    assert server.upstream.tunnels and set(server.upstream.tunnels) == {f"{HOST}:443"}

    events = events_of(result)
    injected = [e for e in events if e["type"] == "secret_injected"]
    assert [(e["secret"], e["host"], e["place"]) for e in injected] == [
        ("MCP_TOKEN", HOST, "header:Authorization")
    ]
    assert injected[0]["count"] == len(seen)
    assert not [e for e in events if e["type"] in ("egress_blocked", "egress_failed")]
    created = next(e for e in events if e["type"] == "sandbox_created")
    assert created["secrets_inside"] == [] and created["secrets_bound"]
    steps = [e for e in events if e["type"] == "step"]
    (call,) = steps[0]["tool_calls"]
    assert (call["name"], call["arguments"]) == ("book_facts", {"title": "Dune"})
    assert files_holding(VALUE, Path(result.record_dir)) == []


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
