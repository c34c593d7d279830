"""`orchestrator runs export-traces RUN`: send a run's kept trace to a collector again."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..records.handles import resolve_run
from .common import tidy_store
from .output import print_json, say


def add_export_traces_parser(rsub: Any, run_argument: Any, run_help: str) -> None:
    p = rsub.add_parser(
        "export-traces",
        help="send a run's OpenTelemetry trace (kept in its record) to an OTLP collector",
        description="Send the trace a traced run kept in its record (the run's root span, its "
        "agents' spans, its model calls) to an OTLP/HTTP collector: again, or for the first "
        "time when the collector was down during the run. The same trace and span ids each "
        "time.",
    )
    run_argument(p, "run_id", help=run_help)
    p.add_argument(
        "--to",
        metavar="URL",
        dest="to",
        help="the collector, e.g. http://127.0.0.1:6006 (Phoenix) or "
        "http://collector:4318/v1/traces (default: OTEL_EXPORTER_OTLP_ENDPOINT)",
    )
    p.add_argument("--json", action="store_true", help="print {run_id, exported, ...} as JSON")
    p.set_defaults(handler=cmd_export_traces)


def cmd_export_traces(args: argparse.Namespace) -> int:
    from ..records.otlp import trace_target
    from ..records.store import Store
    from ..records.traces import export_recorded

    tidy_store()
    store = Store()
    row = resolve_run(store, args.run_id)
    target = trace_target(args.to)
    if target is None:
        raise ConfigError(
            "No collector to send the trace to.",
            "Give one with --to URL (e.g. http://127.0.0.1:6006), or set "
            "OTEL_EXPORTER_OTLP_ENDPOINT.",
        )
    outcome = export_recorded(Path(row["record_dir"]), target)
    if args.json:
        print_json({"run_id": row["run_id"], **outcome})
    elif outcome["exported"]:
        say(f"sent {outcome['spans']} span(s) of run {row['run_id']} to {outcome['endpoint']}")
    else:
        say(
            f"could not send the trace of run {row['run_id']} to {outcome['endpoint']}: "
            f"{outcome['error']}"
        )
    return 0 if outcome["exported"] else 1
