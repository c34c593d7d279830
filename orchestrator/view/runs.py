"""One run, read back for a page: its index row, result.json, events (as an agent tree) and
the end of its stderr. Files are read with bounds: a record is the sandbox's output and can
be large."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..records.record import agent_max_steps, describe_max_steps
from ..records.store import Store
from ..records.traces import read_trace
from .tree import AgentNode, build_tree, count_steps

#: The most of stderr a page shows (its end: where tracebacks are).
STDERR_TAIL = 256 * 1024
#: Events read from one record (a runaway stream stays bounded on the page too).
MAX_EVENTS = 20000
#: Spans of a run's trace the page lists (the rest are counted).
MAX_SPAN_ROWS = 500


@dataclass
class RunView:
    row: dict[str, Any]
    result: dict[str, Any] | None
    tree: AgentNode
    steps: int
    events: int
    egress_blocked: list[dict[str, Any]] = field(default_factory=list)
    #: Where the interceptor put each bound secret's value (`secret_injected`: name, host,
    #: place, requests; never a value), beside its refusals in `egress_blocked`.
    secrets_injected: list[dict[str, Any]] = field(default_factory=list)
    host_tokens: dict[str, int] | None = None
    reported_tokens: dict[str, Any] = field(default_factory=dict)
    stderr: str = ""
    stderr_cut: int = 0
    violations: list[dict[str, Any]] = field(default_factory=list)
    #: The run's trace as indented rows (`span_rows`), when it was traced.
    spans: list[dict[str, Any]] = field(default_factory=list)
    spans_total: int = 0
    #: Each agent's effective max_steps and who set it (`describe_max_steps`), from the
    #: record's `run_start`: shown while the run goes on too.
    max_steps: str | None = None

    @property
    def ended(self) -> bool:
        return self.row.get("ended_at") is not None

    @property
    def answer(self) -> Any:
        if self.result is not None:
            return self.result.get("answer")
        raw = self.row.get("answer")
        try:
            return None if raw is None else json.loads(raw)
        except ValueError:
            return raw


def read_events(directory: Path) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    try:
        with open(directory / "events.jsonl", encoding="utf-8", errors="replace") as file:
            for line in file:
                if len(events) >= MAX_EVENTS:
                    break
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a line being written right now
                if isinstance(event, dict):
                    events.append(event)
    except OSError:
        pass
    return events


def read_tail(path: Path, limit: int = STDERR_TAIL) -> tuple[str, int]:
    """The last `limit` bytes of a file as text, and how many bytes came before them."""
    try:
        with open(path, "rb") as file:
            file.seek(0, 2)
            size = file.tell()
            file.seek(max(0, size - limit))
            data = file.read()
    except OSError:
        return "", 0
    return data.decode("utf-8", errors="replace"), max(0, size - limit)


def host_token_usage(result: dict[str, Any] | None, events: list[dict[str, Any]]) -> dict | None:
    """Token counts the host measured itself through the run's model gateway, when it had one
    (`token_usage_source: gateway` in result.json; the gateway's `model_call` events while the
    run is still going); None when only the sandbox's own claim exists."""
    if result and result.get("token_usage_source") == "gateway":
        usage = dict(result.get("token_usage") or {})
        usage["calls"] = (result.get("gateway") or {}).get("calls")
        return usage
    calls = [e for e in events if e.get("type") == "model_call" and e.get("source") == "gateway"]
    if not calls:
        return None
    return {
        "input_tokens": sum(int(e.get("input_tokens") or 0) for e in calls),
        "output_tokens": sum(int(e.get("output_tokens") or 0) for e in calls),
        "calls": len(calls),
    }


def reported_token_usage(result: dict[str, Any] | None) -> dict[str, Any]:
    """What the sandbox itself claimed (beside a measured figure, or alone)."""
    result = result or {}
    if result.get("token_usage_source") == "gateway":
        return dict(result.get("token_usage_reported") or {})
    return dict(result.get("token_usage") or {})


def span_rows(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A trace as rows, each span after its parent, children by start time: `depth`,
    `name`, `kind` (OpenInference's, else the source), `ms`, `tokens`, `status`, `flagged`."""
    children: dict[Any, list[dict[str, Any]]] = {}
    ids = {span.get("span_id") for span in spans}
    for span in spans:
        parent = span.get("parent_span_id")
        children.setdefault(parent if parent in ids else None, []).append(span)
    rows: list[dict[str, Any]] = []
    pending = [(span, 0) for span in reversed(sorted_spans(children.get(None, [])))]
    while pending and len(rows) < MAX_SPAN_ROWS:
        span, depth = pending.pop()
        attributes = span.get("attributes") or {}
        rows.append(
            {
                "depth": depth,
                "indent": "\u00a0\u00a0" * min(depth, 30),
                "name": span.get("name"),
                "kind": attributes.get("openinference.span.kind") or span.get("source") or "",
                "ms": round((span.get("end_time", 0) - span.get("start_time", 0)) / 1e6, 1),
                "tokens": attributes.get("llm.token_count.total"),
                "status": (span.get("status") or {}).get("code"),
                "flagged": attributes.get("orchestrator.flagged"),
            }
        )
        below = sorted_spans(children.get(span.get("span_id"), []))
        pending += [(child, depth + 1) for child in reversed(below)]
    return rows


def sorted_spans(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(spans, key=lambda s: s.get("start_time") or 0)


def load_run(store: Store, run_id: str) -> RunView | None:
    row = store.get_run(run_id)
    if row is None:
        return None
    directory = Path(row["record_dir"])
    try:
        result = Store.read_result(directory)
    except (OSError, ValueError):
        result = None
    events = read_events(directory)
    tree = build_tree(events)
    stderr, cut = read_tail(directory / "stderr.log")
    spans = read_trace(directory)
    return RunView(
        row=row,
        result=result,
        tree=tree,
        steps=count_steps(tree),
        events=len(events),
        egress_blocked=[e for e in events if e.get("type") in ("egress_blocked", "egress_failed")][
            :200
        ],
        secrets_injected=[e for e in events if e.get("type") == "secret_injected"][:200],
        host_tokens=host_token_usage(result, events),
        reported_tokens=reported_token_usage(result),
        stderr=stderr,
        stderr_cut=cut,
        violations=[e for e in events if e.get("type") == "protocol_violation"][:50],
        spans=span_rows(spans or []),
        spans_total=len(spans or []),
        max_steps=describe_max_steps(agent_max_steps(events)),
    )
