"""The shipped port of smolagents' multi-agent tutorial (agent_payloads/web_browser), run as
its author wrote it: with the mock model, and with a scripted OpenAI-compatible server through
the model gateway; the record nests the web agent under the manager and holds exactly the
egress that happened."""

from __future__ import annotations

import json
import re
import secrets
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from orchestrator import RunSpec, run
from orchestrator.view.tree import AgentNode, build_tree
from tests.conftest import PAYLOADS, cli, events_of
from tests.model_server import ScriptedModelServer

pytestmark = pytest.mark.docker

TUTORIAL = PAYLOADS / "web_browser"
#: A listed host that never resolves (RFC 6761 reserves .invalid): its failure is certain.
UNRESOLVABLE = "no-such-host.invalid"


def tutorial_copy(folder: Path, extra_hosts: tuple[str, ...] = ()) -> Path:
    """The tutorial payload, its manifest's hosts extended (same requirements: same image)."""
    copy = folder / "web_browser"
    shutil.copytree(TUTORIAL, copy)
    manifest = copy / "manifest.toml"
    text = manifest.read_text()
    hosts = ", ".join(json.dumps(h) for h in ("lite.duckduckgo.com", "epoch.ai", *extra_hosts))
    text = re.sub(r"(?m)^hosts = \[.*\]$", f"hosts = [{hosts}]", text)
    manifest.write_text(text)
    return copy


def web_agent_under_manager(events: list[dict[str, Any]]) -> AgentNode:
    """The web agent's node, asserted to be nested in the manager's first step."""
    root = build_tree(events)
    assert root.name == "manager"
    (first, *_) = root.steps
    (web,) = first.calls
    assert web.name == "web_search_agent" and web.finished and web.steps
    return web


def test_the_tutorial_runs_with_the_mock_model_nested_as_written(
    agent_image: str, nothing_left: None
) -> None:
    result = run(RunSpec(payload=TUTORIAL, model="mock"))
    assert result.status == "succeeded", result.error
    assert result.answer == "13 GW" and result.network == "allowlist"
    events = events_of(result)
    web = web_agent_under_manager(events)
    assert [s.number for s in web.steps] == [1, 2] and web.steps[-1].is_final_answer
    start = next(e for e in events if e["type"] == "run_start")
    agents = {a["name"]: a for a in start["agents"]}
    assert {n: a["kind"] for n, a in agents.items()} == {
        "manager": "CodeAgent",
        "web_search_agent": "ToolCallingAgent",
    }
    # The manifest sets no max_steps: each agent keeps its own (the manager smolagents' 20).
    manager, web_agent = agents["manager"], agents["web_search_agent"]
    assert (manager["max_steps"], manager["max_steps_from"]) == (20, "program")
    assert (web_agent["max_steps"], web_agent["max_steps_from"]) == (10, "program")
    assert manager["declared_imports"] == ["time", "numpy", "pandas"]
    assert manager["imports_not_granted"] == []
    assert {"numpy", "pandas", "time"} <= set(manager["authorized_imports"])


def test_validate_names_the_imports_the_manifest_does_not_grant(
    agent_image: str, tmp_path: Path, nothing_left: None
) -> None:
    payload = tutorial_copy(tmp_path)
    manifest = payload / "manifest.toml"
    text = manifest.read_text()
    manifest.write_text(re.sub(r"(?m)^authorized_imports = .*$", "", text))
    result = cli("validate", str(payload))
    assert result.returncode == 2, result.stderr
    problem = result.stderr
    assert "'manager'" in problem and "numpy, pandas" in problem, problem
    assert "python.authorized_imports" in problem and "manifest.toml" in problem


def visit(url: str) -> str:
    """One ToolCallingAgent step that calls visit_webpage, as a model writes it."""
    return "Action: " + json.dumps({"name": "visit_webpage", "arguments": {"url": url}})


def test_through_the_gateway_the_record_has_exactly_the_egress_that_happened(
    agent_image: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nothing_left: None
) -> None:
    """A listed host that cannot be reached, an unlisted one, and the gateway (reached
    directly, as NO_PROXY says): the record has one event for the unlisted host and the
    model calls, never the gateway as egress."""
    monkeypatch.setenv("OPENAI_API_KEY", f"sk-gwtest-{secrets.token_hex(16)}")
    payload = tutorial_copy(tmp_path, extra_hosts=(UNRESOLVABLE,))
    script = [
        "Thought: the web agent reads the pages.\n<code>\n"
        "report = web_search_agent(task='Read the two pages.')\nprint(report)\n</code>",
        visit(f"https://{UNRESOLVABLE}/power"),
        visit("https://example.com/"),
        'Action: {"name": "final_answer", "arguments": {"answer": "both pages failed"}}',
        "Thought: done.\n<code>\nfinal_answer(report)\n</code>",
    ]
    with ScriptedModelServer(script) as server:
        result = run(RunSpec(payload=payload, model="openai:scripted", api_base=server.api_base()))
    assert result.status == "succeeded", result.error
    assert "both pages failed" in str(result.answer)
    assert result.network == "allowlist" and result.gateway["calls"] == 5
    events = events_of(result)
    web = web_agent_under_manager(events)
    observations = [s.observations or "" for s in web.steps]
    assert "Error fetching the webpage" in observations[0]
    assert "Error fetching the webpage" in observations[1]

    # Exactly what happened, each tied to the step that did it: the listed host failed
    # upstream (allowed, with squid's cause), the unlisted one was refused.
    egress = [e for e in events if e["type"].startswith("egress")]
    assert [
        (e["type"], e["host"], e["port"], e["verdict"], e["agent"], e["step_number"])
        for e in egress
    ] == [
        ("egress_failed", UNRESOLVABLE, 443, "allowed", "web_search_agent", 1),
        ("egress_blocked", "example.com", 443, "denied", "web_search_agent", 2),
    ], egress
    assert "upstream" in egress[0]["reason"] and egress[1]["reason"] == "not on the allowlist"
    assert result.egress_blocked == 1
    gateway = urlsplit(server.api_base()).hostname
    assert all(e.get("port") != server.port for e in egress), egress
    assert not [e for e in egress if e.get("host") in (gateway, "host.orchestrator.internal")]
    assert len([e for e in events if e["type"] == "model_call"]) == 5


def test_under_network_none_the_attempt_is_recorded_with_its_step(
    agent_image: str, nothing_left: None
) -> None:
    """The mock trajectory's page visit under `--network none`: the tool reports a failed
    fetch, and the record says why, which agent and which step."""
    result = run(RunSpec(payload=TUTORIAL, model="mock", network="none"))
    assert result.status == "succeeded", result.error
    assert result.network == "none"
    egress = [e for e in events_of(result) if e["type"].startswith("egress")]
    assert [
        (e["type"], e["source"], e["host"], e["port"], e["agent"], e["step_number"]) for e in egress
    ] == [("egress_blocked", "sandbox", "epoch.ai", 443, "web_search_agent", 1)], egress
    assert egress[0]["verdict"] == "denied" and "no network" in egress[0]["reason"]
