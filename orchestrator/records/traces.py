"""A run's trace: the host's root span, the gateway's model calls and the sandbox's spans,
kept in the run record (`trace.json`) and exported with OTLP where the user points.

Tracing is off unless configured (`--traces-to URL`, or OpenTelemetry's own environment
variables: otlp.py). The sandbox never reaches the collector: the host relays its spans
(spans.py checks them) under its own root span, whose figures are the host's (status,
duration, tokens measured by the gateway), and the gateway's model calls are spans of the
host too. An export that fails never fails the run: `RunResult.traces` says what was not
exported, and `orchestrator runs export-traces ID` sends `trace.json` again.

Nothing here imports OpenTelemetry (otlp.py does, when it exports).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator_runtime.protocol import MAX_ATTRIBUTE_CHARS

from ..errors import ConfigError
from ..gateway import measured_usage
from ..spec import RunResult, RunSpec
from .otlp import TraceTarget, export
from .record import RunRecorder
from .spans import FLAGS, place, span_id_of, trace_ids

#: The record file that keeps the run's trace.
TRACE_FILE = "trace.json"
#: How close (seconds) a gateway call must lie within a sandbox LLM span to be its call.
MATCH_SLACK_SECONDS = 0.25
#: The host's egress records that become events of the root span, and how many it keeps.
EGRESS_EVENTS = ("egress_blocked", "egress_failed", "secret_injected")
MAX_EGRESS_EVENTS = 200
#: Each text attribute of one, cut: a refused host or Host header is the sandbox's to choose,
#: and the root span stays small (at most about 1 MB of them).
EGRESS_ATTRIBUTE_CHARS = 512
#: Their fields that become the span event's attributes (`orchestrator.egress.FIELD`);
#: never a value: the interceptor reports none.
EGRESS_FIELDS = (
    "host",
    "port",
    "reason",
    "detail",
    "secret",
    "place",
    "count",
    "method",
    "agent",
    "step_number",
)


def trace_request(run_id: str, target: TraceTarget | None) -> dict[str, str]:
    """The request's `trace` field: the run's trace and root span (empty: no spans)."""
    if target is None:
        return {}
    trace_id, root_id = trace_ids(run_id)
    return {"trace_id": trace_id, "parent_span_id": root_id}


# ---- the run's trace, assembled at its end ---------------------------------------------------


@dataclass(frozen=True)
class RunContext:
    """What the host knows of a run beyond its result, for its root span."""

    task: str
    batch: str | None = None
    task_id: str | None = None
    schedule: str | None = None

    @classmethod
    def of(cls, spec: RunSpec, task: str) -> RunContext:
        return cls(task, spec.batch, spec.task_id, spec.schedule)


def ns(seconds: float) -> int:
    return int(seconds * 1e9)


def egress_events(events: list[dict[str, Any]], started: float) -> list[dict[str, Any]]:
    """What the run's egress proxies recorded, as events of the root span: squid's and the
    interceptor's refusals (`egress_blocked`, `secret_not_bound` with the secret's name and
    place), failures (`egress_failed`) and where each bound secret was injected
    (`secret_injected`), the first `MAX_EGRESS_EVENTS`, each at its time."""
    kept: list[dict[str, Any]] = []
    for event in events:
        if event.get("type") not in EGRESS_EVENTS or len(kept) >= MAX_EGRESS_EVENTS:
            continue
        at = event.get("first_ts", event.get("ts"))
        attributes: dict[str, Any] = {}
        for key in EGRESS_FIELDS:
            value = event.get(key)
            if isinstance(value, str):
                attributes[f"orchestrator.egress.{key}"] = value[:EGRESS_ATTRIBUTE_CHARS]
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                attributes[f"orchestrator.egress.{key}"] = value
        time_ = ns(float(at)) if isinstance(at, (int, float)) else ns(started)
        kept.append({"name": str(event["type"]), "time": time_, "attributes": attributes})
    return kept


def root_span(
    result: RunResult,
    context: RunContext,
    tokens: dict[str, Any],
    events: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The run as the host saw it: the trace's root, with its egress records as events."""
    trace_id, root_id = trace_ids(result.run_id)
    timings = result.timings
    started = float(timings.get("created") or time.time())
    ended = float(timings.get("ended") or started)
    attributes: dict[str, Any] = {
        "openinference.span.kind": "CHAIN",
        "input.value": context.task[:MAX_ATTRIBUTE_CHARS],
        "orchestrator.run_id": result.run_id,
        "orchestrator.payload": result.payload,
        "orchestrator.model": result.model,
        "orchestrator.backend": result.backend,
        "orchestrator.network": result.network,
        "orchestrator.status": result.status,
        "orchestrator.duration_seconds": round(ended - started, 3),
        "orchestrator.warm": result.warm,
        "orchestrator.token_usage_source": tokens["source"],
        "orchestrator.tokens.input": int(tokens.get("input_tokens") or 0),
        "orchestrator.tokens.output": int(tokens.get("output_tokens") or 0),
        "orchestrator.tokens.total": int(tokens.get("total_tokens") or 0),
    }
    if result.answer is not None:
        answer = result.answer
        text = answer if isinstance(answer, str) else json.dumps(answer, default=str)
        attributes["output.value"] = text[:MAX_ATTRIBUTE_CHARS]
    if result.error:
        attributes["orchestrator.error.type"] = result.error.type
        attributes["orchestrator.error.message"] = result.error.message[:4096]
    for key, value in (
        ("orchestrator.batch_id", context.batch),
        ("session.id", context.batch),  # Phoenix shows a batch's traces as one session
        ("orchestrator.task_id", context.task_id),
        ("orchestrator.schedule", context.schedule),
    ):
        if value:
            attributes[key] = value
    ok = result.status == "succeeded"
    error = result.error
    message = None if ok else ((error.message if error else "") or result.status)[:4096]
    return {
        "name": f"run {result.payload}",
        "trace_id": trace_id,
        "span_id": root_id,
        "parent_span_id": None,
        "kind": "INTERNAL",
        "start_time": ns(started),
        "end_time": ns(ended),
        "status": {"code": "OK" if ok else "ERROR", "message": message},
        "attributes": attributes,
        "events": egress_events(events or [], started),
        "source": "host",
    }


def gateway_spans(
    result: RunResult, events: list[dict[str, Any]], sandbox: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The model gateway's calls (and refusals) as spans, each under the sandbox's LLM span
    that made it when one holds it in time, else under the root. Each measured call is
    counted once in `llm.token_count.*`: on the LLM span that made it (the sandbox's own
    figures kept as `orchestrator.sandbox_reported.*`), else on the call's own span."""
    trace_id, root_id = trace_ids(result.run_id)
    llm = [s for s in sandbox if s["attributes"].get("openinference.span.kind") == "LLM"]
    for span in sandbox:  # the sandbox's figures are its claim; the gateway's are measured
        for key in [k for k in span["attributes"] if k.startswith("llm.token_count.")]:
            span["attributes"][f"orchestrator.sandbox_reported.{key}"] = span["attributes"].pop(key)
    for span in llm:
        span["attributes"]["orchestrator.token_count_source"] = "gateway"
    measured: dict[str, Counter[str]] = {}
    spans: list[dict[str, Any]] = []
    calls = [e for e in events if e.get("source") == "gateway" and isinstance(e.get("ts"), float)]
    for number, call in enumerate(c for c in calls if c.get("type") in GATEWAY_CALLS):
        start = float(call["ts"])
        end = start + float(call.get("latency_ms") or 0) / 1000
        made_by = _holding(llm, start, end, measured)
        tokens = {
            "prompt": int(call.get("input_tokens") or 0),
            "completion": int(call.get("output_tokens") or 0),
        }
        tokens["total"] = tokens["prompt"] + tokens["completion"]
        attributes: dict[str, Any] = {
            "http.request.method": str(call.get("method") or "POST"),
            "url.path": str(call.get("path") or ""),
            "http.response.status_code": int(call.get("status") or 0),
            "orchestrator.gateway.latency_ms": float(call.get("latency_ms") or 0),
            "orchestrator.gateway.input_tokens": tokens["prompt"],
            "orchestrator.gateway.output_tokens": tokens["completion"],
        }
        for key in ("first_byte_ms", "streamed", "usage_unknown", "reason", "error"):
            if call.get(key) is not None:
                attributes[f"orchestrator.gateway.{key}"] = call[key]
        if made_by is not None:
            measured.setdefault(made_by["span_id"], Counter()).update(tokens)
        elif call["type"] == "model_call":  # no LLM span of the sandbox holds it
            attributes["openinference.span.kind"] = "LLM"
            attributes.update({f"llm.token_count.{k}": v for k, v in tokens.items()})
        failed = call["type"] != "model_call" or int(call.get("status") or 0) >= 400
        spans.append(
            {
                "name": f"gateway {call.get('method') or 'POST'} {call.get('path') or ''}".strip(),
                "trace_id": trace_id,
                "span_id": span_id_of(result.run_id, "gateway", str(number)),
                "parent_span_id": made_by["span_id"] if made_by else root_id,
                "kind": "CLIENT",
                "start_time": ns(start),
                "end_time": ns(end),
                "status": {"code": "ERROR" if failed else "OK", "message": None},
                "attributes": attributes,
                "events": [],
                "source": "gateway",
            }
        )
    for span in llm:
        counts = measured.get(span["span_id"])
        if counts is None:
            span["attributes"]["orchestrator.token_count_source"] = "none (no gateway call)"
            continue
        span["attributes"].update({f"llm.token_count.{k}": v for k, v in counts.items()})
    return spans


#: The gateway reports that become spans.
GATEWAY_CALLS = ("model_call", "model_call_refused")


def _holding(
    llm: list[dict[str, Any]], start: float, end: float, matched: dict[str, Any]
) -> dict[str, Any] | None:
    """The LLM span that made the call [start, end]: the innermost one whose time holds it
    (within a few milliseconds), else, within MATCH_SLACK_SECONDS, the nearest one not yet
    matched (clocks of sandbox and gateway may differ a little)."""
    first, last = ns(start), ns(end)
    exact = [s for s in llm if s["start_time"] - ns(0.005) <= first and last <= s["end_time"]]
    if exact:
        return min(exact, key=lambda s: s["end_time"] - s["start_time"])
    slack = ns(MATCH_SLACK_SECONDS)
    near = [
        s
        for s in llm
        if s["span_id"] not in matched
        and s["start_time"] - slack <= first
        and last <= s["end_time"] + slack
    ]
    middle = first + last
    return min(near, key=lambda s: abs(s["start_time"] + s["end_time"] - middle), default=None)


def assemble(
    result: RunResult, record: RunRecorder, context: RunContext
) -> tuple[list[dict[str, Any]], Counter[str]]:
    """The run's whole trace (root first) and its flags."""
    trace_id, root_id = trace_ids(result.run_id)
    collector = record.spans
    sandbox = [{**span, "source": "sandbox"} for span in collector.spans]
    flags: Counter[str] = Counter(collector.flags)
    if result.gateway.get("enabled"):
        tokens: dict[str, Any] = {**measured_usage(record.events), "source": "gateway"}
        host = gateway_spans(result, record.events, sandbox)
    else:
        end = record.run_end or {}
        raw = end.get("token_usage")
        usage: dict[str, Any] = raw if isinstance(raw, dict) else {}
        tokens = {k: v for k, v in usage.items() if isinstance(v, int)}
        tokens["total_tokens"] = tokens.get("input_tokens", 0) + tokens.get("output_tokens", 0)
        tokens["source"] = "sandbox"
        host = []
    flags.update(place(sandbox, trace_id, root_id, {s["span_id"] for s in host}))
    root = record.masker.clean(root_span(result, context, tokens, record.events))
    return [root, *host, *sandbox], flags


def record_trace(
    result: RunResult, record: RunRecorder, context: RunContext, target: TraceTarget | None
) -> dict[str, Any]:
    """At a traced run's end (before its record is finished): assemble its trace, keep it in
    the record, export it to `target`; what `RunResult.traces` says of it. Never raises:
    a trace is an extra, never the run's outcome."""
    try:
        spans, flags = assemble(result, record, context)
    except Exception as exc:  # a bug here must not cost the run its record
        record.host_event("trace_failed", error=f"{type(exc).__name__}: {exc}")
        return {"error": f"the trace could not be assembled: {exc}"}
    collector = record.spans
    summary: dict[str, Any] = {
        "trace_id": spans[0]["trace_id"],
        "spans": len(spans),
        "sandbox_spans": {"received": collector.received, "kept": len(collector.spans)},
        "flags": dict(sorted(flags.items())),
    }
    if flags:
        record.host_event("spans_flagged", **summary["flags"], meaning={k: FLAGS[k] for k in flags})
    try:
        write_trace(Path(record.directory), spans)
    except OSError as exc:
        summary["error"] = f"{TRACE_FILE} could not be written: {exc.strerror or exc}"
    if target is not None:
        outcome = export(spans, target)
        summary.update(outcome)
        if not outcome["exported"]:
            record.host_event("traces_not_exported", endpoint=target.shown, error=outcome["error"])
    return summary


def write_trace(directory: Path, spans: list[dict[str, Any]]) -> None:
    path = directory / TRACE_FILE
    tmp = path.with_name(f".{TRACE_FILE}.tmp")
    tmp.write_text(json.dumps({"spans": spans}, default=str) + "\n")
    tmp.replace(path)


def read_trace(directory: Path) -> list[dict[str, Any]] | None:
    """The spans kept in a run's record, or None when it has none (run without tracing)."""
    try:
        data = json.loads((directory / TRACE_FILE).read_text())
    except (OSError, ValueError):
        return None
    spans = data.get("spans") if isinstance(data, dict) else None
    return spans if isinstance(spans, list) else None


def export_recorded(record_dir: Path, target: TraceTarget) -> dict[str, Any]:
    """Send a finished run's kept trace (`orchestrator runs export-traces`) and note the
    outcome in its result.json (`traces`: `exported`, `endpoint`, `error`, `exported_at`).
    Raises ConfigError when the run has no trace (it ran without tracing)."""
    spans = read_trace(record_dir)
    if not spans:
        raise ConfigError(
            f"The run in {record_dir} has no trace: it ran without tracing.",
            "Turn tracing on for later runs with --traces-to URL or OTEL_EXPORTER_OTLP_ENDPOINT.",
        )
    outcome = export(spans, target, retry=True)
    path = record_dir / "result.json"
    with contextlib.suppress(OSError, ValueError):
        result = json.loads(path.read_text())
        traces = result.get("traces") if isinstance(result.get("traces"), dict) else {}
        if outcome["exported"] or not traces.get("exported"):
            traces.update(outcome, exported_at=time.time() if outcome["exported"] else None)
        result["traces"] = traces
        tmp = path.with_name(".result.json.tmp")
        tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
        tmp.replace(path)
    return {**outcome, "spans": len(spans)}
