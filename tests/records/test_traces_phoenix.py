"""Traces in a real Arize Phoenix: Phoenix (`arize-phoenix`, in its
own virtualenv `.venv-phoenix`, made by scripts/setup.sh) is started on free ports with its
SQLite database in a temporary folder; runs export to its OTLP/HTTP endpoint, and its REST API
(`/v1/projects/default/spans`) is asked what it received. The trace is then opened in
Phoenix's own UI in headless Chromium and screenshotted (.ci/output/screenshots/)."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator import RunSpec, run
from orchestrator.payloads.manifest import load_manifest
from orchestrator.records.spans import trace_ids
from tests.chromium import headless_chromium
from tests.conftest import PAYLOADS, REPO, TEST_PAYLOADS, beside_interpreter, events_of, wait_for
from tests.model_server import ScriptedModelServer
from tests.records.test_traces import free_port

pytestmark = pytest.mark.docker

PHOENIX = beside_interpreter(".venv-phoenix", "phoenix", "TEST_PHOENIX")
RESEARCH = PAYLOADS / "research_team"
LEAKY = TEST_PAYLOADS / "leaky"
LEAKY_SECRET = "phoenix-leak-3f9a1c\nits second line"
SHOTS = REPO / ".ci" / "output" / "screenshots"


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Phoenix server of this test module: its base URL."""
    if not PHOENIX.exists():
        pytest.fail(f"{PHOENIX} is missing: run scripts/setup.sh (it installs arize-phoenix)")
    work = tmp_path_factory.mktemp("phoenix")
    port = free_port()
    env = {
        **os.environ,
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_PORT": str(port),
        "PHOENIX_GRPC_PORT": str(free_port()),
        "PHOENIX_WORKING_DIR": str(work),  # its SQLite database
        "PHOENIX_TELEMETRY_ENABLED": "false",
    }
    log = open(work / "phoenix.log", "wb")  # closed below
    proc = subprocess.Popen(
        [str(PHOENIX), "serve"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: proc.poll() is not None or healthy(url), timeout=180)
        assert proc.poll() is None, (work / "phoenix.log").read_text()[-3000:]
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def phoenix_spans(url: str, trace_id: str) -> list[dict[str, Any]]:
    """Every span Phoenix holds of the trace (its REST API, page by page)."""
    spans: list[dict[str, Any]] = []
    cursor = None
    while True:
        query = f"?limit=1000{'&cursor=' + cursor if cursor else ''}"
        with urllib.request.urlopen(f"{url}/v1/projects/default/spans{query}") as response:
            page = json.loads(response.read())
        spans += [s for s in page["data"] if s["context"]["trace_id"] == trace_id]
        cursor = page.get("next_cursor")
        if not cursor:
            return spans


def scripted(folder: Path) -> list[str]:
    """A payload's mock trajectory in the order one shared model is asked (one agent, or
    research_team's manager -> librarian -> manager)."""
    scripts = load_manifest(folder).mock_scripts
    if set(scripts) == {"manager", "librarian"}:
        manager, librarian = scripts["manager"], scripts["librarian"]
        return [manager[0], librarian[0], librarian[1], manager[1]]
    return scripts["manager"]


def ancestors(span: dict[str, Any], by_id: dict[str, dict[str, Any]]) -> list[str]:
    names = []
    parent = span["parent_id"]
    while parent in by_id:
        names.append(by_id[parent]["name"])
        parent = by_id[parent]["parent_id"]
    return names


@pytest.mark.browser
def test_a_multi_agent_run_is_one_trace_in_phoenix_with_measured_tokens_and_no_secret(
    phoenix: str, agent_image: str, nothing_left: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-phoenix-test-0b6f2d")
    monkeypatch.setenv("LEAKY_SECRET", LEAKY_SECRET)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    with ScriptedModelServer(scripted(RESEARCH)) as server:
        team = run(
            RunSpec(
                payload=RESEARCH,
                model="openai:scripted",
                api_base=server.api_base(),
                traces_to=phoenix,
            )
        )
        served = dict(server.usage)
    assert team.status == "succeeded", team.error
    assert team.traces["exported"] is True, team.traces
    trace_id, root_id = trace_ids(team.run_id)
    spans = wait_for(
        lambda: (s := phoenix_spans(phoenix, trace_id)) and len(s) == team.traces["spans"] and s,
        timeout=30,
    )
    by_id = {s["context"]["span_id"]: s for s in spans}

    # One trace, whose root is the run, with the host's figures.
    roots = [s for s in spans if s["parent_id"] is None]
    assert [r["context"]["span_id"] for r in roots] == [root_id]
    root = roots[0]
    assert root["name"] == "run research_team" and root["status_code"] == "OK"
    attrs = root["attributes"]
    assert attrs["orchestrator.status"] == "succeeded"
    assert attrs["orchestrator.backend"] == "docker" and attrs["orchestrator.run_id"] == team.run_id
    assert attrs["orchestrator.tokens.input"] == served["input_tokens"]
    assert attrs["orchestrator.token_usage_source"] == "gateway"
    assert (
        0
        < attrs["orchestrator.duration_seconds"]
        <= team.timings["ended"] - team.timings["created"] + 0.01
    )

    # The agents nested as they called each other: root > manager > its step > the
    # librarian (called from the manager's code) > its steps > its tools.
    manager = [s for s in spans if s["span_kind"] == "AGENT" and s["parent_id"] == root_id]
    assert len(manager) == 1
    librarian = [s for s in spans if s["name"] == "librarian.run"]
    assert len(librarian) == 1 and manager[0]["name"] in ancestors(librarian[0], by_id)
    lookups = [s for s in spans if s["name"] == "LandmarkLookupTool"]
    assert len(lookups) == 2
    assert all("librarian.run" in ancestors(s, by_id) for s in lookups)

    # LLM spans with the tokens the host measured (the gateway's calls, nested under them).
    llm = [s for s in spans if s["span_kind"] == "LLM"]
    calls = [e for e in events_of(team) if e["type"] == "model_call"]
    assert len(llm) == len(calls) == 4
    assert sorted(s["attributes"]["llm.token_count.prompt"] for s in llm) == sorted(
        c["input_tokens"] for c in calls
    )
    assert (
        sum(s["attributes"]["llm.token_count.completion"] for s in llm) == served["output_tokens"]
    )
    assert all(s["attributes"]["orchestrator.token_count_source"] == "gateway" for s in llm)
    gateway = [s for s in spans if s["name"].startswith("gateway POST")]
    assert len(gateway) == 4 and {by_id[g["parent_id"]]["span_kind"] for g in gateway} == {"LLM"}
    assert "librarian.run" in ancestors(gateway[1], by_id) or any(
        "librarian.run" in ancestors(g, by_id) for g in gateway
    )

    # A payload that prints its secret: not one attribute of its trace holds it.
    with ScriptedModelServer(scripted(LEAKY)) as server:
        leaky = run(
            RunSpec(
                payload=LEAKY,
                model="openai:scripted",
                api_base=server.api_base(),
                traces_to=phoenix,
            )
        )
    assert leaky.status == "succeeded", leaky.error
    leaky_trace, _ = trace_ids(leaky.run_id)
    leaked = wait_for(
        lambda: (
            (s := phoenix_spans(phoenix, leaky_trace)) and len(s) == leaky.traces["spans"] and s
        ),
        timeout=30,
    )
    text = json.dumps(leaked)
    assert "read_secret" in text  # the tool's span is there, with its output masked
    forms = [
        LEAKY_SECRET,
        *LEAKY_SECRET.splitlines(),
        base64.b64encode(LEAKY_SECRET.encode()).decode(),
    ]
    assert not [form for form in forms if form in text]
    assert "sk-phoenix-test" not in text + json.dumps(spans)

    screenshot(phoenix, trace_id)


def screenshot(url: str, trace_id: str) -> None:
    """The trace in Phoenix's UI, in headless Chromium: its page names the run's spans."""
    with headless_chromium(1600, 1000) as driver:
        with urllib.request.urlopen(f"{url}/v1/projects") as response:
            project = json.loads(response.read())["data"][0]["id"]
        page_url = f"{url}/projects/{project}/traces/{trace_id}"

        def shows_the_tree() -> bool:
            """The trace page, loaded again until its span tree is drawn: on a loaded
            machine Phoenix's first render can come up without it and never fill in."""
            driver.get(page_url)
            try:
                wait_for(lambda: "librarian.run" in driver.page_source, timeout=20)
            except AssertionError:
                return False
            return True

        wait_for(shows_the_tree, timeout=180)
        # the root span's details: its input (the task) and output (the answer)
        wait_for(lambda: "Golden Gate Bridge" in driver.page_source, timeout=60)
        SHOTS.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(SHOTS / "phoenix-trace.png"))
        page = driver.page_source
        assert "run research_team" in page and "CodeAgent.run" in page
