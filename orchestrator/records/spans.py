"""The sandbox's spans, taken as untrusted data: checked, masked, bounded and flagged.

The runtime writes the run's OpenTelemetry spans as `span` events (docs/PROTOCOL.md,
"Spans"); payload code can reach that channel, so every field is checked here as the record
receives it: a span is rebuilt from what is well-formed (ids, times, kind, status, scalar
attributes), masked with the run's secrets, cut to the per-span bounds, and kept only while
the run's count and byte bounds last. What was cut, dropped or malformed is counted in
`SpanCollector.flags`; `place` then ties each span into the host's trace (its root span),
flagging spans outside it (`fake_root`), with a parent that is not in the run
(`wrong_parent`) or an id already taken (`duplicate_id`). Spans never touch a run's status.

Plain data and the standard library: the record imports this for every run; OpenTelemetry
itself is imported only to export (traces.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from typing import Any

from orchestrator_runtime.masking import Masker
from orchestrator_runtime.protocol import (
    MAX_ATTRIBUTE_CHARS,
    MAX_SPAN_ATTRIBUTES,
    MAX_SPAN_BYTES,
    MAX_SPAN_EVENTS,
)

from ..errors import ConfigError

#: How many spans of the sandbox one run keeps, and how many MiB of them (the environment
#: overrides both, within the ranges).
MAX_SPANS_ENV, MAX_SPANS_DEFAULT, MAX_SPANS_RANGE = "ORCHESTRATOR_MAX_SPANS", 5000, (1, 100_000)
MAX_TRACE_MB_ENV, MAX_TRACE_MB_DEFAULT = "ORCHESTRATOR_MAX_TRACE_MB", 32
MAX_TRACE_MB_RANGE = (1, 1024)
#: OpenTelemetry's span kinds and status codes (anything else becomes the first).
KINDS = ("INTERNAL", "SERVER", "CLIENT", "PRODUCER", "CONSUMER")
STATUS_CODES = ("UNSET", "OK", "ERROR")
#: The longest span name and attribute key kept.
MAX_NAME_CHARS = 200
#: The flags a run's trace may carry (`RunResult.traces["flags"]`), each a count.
FLAGS = {
    "malformed": "span events that were not spans (bad ids, times or fields), fixed or dropped",
    "attribute_cut": "attribute values cut to the longest kept",
    "span_cut": "spans whose attributes or events were cut to the per-span bounds",
    "dropped": "spans dropped beyond the run's count or size bound",
    "fake_root": "spans outside the run's trace or without a parent, put under its root",
    "wrong_parent": "spans whose parent is not a span of the run, put under its root",
    "duplicate_id": "spans whose id was already taken, given a new one",
}


def limit_from_env(name: str, default: int, allowed: tuple[int, int]) -> int:
    """A whole number within `allowed` from the environment, else `default`; ConfigError
    for anything else."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    low, high = allowed
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise ConfigError(
            f"{name}={raw!r} is not a whole number from {low} to {high}.",
            f"Set it within that range, or unset it for the default ({default}).",
        )
    return int(raw)


def trace_ids(run_id: str) -> tuple[str, str]:
    """The run's trace id and its root span's id, derived from the run id: the runtime is
    told them, and exporting the run again later gives the very same trace."""
    digest = hashlib.sha256(f"orchestrator-trace:{run_id}".encode()).hexdigest()
    return digest[:32], digest[32:48]


def span_id_of(*parts: str) -> str:
    """A stable span id for a host span (a gateway call: run id and call number)."""
    return hashlib.sha256(":".join(("orchestrator-span", *parts)).encode()).hexdigest()[:16]


def is_hex_id(value: Any, length: int) -> bool:
    return (
        isinstance(value, str)
        and len(value) == length
        and all(c in "0123456789abcdef" for c in value)
        and value.strip("0") != ""
    )


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | bool | int | float)


class SpanCollector:
    """The sandbox's spans of one run, as the record receives them (see the module)."""

    def __init__(self, masker: Masker) -> None:
        self.masker = masker
        try:
            self.max_spans = limit_from_env(MAX_SPANS_ENV, MAX_SPANS_DEFAULT, MAX_SPANS_RANGE)
            mb = limit_from_env(MAX_TRACE_MB_ENV, MAX_TRACE_MB_DEFAULT, MAX_TRACE_MB_RANGE)
        except ConfigError:  # refused before the run (traces.check_limits); never here
            self.max_spans, mb = MAX_SPANS_DEFAULT, MAX_TRACE_MB_DEFAULT
        self.max_bytes = mb * 1024 * 1024
        self.spans: list[dict[str, Any]] = []
        self.bytes = 0
        self.received = 0
        self.flags: Counter[str] = Counter()

    def add(self, event: dict[str, Any]) -> None:
        """Take one `span` event (its frame checked already): keep it, cut, or drop it."""
        self.received += 1
        if len(self.spans) >= self.max_spans or self.bytes >= self.max_bytes:
            self.flags["dropped"] += 1
            return
        span = self.masker.clean(self.rebuild(event))
        size = len(json.dumps(span, default=str))
        if size > MAX_SPAN_BYTES:
            self.flags["span_cut"] += 1
            span, size = fit(span)
        if self.bytes + size > self.max_bytes:
            self.flags["dropped"] += 1
            return
        self.bytes += size
        self.spans.append(span)

    def rebuild(self, event: dict[str, Any]) -> dict[str, Any]:
        """A span of the well-formed parts of `event` (the rest fixed, and flagged)."""
        bad = False
        name = event.get("name")
        if not isinstance(name, str) or not name:
            name, bad = "span", True
        ids: dict[str, str | None] = {}
        for key, length in (("trace_id", 32), ("span_id", 16), ("parent_span_id", 16)):
            value = event.get(key)
            if value is None and key == "parent_span_id":
                ids[key] = None
            elif is_hex_id(value, length):
                ids[key] = value
            else:
                ids[key], bad = None, True
        ts = event.get("ts")
        start: int = int(float(ts) * 1e9) if isinstance(ts, float) and ts > 0 else time.time_ns()
        end = start
        if _is_time(event.get("start_time")):
            start = end = int(event["start_time"])
        else:
            bad = True
        if _is_time(event.get("end_time")) and event["end_time"] >= start:
            end = int(event["end_time"])
        else:
            bad = True
        kind = event.get("kind") if event.get("kind") in KINDS else "INTERNAL"
        raw_status = event.get("status")
        status: dict[str, Any] = raw_status if isinstance(raw_status, dict) else {}
        code = status.get("code") if status.get("code") in STATUS_CODES else "UNSET"
        message = status.get("message") if isinstance(status.get("message"), str) else None
        raw_events = event.get("events")
        events: list[Any] = raw_events if isinstance(raw_events, list) else []
        if len(events) > MAX_SPAN_EVENTS:
            self.flags["span_cut"] += 1
        kept_events = [
            {
                "name": str(item.get("name"))[:MAX_NAME_CHARS],
                "time": int(item["time"]) if _is_time(item.get("time")) else start,
                "attributes": self.attributes(item.get("attributes")),
            }
            for item in events[:MAX_SPAN_EVENTS]
            if isinstance(item, dict)
        ]
        if bad:
            self.flags["malformed"] += 1
        return {
            "name": name[:MAX_NAME_CHARS],
            **ids,
            "kind": kind,
            "start_time": start,
            "end_time": end,
            "status": {"code": code, "message": (message or "")[:MAX_ATTRIBUTE_CHARS] or None},
            "attributes": self.attributes(event.get("attributes")),
            "events": kept_events,
        }

    def attributes(self, raw: Any) -> dict[str, Any]:
        """Scalar values (and lists of them) under string keys, at most MAX_SPAN_ATTRIBUTES,
        strings cut to MAX_ATTRIBUTE_CHARS; other values become their JSON text."""
        if not isinstance(raw, dict):
            return {}
        kept: dict[str, Any] = {}
        for key, value in list(raw.items())[:MAX_SPAN_ATTRIBUTES]:
            if not _scalar(value) and not (
                isinstance(value, list) and all(_scalar(v) and v is not None for v in value)
            ):
                value = json.dumps(value, default=str)
            if isinstance(value, str) and len(value) > MAX_ATTRIBUTE_CHARS:
                value = value[:MAX_ATTRIBUTE_CHARS]
                self.flags["attribute_cut"] += 1
            elif isinstance(value, list) and sum(len(str(v)) for v in value) > MAX_ATTRIBUTE_CHARS:
                value = [str(v)[:MAX_NAME_CHARS] for v in value[:MAX_SPAN_ATTRIBUTES]]
                self.flags["attribute_cut"] += 1
            if value is not None:
                kept[str(key)[:MAX_NAME_CHARS]] = value
        if len(raw) > MAX_SPAN_ATTRIBUTES:
            self.flags["span_cut"] += 1
        return kept


def _is_time(value: Any) -> bool:
    """A time in nanoseconds (or seconds, for an event's `ts`) that JSON can hold."""
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < 2**63


def fit(span: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """Drop the span's events, then its largest attributes, until its JSON fits
    MAX_SPAN_BYTES; the span and its size."""
    span = {**span, "events": [], "attributes": dict(span["attributes"])}
    attributes = span["attributes"]
    sizes = {key: len(json.dumps(value, default=str)) for key, value in attributes.items()}
    size = len(json.dumps(span, default=str))
    cut = []
    while size > MAX_SPAN_BYTES and sizes:
        key = max(sizes, key=sizes.__getitem__)
        size -= sizes.pop(key) + len(json.dumps(key)) + 2
        del attributes[key]
        cut.append(key)
    attributes["orchestrator.cut"] = sorted(cut)
    return span, len(json.dumps(span, default=str))


def place(
    spans: list[dict[str, Any]], trace_id: str, root_id: str, taken: set[str]
) -> Counter[str]:
    """Tie the sandbox's spans into the run's trace, in place: each gets the run's trace id
    and a parent that is the root (`root_id`) or another of these spans. A span outside the
    trace or without a parent (`fake_root`), with a parent that is none of those
    (`wrong_parent`), or with an id that is taken (`duplicate_id`: by a host span in `taken`,
    or an earlier span; it gets a new one) is flagged, on itself (`orchestrator.flagged`)
    and in the counts returned."""
    flags: Counter[str] = Counter()
    ids = set(taken) | {root_id}
    for number, span in enumerate(spans):
        if span["span_id"] is None or span["span_id"] in ids:
            if span["span_id"] is not None:
                _flag(span, "duplicate_id", flags)
            span["span_id"] = span_id_of(trace_id, "sandbox", str(number))
        ids.add(span["span_id"])
    own = {span["span_id"] for span in spans}
    for span in spans:
        if span["trace_id"] != trace_id or span["parent_span_id"] is None:
            _flag(span, "fake_root", flags)
            span["parent_span_id"] = root_id
        elif span["parent_span_id"] != root_id and span["parent_span_id"] not in own:
            _flag(span, "wrong_parent", flags)
            span["parent_span_id"] = root_id
        span["trace_id"] = trace_id
    _break_cycles(spans, root_id, flags)
    return flags


def _break_cycles(spans: list[dict[str, Any]], root_id: str, flags: Counter[str]) -> None:
    """Spans that are their own ancestors (a forged loop) go under the root, flagged."""
    by_id = {span["span_id"]: span for span in spans}
    reaches_root: set[str] = {root_id}
    for span in spans:
        path: list[str] = []
        current = span["span_id"]
        while current not in reaches_root:
            if current in path:  # a loop: cut it at the span that closed it
                looped = by_id[path[-1]]
                _flag(looped, "wrong_parent", flags)
                looped["parent_span_id"] = root_id
                break
            path.append(current)
            current = by_id[current]["parent_span_id"]
        reaches_root.update(path)


def _flag(span: dict[str, Any], flag: str, flags: Counter[str]) -> None:
    flags[flag] += 1
    span["attributes"]["orchestrator.flagged"] = flag
