"""Traces of every run, relayed by the host: the sandbox's spans are untrusted data
(checked, masked, bounded, flagged, never the run's status), the host adds its root span and
the gateway's calls, and exports with OTLP; a collector that is down costs nothing but the
export, which `runs export-traces` makes later.

The host's checks are tested on forged data first, then end to end on the real engine with a
payload that forges spans every way it can, against a real OTLP/HTTP endpoint
(`tests/otlp_receiver.py`, decoding with OpenTelemetry's own protobuf classes). The test
against a real Phoenix server is `tests/records/test_traces_phoenix.py`.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from orchestrator import RunSpec, run
from orchestrator.errors import ConfigError
from orchestrator.records.otlp import trace_target
from orchestrator.records.spans import SpanCollector, place, trace_ids
from orchestrator_runtime.masking import Masker
from orchestrator_runtime.protocol import MAX_ATTRIBUTE_CHARS, MAX_SPAN_BYTES
from tests.conftest import PAYLOADS, TEST_PAYLOADS, cli, events_of
from tests.otlp_receiver import OtlpReceiver

FORGER = TEST_PAYLOADS / "span_forger"
RESEARCH = PAYLOADS / "research_team"
SECRET = "span-secret-7c1e9a\nsecond line of it"


def span(**fields: Any) -> dict[str, Any]:
    """A well-formed `span` event of the run `r-1`'s trace."""
    trace_id, root = trace_ids("r-1")
    event = {
        "type": "span",
        "seq": 0,
        "ts": 1.0,
        "run_id": "r-1",
        "name": "s",
        "trace_id": trace_id,
        "span_id": "1" * 16,
        "parent_span_id": root,
        "kind": "INTERNAL",
        "start_time": 10**18,
        "end_time": 10**18 + 5,
        "status": {"code": "OK", "message": None},
        "attributes": {},
        "events": [],
    }
    event.update(fields)
    return event


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---- the host's checks, on forged data ----------------------------------------------------------


def test_a_forged_span_is_rebuilt_masked_cut_and_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    collector = SpanCollector(Masker([SECRET]))
    collector.add(span(attributes={"told": f"it is {SECRET}", "blob": "y" * 900_000}))
    nested = {"nested": {"deep": [1, {"x": SECRET}]}}
    collector.add(
        span(
            name=["no"],
            trace_id=42,
            span_id=None,
            start_time="soon",
            status="ok",
            attributes=nested,
            events="many",
        )
    )
    collector.add(span(attributes={f"a{i}": "z" * 30_000 for i in range(20)}))
    kept = collector.spans
    assert len(kept) == 3
    text = json.dumps(kept)
    assert SECRET not in text and SECRET.splitlines()[0] not in text
    assert len(kept[0]["attributes"]["blob"]) == MAX_ATTRIBUTE_CHARS
    assert kept[1]["name"] == "span" and kept[1]["trace_id"] is None and kept[1]["events"] == []
    assert kept[1]["attributes"]["nested"].startswith('{"deep"')  # a JSON text, masked
    assert all(len(json.dumps(s)) <= MAX_SPAN_BYTES for s in kept)
    assert kept[2]["attributes"]["orchestrator.cut"]  # the largest attributes went
    assert collector.flags == {"attribute_cut": 1, "malformed": 1, "span_cut": 1}

    monkeypatch.setenv("ORCHESTRATOR_MAX_SPANS", "10")
    bounded = SpanCollector(Masker())
    for number in range(10_000):
        bounded.add(span(span_id=f"{number + 1:016x}"))
    assert len(bounded.spans) == 10 and bounded.received == 10_000
    assert bounded.flags == {"dropped": 9_990}


def test_spans_are_tied_into_the_runs_trace_and_every_forgery_is_flagged() -> None:
    trace_id, root = trace_ids("r-1")
    collector = SpanCollector(Masker())
    for fields in (
        {"name": "agent", "span_id": "a" * 16},  # under the root
        {"name": "step", "span_id": "b" * 16, "parent_span_id": "a" * 16},  # under the agent
        {"name": "stranger", "span_id": "c" * 16, "parent_span_id": "dead" * 4},
        {"name": "own root", "span_id": "d" * 16, "parent_span_id": None},
        {"name": "other trace", "span_id": "e" * 16, "trace_id": "f" * 32},
        {"name": "claims the root", "span_id": root, "parent_span_id": None},
        {"name": "twin", "span_id": "a" * 16},
        {"name": "loop 1", "span_id": "1" * 16, "parent_span_id": "2" * 16},
        {"name": "loop 2", "span_id": "2" * 16, "parent_span_id": "1" * 16},
    ):
        collector.add(span(**fields))
    spans = collector.spans
    flags = place(spans, trace_id, root, taken={"9" * 16})
    assert flags == {"wrong_parent": 2, "fake_root": 3, "duplicate_id": 2}
    by_name = {s["name"]: s for s in spans}
    assert by_name["step"]["parent_span_id"] == "a" * 16
    assert "orchestrator.flagged" not in by_name["agent"]["attributes"]
    assert by_name["stranger"]["attributes"]["orchestrator.flagged"] == "wrong_parent"
    assert by_name["other trace"]["attributes"]["orchestrator.flagged"] == "fake_root"
    ids = [s["span_id"] for s in spans]
    assert len(set(ids)) == len(ids) and root not in ids
    parents = {s["span_id"]: s["parent_span_id"] for s in spans}
    for start in ids:  # every span reaches the root, in at most as many steps as spans
        current, steps = start, 0
        while current != root:
            current, steps = parents[current], steps + 1
            assert steps <= len(ids)
    assert {s["trace_id"] for s in spans} == {trace_id}


def test_tracing_is_off_unless_a_flag_or_opentelemetrys_variables_say_where(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_SDK_DISABLED",
        "OTEL_TRACES_EXPORTER",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ):
        monkeypatch.delenv(name, raising=False)
    assert trace_target(None) is None
    target = trace_target("http://127.0.0.1:6006")
    assert target is not None and target.endpoint == "http://127.0.0.1:6006/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "https://user:pw@collector:4318/")
    target = trace_target(None)
    assert target is not None and target.endpoint == "https://user:pw@collector:4318/v1/traces"
    assert target.shown == "https://collector:4318/v1/traces"  # the record keeps no password
    assert trace_target("off") is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:4318/custom")
    assert trace_target(None).endpoint == "http://c:4318/custom"  # type: ignore[union-attr]
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert trace_target(None) is None
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ConfigError, match="http/protobuf"):
        trace_target(None)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL")
    monkeypatch.setenv("ORCHESTRATOR_MAX_SPANS", "0")
    with pytest.raises(ConfigError, match="ORCHESTRATOR_MAX_SPANS"):
        trace_target(None)
    monkeypatch.delenv("ORCHESTRATOR_MAX_SPANS")
    with pytest.raises(ConfigError, match="not an OTLP/HTTP collector URL"):
        trace_target("ftp://somewhere")


def test_a_bad_collector_url_is_refused_before_anything_starts() -> None:
    out = cli("run", str(RESEARCH), "--traces-to", "collector:4318")
    assert out.returncode == 2, out.stderr
    assert "not an OTLP/HTTP collector URL" in out.stderr


# ---- the runtime's spans, on this host ---------------------------------------------------------


def test_the_runtime_writes_the_agents_spans_under_the_hosts_root_with_secrets_masked() -> None:
    from tests.runtime.test_runtime import build_request, run_runtime

    trace = {"trace_id": "4bf92f3577b34da6a3ce929d0e0e4736", "parent_span_id": "00f067aa0ba902b7"}
    team = run_runtime(build_request(RESEARCH, trace=trace), args=("--preload", "traces"))
    assert team.end["state"] == "success"
    spans = team.of_type("span")
    by_id = {s["span_id"]: s for s in spans}
    assert {s["trace_id"] for s in spans} == {trace["trace_id"]}
    tops = [s for s in spans if s["parent_span_id"] not in by_id]
    assert [(s["name"], s["parent_span_id"]) for s in tops] == [
        ("CodeAgent.run", trace["parent_span_id"])
    ]
    librarian = next(s for s in spans if s["name"] == "librarian.run")
    chain, parent = [], librarian["parent_span_id"]
    while parent in by_id:
        chain.append(by_id[parent]["name"])
        parent = by_id[parent]["parent_span_id"]
    assert chain[-1] == "CodeAgent.run"  # the librarian runs inside the manager's step
    llm = [s for s in spans if s["attributes"].get("openinference.span.kind") == "LLM"]
    assert len(llm) == 4 and all(s["attributes"]["llm.token_count.total"] > 0 for s in llm)
    assert team.end is team.events[-1] and spans  # every span came before the run's end

    leaky = build_request(TEST_PAYLOADS / "leaky", trace=trace, secrets={"LEAKY_SECRET": SECRET})
    told = run_runtime(leaky)
    assert told.end["state"] == "success" and told.of_type("span")
    assert all(line not in told.stdout for line in SECRET.splitlines())

    untraced = run_runtime(build_request(RESEARCH))
    assert untraced.end["state"] == "success" and not untraced.of_type("span")


def test_the_root_span_carries_what_the_egress_proxies_recorded() -> None:
    """Refusals (squid's, and a bound secret's placeholder where it may not go), failures and
    where each bound secret was injected become events of the host's root span, at their
    time, bounded; other events and fields do not."""
    from orchestrator.records.traces import (
        EGRESS_ATTRIBUTE_CHARS,
        MAX_EGRESS_EVENTS,
        egress_events,
    )

    events = [
        {"type": "step", "ts": 1.0, "agent": "manager"},
        {
            "type": "secret_injected",
            "secret": "ANALYTICS_TOKEN",
            "host": "api.example.com",
            "place": "header:X-Api-Key",
            "count": 2,
            "first_ts": 2.0,
            "agent": "manager",
            "step_number": 1,
        },
        {
            "type": "egress_blocked",
            "reason": "secret_not_bound",
            "secret": "ANALYTICS_TOKEN",
            "host": "other.example.net",
            "place": "query",
            "detail": "x" * (MAX_ATTRIBUTE_CHARS + 10),
            "ts": 3.0,
            "forged": {"nested": True},
        },
        {"type": "egress_failed", "host": "pinned.example", "reason": "pins", "ts": "late"},
    ]
    made = egress_events(events, started=0.5)
    assert [(e["name"], e["time"]) for e in made] == [
        ("secret_injected", 2 * 10**9),
        ("egress_blocked", 3 * 10**9),
        ("egress_failed", 5 * 10**8),  # no usable time: the run's start
    ]
    injected, refused, _ = (e["attributes"] for e in made)
    assert injected == {
        "orchestrator.egress.host": "api.example.com",
        "orchestrator.egress.secret": "ANALYTICS_TOKEN",
        "orchestrator.egress.place": "header:X-Api-Key",
        "orchestrator.egress.count": 2,
        "orchestrator.egress.agent": "manager",
        "orchestrator.egress.step_number": 1,
    }
    assert refused["orchestrator.egress.reason"] == "secret_not_bound"
    assert len(refused["orchestrator.egress.detail"]) == EGRESS_ATTRIBUTE_CHARS
    assert not [k for k in refused if "forged" in k]
    many = [{"type": "egress_blocked", "host": "h", "ts": 1.0}] * (MAX_EGRESS_EVENTS + 5)
    assert len(egress_events(many, 0.0)) == MAX_EGRESS_EVENTS


# ---- end to end on the real engine ---------------------------------------------------------------


@pytest.mark.docker
def test_a_sandbox_that_forges_spans_cannot_change_its_run_or_pass_the_bounds(
    agent_image: str, nothing_left: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Acceptance 2: a wrong parent, a fake root (its own trace; the host's root id), huge
    attributes, the secret, malformed fields, a parent loop and ten thousand spans."""
    monkeypatch.setenv("SPAN_SECRET", SECRET)
    with OtlpReceiver() as receiver:
        result = run(RunSpec(payload=FORGER, traces_to=receiver.url))
        received = list(receiver.spans)
    assert result.status == "succeeded", result.error
    assert result.answer == "forged 10007 spans"
    traces = result.traces
    assert traces["exported"] is True, traces
    kept = traces["sandbox_spans"]
    assert kept["received"] > 10_000 and kept["kept"] == 5000  # the default bound
    flags = traces["flags"]
    for flag in (
        "dropped",
        "fake_root",
        "wrong_parent",
        "duplicate_id",
        "malformed",
        "attribute_cut",
    ):
        assert flags.get(flag), (flag, flags)
    flagged = [e for e in events_of(result) if e["type"] == "spans_flagged"]
    assert len(flagged) == 1 and flagged[0]["source"] == "host"
    assert not [e for e in events_of(result) if e["type"] == "span"]  # not in the events

    trace_id, root = trace_ids(result.run_id)
    assert len(received) == traces["spans"] == 5001
    assert {s["trace_id"] for s in received} == {trace_id}
    roots = [s for s in received if s["parent_span_id"] is None]
    assert [r["span_id"] for r in roots] == [root]
    assert roots[0]["attributes"]["orchestrator.status"] == "succeeded"
    assert roots[0]["resource"]["service.name"] == "orchestrator"
    ids = {s["span_id"] for s in received}
    assert len(ids) == len(received) and all(
        s["parent_span_id"] in ids for s in received if s is not roots[0]
    )
    text = json.dumps(received)
    assert all(line not in text for line in SECRET.splitlines())
    longest = max(len(str(v)) for s in received for v in s["attributes"].values())
    assert longest <= MAX_ATTRIBUTE_CHARS
    saved = Path(result.record_dir) / "trace.json"
    assert saved.stat().st_size < 32 * 1024 * 1024

    # `view` shows the trace and what was flagged (its static export: the same pages).
    exported = cli("view", "--export", str(tmp_path / "pages"), result.run_id)
    assert exported.returncode == 0, exported.stderr
    page = (tmp_path / "pages" / f"run-{result.run_id}.html").read_text()
    assert "5001 spans" in page and "fake_root" in page and "wrong_parent" in page
    assert "run span_forger" in page and "the first 500 of 5001 spans" in page
    assert all(line not in page for line in SECRET.splitlines())


@pytest.mark.docker
def test_with_the_collector_down_runs_succeed_and_export_traces_sends_them_later(
    agent_image: str, nothing_left: None
) -> None:
    """Acceptance 3."""
    down = f"http://127.0.0.1:{free_port()}"
    result = run(RunSpec(payload=RESEARCH, traces_to=down))
    assert result.status == "succeeded", result.error
    traces = result.traces
    assert traces["exported"] is False and traces["endpoint"] == f"{down}/v1/traces"
    assert "Connection" in traces["error"] or "refused" in traces["error"], traces
    note = [e for e in events_of(result) if e["type"] == "traces_not_exported"]
    assert len(note) == 1 and note[0]["endpoint"] == f"{down}/v1/traces"
    shown = cli("runs", "show", result.run_id)
    assert "NOT exported" in shown.stdout, shown.stdout

    with OtlpReceiver() as receiver:
        sent = cli("runs", "export-traces", result.run_id, "--to", receiver.url, "--json")
        assert sent.returncode == 0, sent.stderr
        assert json.loads(sent.stdout)["exported"] is True
        again = cli("runs", "export-traces", result.run_id, "--to", receiver.url)
        assert again.returncode == 0, again.stderr
        received = list(receiver.spans)
    assert receiver.requests == 2 and len(received) == 2 * traces["spans"]
    names = {s["name"] for s in received}
    assert {"run research_team", "CodeAgent.run", "librarian.run"} <= names
    saved = json.loads((Path(result.record_dir) / "result.json").read_text())
    assert saved["traces"]["exported"] is True and saved["status"] == "succeeded"

    untraced = run(RunSpec(payload=RESEARCH, traces_to="off"))
    assert untraced.traces == {}
    refused = cli("runs", "export-traces", untraced.run_id, "--to", "http://127.0.0.1:9")
    assert refused.returncode == 2 and "has no trace" in refused.stderr


@pytest.mark.docker
def test_a_batch_gives_one_trace_per_task_tagged_with_the_batch_and_the_task(
    agent_image: str, nothing_left: None, tmp_path: Path
) -> None:
    from tests.batch.test_session import MATH, math_rows, write_jsonl

    tasks = write_jsonl(tmp_path / "tasks.jsonl", math_rows(3))
    with OtlpReceiver() as receiver:
        done = cli(
            "batch",
            str(MATH),
            str(tasks),
            "-o",
            str(tmp_path / "out"),
            "--json",
            "--traces-to",
            receiver.url,
        )
        assert done.returncode == 0, done.stderr
        received = list(receiver.spans)
    batch_id = json.loads(done.stdout)["batch_id"]
    roots = [s for s in received if s["parent_span_id"] is None]
    assert sorted(r["attributes"]["orchestrator.task_id"] for r in roots) == [
        "q000",
        "q001",
        "q002",
    ]
    assert {r["attributes"]["orchestrator.batch_id"] for r in roots} == {batch_id}
    assert {r["attributes"]["session.id"] for r in roots} == {batch_id}  # Phoenix's sessions
    assert len({r["trace_id"] for r in roots}) == 3  # one trace per task
    by_trace = {r["trace_id"]: r for r in roots}
    assert all(s["trace_id"] in by_trace for s in received)
    assert {r["attributes"]["orchestrator.status"] for r in roots} == {"succeeded"}


def test_a_run_without_tracing_never_imports_opentelemetry() -> None:
    """Cold start: the host imports OpenTelemetry only to export (otlp.py)."""
    import subprocess
    import sys

    code = (
        "import sys, orchestrator.lifecycle.runner, orchestrator.cli, orchestrator.batch, "
        "orchestrator.view.runs\n"
        "print([m for m in sys.modules if m.startswith(('opentelemetry', 'openinference', "
        "'google.protobuf'))])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
