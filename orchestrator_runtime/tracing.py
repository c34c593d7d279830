"""OpenTelemetry spans of the run, written to the event channel (never to the network).

When the request has a `trace` (`trace_id`, `parent_span_id`: the host's root span of the
run), the runtime turns on the smolagents instrumentation that smolagents' docs recommend
(`openinference-instrumentation-smolagents`: agent, chain, LLM and tool spans with their
inputs and outputs, OpenInference's conventions) with an exporter that writes each finished
span as one `span` event. The sandbox has no route to a collector and gets none: the host
relays the spans it receives, after its own checks (docs/PROTOCOL.md, "Spans").

The manager's run is started inside the host's trace (its root span as the remote parent),
so every span of the tree is that root's descendant. Bounds kept here so that a legitimate
span always fits one frame: attribute values are cut at MAX_ATTRIBUTE_CHARS, a span keeps
MAX_SPAN_ATTRIBUTES attributes and MAX_SPAN_EVENTS events, and one whose JSON is still over
MAX_SPAN_BYTES loses its largest attributes (marked `orchestrator.truncated`). The host
checks everything again: payload code can reach this exporter.

Imported only when a request asks for traces, or ahead (`--preload traces`: a pooled sandbox
pays while it idles, a cold one while the host ships the request): OpenTelemetry and the
instrumentation take about a third of smolagents' own import time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from openinference.instrumentation.smolagents import SmolagentsInstrumentor
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from .events import EventStream
from .protocol import MAX_ATTRIBUTE_CHARS, MAX_SPAN_ATTRIBUTES, MAX_SPAN_BYTES, MAX_SPAN_EVENTS


def span_fields(span: ReadableSpan) -> dict[str, Any]:
    """One finished span as the `span` event's fields (docs/PROTOCOL.md)."""
    context = span.get_span_context()
    parent = span.parent
    fields: dict[str, Any] = {
        "name": span.name,
        "trace_id": format(context.trace_id, "032x") if context else None,
        "span_id": format(context.span_id, "016x") if context else None,
        "parent_span_id": format(parent.span_id, "016x") if parent else None,
        "kind": span.kind.name,
        "start_time": span.start_time,
        "end_time": span.end_time,
        "status": {"code": span.status.status_code.name, "message": span.status.description},
        "attributes": {key: _value(value) for key, value in (span.attributes or {}).items()},
        "events": [
            {
                "name": event.name,
                "time": event.timestamp,
                "attributes": {k: _value(v) for k, v in (event.attributes or {}).items()},
            }
            for event in span.events[:MAX_SPAN_EVENTS]
        ],
    }
    return fit(fields)


def _value(value: Any) -> Any:
    """An attribute value as JSON (OpenTelemetry's are scalars or sequences of them)."""
    if isinstance(value, str | bool | int | float) or value is None:
        return value
    return [item for item in value]


def fit(fields: dict[str, Any]) -> dict[str, Any]:
    """Drop the largest attributes until the span's JSON fits MAX_SPAN_BYTES."""
    attributes = fields["attributes"]
    size = len(json.dumps(fields, default=str))
    dropped = []
    while size > MAX_SPAN_BYTES and attributes:
        key = max(attributes, key=lambda k: len(json.dumps(attributes[k], default=str)))
        size -= len(json.dumps(attributes.pop(key), default=str))
        dropped.append(key)
    if size > MAX_SPAN_BYTES:
        fields["events"] = []
    if dropped:
        attributes["orchestrator.truncated"] = sorted(dropped)
    return fields


class EventSpanExporter(SpanExporter):
    """Each finished span as a `span` event on the run's event stream."""

    def __init__(self, events: EventStream) -> None:
        self.events = events

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for span in spans:
            self.events.emit("span", **span_fields(span))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        """Nothing to close: the event stream is the run's."""


class Tracing:
    """The run's tracer provider, its smolagents instrumentation and the host's parent."""

    def __init__(self, events: EventStream, trace_id: str, parent_span_id: str) -> None:
        limits = SpanLimits(
            max_attributes=MAX_SPAN_ATTRIBUTES,
            max_events=MAX_SPAN_EVENTS,
            max_attribute_length=MAX_ATTRIBUTE_CHARS,
            max_event_attributes=MAX_SPAN_ATTRIBUTES,
        )
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": "orchestrator-sandbox"}), span_limits=limits
        )
        # Simple, not batched: each span is written when it ends, from the thread that ended
        # it, so every span is on the channel before the run's end (no exporter thread).
        self.provider.add_span_processor(SimpleSpanProcessor(EventSpanExporter(events)))
        # The payload's own spans (trace.get_tracer(...)) join the run's trace too.
        trace.set_tracer_provider(self.provider)
        SmolagentsInstrumentor().instrument(tracer_provider=self.provider)
        trace_scripted_model(self.provider)
        self.parent = SpanContext(
            trace_id=int(trace_id, 16),
            span_id=int(parent_span_id, 16),
            is_remote=True,
            trace_flags=TraceFlags(TraceFlags.SAMPLED),
        )

    @contextmanager
    def under_host_root(self) -> Iterator[None]:
        """Spans started inside are children of the host's root span of the run."""
        token = otel_context.attach(trace.set_span_in_context(NonRecordingSpan(self.parent)))
        try:
            yield
        finally:
            otel_context.detach(token)
            self.provider.force_flush()


def trace_scripted_model(provider: TracerProvider) -> None:
    """The `mock` provider's model calls as LLM spans too (OpenInference's attributes): the
    instrumentation wraps the model classes smolagents exports, and ours is not one of them."""
    from .models import ScriptedModel

    tracer = provider.get_tracer("orchestrator_runtime.models")
    generate = ScriptedModel.generate

    def traced(self: Any, messages: Any, *args: Any, **kwargs: Any) -> Any:
        with tracer.start_as_current_span("ScriptedModel.generate") as span:
            span.set_attribute("openinference.span.kind", "LLM")
            span.set_attribute("llm.model_name", str(self.model_id))
            span.set_attribute("input.value", json.dumps(messages, default=str))
            message = generate(self, messages, *args, **kwargs)
            span.set_attribute("output.value", str(message.content))
            usage = message.token_usage
            if usage is not None:
                span.set_attribute("llm.token_count.prompt", usage.input_tokens)
                span.set_attribute("llm.token_count.completion", usage.output_tokens)
                span.set_attribute("llm.token_count.total", usage.total_tokens)
            return message

    ScriptedModel.generate = traced  # type: ignore[method-assign]
