"""Sending spans with OTLP: where to (`--traces-to`, or OpenTelemetry's environment
variables), and the official exporter, given our spans as the SDK's ReadableSpans.

`trace_target` reads `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else `OTEL_EXPORTER_OTLP_ENDPOINT`
+ `/v1/traces`, and the protocol (`http/protobuf`, or `grpc` when its exporter is installed);
`OTEL_SDK_DISABLED=true` and `OTEL_TRACES_EXPORTER=none` switch tracing off. The exporter
reads the rest itself (headers, certificates, compression, timeout). An export is tried once
per run (a down collector costs a run about a second; then BACKOFF_SECONDS of skipped
exports), and its reason for failing is kept, not printed.

OpenTelemetry is imported inside the functions that export: a run without tracing never
imports it (`orchestrator run`'s cold start).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ..errors import ConfigError
from ..paths import VERSION
from .spans import (
    MAX_SPANS_DEFAULT,
    MAX_SPANS_ENV,
    MAX_SPANS_RANGE,
    MAX_TRACE_MB_DEFAULT,
    MAX_TRACE_MB_ENV,
    MAX_TRACE_MB_RANGE,
    limit_from_env,
)

#: The service name of every exported span.
SERVICE_NAME = "orchestrator"
#: The OTLP protocols we export with (OpenTelemetry's names); grpc needs its own exporter.
PROTOCOLS = ("http/protobuf", "grpc")
#: The export's time limit when OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT does not set one: a run's
#: end waits for it, so a collector that does not answer costs little.
DEFAULT_TIMEOUT_SECONDS = 3.0
#: After a failed export, runs of this process skip exporting to that endpoint for this
#: long (a batch against a down collector waits once, not once a task); `export-traces`
#: sends their traces later.
BACKOFF_SECONDS = 30.0


@dataclass(frozen=True)
class TraceTarget:
    """Where a run's trace is exported: the OTLP traces URL, its protocol, who said so."""

    endpoint: str
    protocol: str = "http/protobuf"
    source: str = "--traces-to"

    @property
    def shown(self) -> str:
        """The endpoint as the record shows it (no user info, no query)."""
        parts = urlsplit(self.endpoint)
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port else host
        return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def traces_url(url: str) -> str:
    """An OTLP/HTTP traces URL from a collector's base URL or its traces URL."""
    url = url.strip()
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"{url!r} is not an OTLP/HTTP collector URL.",
            "Give an http(s) URL, e.g. http://127.0.0.1:6006 (Phoenix) or "
            "http://collector:4318/v1/traces.",
        )
    if parts.path.rstrip("/").endswith("/v1/traces"):
        return url
    return url.rstrip("/") + "/v1/traces"


def trace_target(traces_to: str | None) -> TraceTarget | None:
    """Where to export (None: tracing is off), from `--traces-to` (a URL or `off`), else
    OpenTelemetry's environment variables. Raises ConfigError for a bad URL or protocol, or
    span bounds out of range: checked before a run starts."""
    limit_from_env(MAX_SPANS_ENV, MAX_SPANS_DEFAULT, MAX_SPANS_RANGE)
    limit_from_env(MAX_TRACE_MB_ENV, MAX_TRACE_MB_DEFAULT, MAX_TRACE_MB_RANGE)
    env = os.environ
    if traces_to is not None and traces_to.strip().lower() == "off":
        return None
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    ) or "http/protobuf"
    if traces_to:
        return TraceTarget(traces_url(traces_to), "http/protobuf", "--traces-to")
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        name, endpoint = (
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"],
        )
    elif env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        name = "OTEL_EXPORTER_OTLP_ENDPOINT"
        endpoint = env[name]
        if protocol != "grpc":
            endpoint = traces_url(endpoint)
    else:
        return None
    protocol = protocol.strip().lower()
    if protocol not in PROTOCOLS:
        raise ConfigError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: the orchestrator exports traces with "
            f"{' or '.join(PROTOCOLS)}.",
            "Set it to http/protobuf (the default; Phoenix, Langfuse and the OpenTelemetry "
            "Collector accept it), or unset it.",
        )
    if protocol == "grpc":
        try:
            import opentelemetry.exporter.otlp.proto.grpc  # noqa: F401
        except ImportError:
            raise ConfigError(
                f"{name} asks for OTLP over grpc, and its exporter is not installed.",
                "pip install opentelemetry-exporter-otlp-proto-grpc, or set "
                "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf.",
            ) from None
    return TraceTarget(endpoint.strip(), protocol, name)


_lock = threading.Lock()
#: endpoint -> (until when exports to it are skipped, why).
_unreachable: dict[str, tuple[float, str]] = {}


class _Errors(logging.Handler):
    """What the OTLP exporter logged during one export in this thread (it returns only
    SUCCESS or FAILURE; the reason is in its log)."""

    local = threading.local()

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING and hasattr(self.local, "lines"):
            self.local.lines.append(record.getMessage())


_ERRORS = _Errors()


def export(
    spans: list[dict[str, Any]], target: TraceTarget, *, retry: bool = False
) -> dict[str, Any]:
    """Send the spans to the target with the official OTLP exporter, once: `{exported,
    endpoint, error}`. `retry`: ignore an earlier failure to that endpoint (export-traces)."""
    shown = target.shown
    with _lock:
        down = _unreachable.get(target.endpoint)
    if down is not None and down[0] > time.monotonic() and not retry:
        return {"exported": False, "endpoint": shown, "error": f"not tried: {down[1]}"}
    try:
        exporter = _exporter_of(target)
        readable = to_readable(spans)
    except Exception as exc:
        return {"exported": False, "endpoint": shown, "error": f"{type(exc).__name__}: {exc}"}
    _ERRORS.local.lines = []
    try:
        ok = exporter.export(readable).name == "SUCCESS"
    except Exception as exc:
        ok = False
        _ERRORS.local.lines.append(f"{type(exc).__name__}: {exc}")
    finally:
        lines: list[str] = _ERRORS.local.__dict__.pop("lines", [])
    if ok:
        with _lock:
            _unreachable.pop(target.endpoint, None)
        return {"exported": True, "endpoint": shown, "error": None}
    reason = "; ".join(dict.fromkeys(lines)) or "the collector did not accept the spans"
    reason = reason[:1000]
    with _lock:
        _unreachable[target.endpoint] = (time.monotonic() + BACKOFF_SECONDS, reason)
    return {"exported": False, "endpoint": shown, "error": reason}


#: Each thread's exporters by target (their HTTP sessions keep the collector's connection open
#: from one run to the next; a requests session is not shared between threads).
_exporters = threading.local()


def _exporter_of(target: TraceTarget) -> Any:
    made: dict[TraceTarget, Any] = _exporters.__dict__.setdefault("by_target", {})
    if target not in made:
        made[target] = _exporter(target)
    return made[target]


def _exporter(target: TraceTarget) -> Any:
    logger = logging.getLogger("opentelemetry.exporter")
    if _ERRORS not in logger.handlers:  # the reasons go to the record, not the terminal
        logger.addHandler(_ERRORS)
        logger.propagate = False
    env = os.environ
    timeout_env = env.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") or env.get(
        "OTEL_EXPORTER_OTLP_TIMEOUT"
    )
    timeout = None if timeout_env else DEFAULT_TIMEOUT_SECONDS
    if target.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=target.endpoint, timeout=timeout)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=target.endpoint, timeout=timeout)


def to_readable(spans: list[dict[str, Any]]) -> list[Any]:
    """Our spans as the OpenTelemetry SDK's ReadableSpans (what exporters take)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

    resource = Resource.create({"service.name": SERVICE_NAME})
    scopes = {
        source: InstrumentationScope(f"orchestrator.{source}", VERSION)
        for source in ("host", "gateway", "sandbox")
    }
    sampled = TraceFlags(TraceFlags.SAMPLED)
    readable = []
    for span in spans:
        trace_id = int(span["trace_id"], 16)
        parent = span.get("parent_span_id")
        status: dict[str, Any] = span.get("status") or {}
        code = StatusCode[status.get("code") or "UNSET"]
        readable.append(
            ReadableSpan(
                name=span["name"],
                context=SpanContext(trace_id, int(span["span_id"], 16), False, sampled),
                parent=SpanContext(trace_id, int(parent, 16), False, sampled) if parent else None,
                resource=resource,
                attributes=span.get("attributes") or {},
                events=[
                    Event(e["name"], e.get("attributes") or {}, int(e["time"]))
                    for e in span.get("events") or []
                ],
                kind=SpanKind[span.get("kind") or "INTERNAL"],
                status=Status(code, status.get("message") if code is StatusCode.ERROR else None),
                start_time=int(span["start_time"]),
                end_time=int(span["end_time"]),
                instrumentation_scope=scopes.get(span.get("source") or "sandbox"),
            )
        )
    return readable
