"""`orchestrator runs ...`: read run records."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from ..errors import OrchestratorError
from ..spec import EXIT_CODES
from .common import tidy_store


def add_runs_parser(sub: Any) -> None:
    p = sub.add_parser("runs", help="read run records")
    rsub = p.add_subparsers(title="runs commands", metavar="ACTION")
    ls = rsub.add_parser("list", help="recent runs, newest first")
    ls.add_argument("--limit", type=int, default=20)
    ls.add_argument("--status", choices=[*EXIT_CODES])
    ls.add_argument("--schedule", help="only runs fired by this schedule")
    ls.add_argument("--batch", help="only runs of this batch")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(handler=cmd_runs_list)
    show = rsub.add_parser("show", help="a run's result (id or unique prefix)")
    show.add_argument("run_id")
    show.add_argument("--json", action="store_true")
    show.set_defaults(handler=cmd_runs_show)
    logs = rsub.add_parser("logs", help="a run's events and logs")
    logs.add_argument("run_id")
    logs.add_argument("--stream", choices=["events", "stderr", "stdout"], default="events")
    logs.add_argument("--json", action="store_true", help="raw JSON lines for events")
    logs.set_defaults(handler=cmd_runs_logs)
    p.set_defaults(handler=lambda a: (p.print_help(), 2)[1])


def _find_run(run_id: str) -> dict[str, Any]:
    tidy_store()
    from ..store import Store

    row = Store().get_run(run_id)
    if row is None:
        raise OrchestratorError(
            f"No run {run_id!r} in this store.", "List runs with `orchestrator runs list`."
        )
    return row


def cmd_runs_list(args: argparse.Namespace) -> int:
    from ..store import Store

    tidy_store()
    rows = Store().list_runs(
        limit=args.limit, status=args.status, schedule=args.schedule, batch=args.batch
    )
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    for row in rows:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["created_at"]))
        duration = f"{row['duration']:.1f}s" if row.get("duration") is not None else "-"
        status = f"{row['status']:<11}"
        print(f"{row['run_id']}  {created}  {status} {duration:>7}  {row['payload']}", row["model"])
    return 0


def cmd_runs_show(args: argparse.Namespace) -> int:
    from ..store import Store

    row = _find_run(args.run_id)
    result = Store.read_result(row["record_dir"]) or row
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        for key in (
            "run_id",
            "status",
            "answer",
            "error",
            "payload",
            "model",
            "network",
            "record_dir",
        ):
            print(f"{key:>10}: {result.get(key)}")
    return 0


def cmd_runs_logs(args: argparse.Namespace) -> int:
    from .display import describe_event

    row = _find_run(args.run_id)
    name = {"events": "events.jsonl", "stderr": "stderr.log", "stdout": "stdout.log"}[args.stream]
    path = Path(row["record_dir"]) / name
    if not path.is_file():
        return 0
    for line in path.read_text().splitlines():
        if args.stream == "events" and not args.json:
            text = describe_event(json.loads(line))
            if text:
                print(text)
        else:
            print(line)
    return 0
