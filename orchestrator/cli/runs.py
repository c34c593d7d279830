"""`orchestrator runs ...`: read run records, and remove, prune or export them."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..housekeeping import STATUSES
from .common import tidy_store
from .output import (
    age,
    human_duration,
    local_time,
    print_fields,
    print_json,
    print_table,
    say,
)
from .parser import HELP

#: Seconds between looks at a followed run's files (`runs logs -f`).
FOLLOW_INTERVAL = 0.2


def add_runs_parser(sub: Any) -> None:
    p = sub.add_parser(
        "runs",
        help=HELP["runs"],
        description="Run records: one folder per run (events, logs, result.json) and a row in "
        "the store's index. A RUN is a run id, or a unique prefix or suffix of one.",
    )
    rsub = p.add_subparsers(title="runs commands", metavar="ACTION")
    ls = rsub.add_parser("list", help="recent runs, newest first")
    ls.add_argument("--limit", type=int, default=20, help="at most this many runs (0: all)")
    ls.add_argument(
        "--status", choices=STATUSES, metavar="STATUS",
        help=f"only runs with this status ({', '.join(STATUSES)})",
    )  # fmt: skip
    ls.add_argument("--schedule", help="only runs fired by this schedule")
    ls.add_argument("--batch", help="only runs of this batch")
    ls.add_argument("--json", action="store_true", help="print the rows as a JSON array")
    ls.set_defaults(handler=cmd_runs_list)

    show = rsub.add_parser("show", help="a run's result: status, answer, error, usage, limits")
    show.add_argument("run_id", metavar="RUN", help="run id, or a unique prefix or suffix")
    show.add_argument("--json", action="store_true", help="print result.json as it is")
    show.set_defaults(handler=cmd_runs_show)

    logs = rsub.add_parser("logs", help="a run's events (one line each) or its raw logs")
    logs.add_argument("run_id", metavar="RUN", help="run id, or a unique prefix or suffix")
    logs.add_argument(
        "--stream", choices=["events", "stderr", "stdout"], default="events",
        help="events: the event stream; stderr/stdout: the sandbox's own output",
    )  # fmt: skip
    logs.add_argument("--json", action="store_true", help="events as raw JSON lines")
    logs.add_argument(
        "--full", action="store_true",
        help="each step's code, model output, observations and error in full (no cutting)",
    )  # fmt: skip
    logs.add_argument(
        "--follow", "-f", action="store_true",
        help="keep printing as a live run writes, until it ends",
    )  # fmt: skip
    logs.set_defaults(handler=cmd_runs_logs)

    rm = rsub.add_parser("rm", help="remove runs (their records and index rows)")
    rm.add_argument("run_ids", nargs="+", metavar="RUN", help="run ids, prefixes or suffixes")
    rm.add_argument("--dry-run", action="store_true", help="say what would go; remove nothing")
    rm.add_argument("--json", action="store_true", help="print the removed ids as JSON")
    rm.set_defaults(handler=cmd_runs_rm)

    pr = rsub.add_parser(
        "prune",
        help="remove ended runs older than an age",
        description="Remove ended runs created before an age (records and index rows). Runs "
        "still going are never removed.",
    )
    pr.add_argument(
        "--older-than", required=True, metavar="AGE",
        help="45s, 90m, 12h, 30d or 2w (a bare number is days)",
    )  # fmt: skip
    pr.add_argument(
        "--status", action="append", choices=STATUSES, metavar="STATUS",
        help="only runs with this status; repeat for several (default: any ended run)",
    )  # fmt: skip
    pr.add_argument("--dry-run", action="store_true", help="say what would go; remove nothing")
    pr.add_argument("--json", action="store_true", help="print the removed runs as JSON")
    pr.set_defaults(handler=cmd_runs_prune)

    ex = rsub.add_parser("export", help="write a run's record as a .tar.gz archive")
    ex.add_argument("run_id", metavar="RUN", help="run id, or a unique prefix or suffix")
    ex.add_argument(
        "--output", "-o", metavar="PATH",
        help="archive file or folder (default: ./RUN_ID.tar.gz)",
    )  # fmt: skip
    ex.add_argument("--json", action="store_true", help="print {run_id, path} as JSON")
    ex.set_defaults(handler=cmd_runs_export)
    p.set_defaults(handler=lambda a: (p.print_help(), 2)[1])


def _store() -> Any:
    from ..store import Store

    tidy_store()
    return Store()


def cmd_runs_list(args: argparse.Namespace) -> int:
    store = _store()
    rows = store.list_runs(
        limit=args.limit, status=args.status, schedule=args.schedule, batch=args.batch
    )
    if args.json:
        print_json(rows)
        return 0
    if not rows:
        which = " matching these filters" if (args.status or args.schedule or args.batch) else ""
        say(f"no runs{which} in {store.root} (start one with `orchestrator run PAYLOAD`)")
        return 0
    print_table(
        ("RUN", "CREATED", "STATUS", "DURATION", "PAYLOAD", "MODEL", "NETWORK"),
        [
            (
                r["run_id"],
                local_time(r["created_at"]),
                r["status"],
                human_duration(r.get("duration")),
                r["payload"],
                r["model"],
                r["network"],
            )
            for r in rows
        ],
        right=("DURATION",),
    )
    return 0


def cmd_runs_show(args: argparse.Namespace) -> int:
    store = _store()
    row = store.resolve_run(args.run_id)
    result = store.read_result(row["record_dir"])
    if args.json:
        print_json(result or row)
        return 0
    print_fields(show_fields(row, result or {}))
    return 0


def show_fields(row: dict[str, Any], result: dict[str, Any]) -> list[tuple[str, Any]]:
    """What `runs show` prints, from the index row and result.json (absent ones left out)."""
    from ..record import describe_isolation

    r = {**row, **{k: v for k, v in result.items() if v not in (None, "", {}, [])}}
    timings = result.get("timings") or {}
    usage = result.get("token_usage") or {
        "input_tokens": row.get("input_tokens"),
        "output_tokens": row.get("output_tokens"),
    }
    tokens = (
        f"{usage.get('input_tokens') or 0} in · {usage.get('output_tokens') or 0} out"
        + (f" ({result['token_usage_source']})" if result.get("token_usage_source") else "")
        if any(v is not None for v in usage.values())
        else None
    )
    error = r.get("error")
    if isinstance(error, dict):
        error = f"{error.get('type')}: {error.get('message')}"
    answer = r.get("answer")
    if answer is not None and not isinstance(answer, str):
        answer = json.dumps(answer, default=str)
    duration = timings.get("duration", row.get("duration"))
    ended = timings.get("ended", row.get("ended_at"))
    return [
        ("run", r["run_id"]),
        ("status", r.get("status")),
        ("exit code", row.get("exit_code") if row.get("exit_code") is not None else None),
        ("payload", r.get("payload")),
        ("task", row.get("task")),
        ("answer", answer),
        ("error", error),
        ("model", r.get("model")),
        ("backend", r.get("backend")),
        ("network", r.get("network")),
        ("sandbox runtime", describe_isolation(result.get("sandbox"))),
        ("allowlist", ", ".join(result.get("allowlist") or []) or None),
        ("egress blocked", result.get("egress_blocked") or None),
        ("steps", result.get("steps") if result else None),
        ("tokens", tokens),
        ("tokens reported", _reported(result) if result.get("token_usage_mismatch") else None),
        ("model calls", (result.get("gateway") or {}).get("calls")),
        ("created", f"{local_time(row['created_at'])} ({age(row['created_at'])})"),
        ("ended", local_time(ended) if ended else None),
        ("duration", human_duration(duration) if duration is not None else None),
        ("schedule", row.get("schedule")),
        ("batch", row.get("batch")),
        ("image", result.get("image")),
        ("record", row.get("record_dir")),
    ]


def _reported(result: dict[str, Any]) -> str:
    """What the sandbox claimed, shown when it differs from what the gateway measured."""
    usage = result.get("token_usage_reported") or {}
    return f"{usage.get('input_tokens', 0)} in · {usage.get('output_tokens', 0)} out (sandbox)"


def cmd_runs_logs(args: argparse.Namespace) -> int:
    from .display import describe_event

    store = _store()
    row = store.resolve_run(args.run_id)
    name = {"events": "events.jsonl", "stderr": "stderr.log", "stdout": "stdout.log"}[args.stream]
    path = Path(row["record_dir"]) / name
    lines = follow(store, row["run_id"], path) if args.follow else read_lines(path)
    for line in lines:
        if args.stream == "events" and not args.json:
            try:
                text = describe_event(json.loads(line), full=args.full)
            except ValueError:
                text = line
            if text:
                print(text, flush=args.follow)
        else:
            print(line, flush=args.follow)
    return 0


def read_lines(path: Path) -> Iterator[str]:
    if path.is_file():
        with path.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                yield line.rstrip("\n")


def follow(store: Any, run_id: str, path: Path) -> Iterator[str]:
    """The file's lines as they are written, until the run has ended (or its orchestrator
    process is gone) and all is read."""
    from ..housekeeping import is_live

    position, partial = 0, ""
    while True:
        ended = not is_live(store.get_run(run_id) or {})
        if path.is_file():
            with path.open(encoding="utf-8", errors="replace") as f:
                f.seek(position)
                chunk = f.read()
                position = f.tell()
            *complete, partial = (partial + chunk).split("\n")
            yield from complete
        if ended:
            if partial:
                yield partial
            return
        time.sleep(FOLLOW_INTERVAL)


def cmd_runs_rm(args: argparse.Namespace) -> int:
    from ..housekeeping import remove_runs

    ids = remove_runs(_store(), args.run_ids, dry_run=args.dry_run)
    if args.json:
        print_json({"removed": ids, "dry_run": args.dry_run})
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for run_id in ids:
        print(f"{verb} {run_id}")
    return 0


def cmd_runs_prune(args: argparse.Namespace) -> int:
    from ..housekeeping import parse_age, prune_runs

    older = parse_age(args.older_than)
    rows = prune_runs(_store(), older_than=older, statuses=args.status or (), dry_run=args.dry_run)
    if args.json:
        print_json({"removed": [r["run_id"] for r in rows], "dry_run": args.dry_run})
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for r in rows:
        print(f"{verb} {r['run_id']}  {r['status']}  {local_time(r['created_at'])}")
    say(f"{verb} {len(rows)} run(s) older than {args.older_than}")
    return 0


def cmd_runs_export(args: argparse.Namespace) -> int:
    from ..housekeeping import export_run

    store = _store()
    path = export_run(store, args.run_id, args.output)
    if args.json:
        print_json({"run_id": store.resolve_run(args.run_id)["run_id"], "path": str(path)})
    else:
        print(path)
    return 0
