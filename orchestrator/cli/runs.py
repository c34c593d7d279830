"""`orchestrator runs ...`: read run records, and remove, prune or export them."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..records.handles import resolve_run
from ..records.housekeeping import STATUSES
from ..spec import RunError
from .common import tidy_store
from .output import (
    age,
    human_duration,
    local_time,
    print_fields,
    print_json,
    print_table,
    reader_gone,
    say,
)
from .parser import HELP
from .traces import add_export_traces_parser

#: Seconds between looks at a followed run's files (`runs logs -f`).
FOLLOW_INTERVAL = 0.2


def add_runs_parser(sub: Any) -> None:
    p = sub.add_parser(
        "runs",
        help=HELP["runs"],
        description="Run records: one folder per run (events, logs, result.json) and a row in "
        "the store's index. A RUN is a run id, a unique prefix or suffix of one, the start of "
        "its random tail, or @latest (the newest run).",
    )
    rsub = p.add_subparsers(title="runs commands", metavar="ACTION")
    _add_runs_list(rsub)
    _add_runs_show(rsub)
    _add_runs_logs(rsub)
    _add_runs_stop(rsub)
    _add_runs_rm(rsub)
    _add_runs_prune(rsub)
    _add_runs_export(rsub)
    add_export_traces_parser(rsub, run_argument, RUN_HELP)
    p.set_defaults(handler=lambda a: (p.print_help(), 2)[1])


def _add_runs_list(rsub: Any) -> None:
    """`runs list`."""
    ls = rsub.add_parser("list", help="recent runs, newest first")
    ls.add_argument("--limit", type=count, default=20, help="at most this many runs (0: all)")
    ls.add_argument(
        "--status",
        choices=STATUSES,
        metavar="STATUS",
        help=f"only runs with this status ({', '.join(STATUSES)})",
    )
    ls.add_argument("--schedule", help="only runs fired by this schedule")
    ls.add_argument(
        "--batch",
        metavar="BATCH",
        help="only runs of this batch: its output folder, its id, or a unique prefix or "
        "suffix of the id",
    )
    ls.add_argument(
        "--checks",
        action="store_true",
        help="list only check runs: the agent-tree loads of `validate` and of a batch's "
        "preflight (no step runs; hidden otherwise)",
    )
    ls.add_argument("--json", action="store_true", help="print the rows as a JSON array")
    ls.set_defaults(handler=cmd_runs_list)


def _add_runs_show(rsub: Any) -> None:
    """`runs show`."""
    show = rsub.add_parser("show", help="a run's result: status, answer, error, usage, limits")
    run_argument(show, "run_id", help=RUN_HELP)
    show.add_argument("--json", action="store_true", help="print result.json as it is")
    show.set_defaults(handler=cmd_runs_show)


def _add_runs_logs(rsub: Any) -> None:
    """`runs logs`."""
    logs = rsub.add_parser("logs", help="a run's events (one line each) or its raw logs")
    run_argument(logs, "run_id", help=RUN_HELP)
    logs.add_argument(
        "--stream",
        choices=["events", "stderr", "stdout"],
        default="events",
        help="events: the event stream; stderr/stdout: the sandbox's own output",
    )
    logs.add_argument("--json", action="store_true", help="events as raw JSON lines")
    logs.add_argument(
        "--full",
        action="store_true",
        help="each step's code, model output, observations and error in full (no cutting)",
    )
    logs.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="keep printing as a live run writes, until it ends",
    )
    logs.set_defaults(handler=cmd_runs_logs)


def _add_runs_stop(rsub: Any) -> None:
    """`runs stop`."""
    stop = rsub.add_parser(
        "stop",
        help="stop a running run (recorded cancelled, its sandbox removed)",
        description="Stop one running run of this store: its orchestrator process (a `run`, "
        "a batch or `schedule serve`) ends it as if cancelled and removes its sandbox; the "
        "process's other runs go on (a batch runs the task again in its next session).",
    )
    run_argument(stop, "run_id", help=RUN_HELP)
    stop.add_argument(
        "--wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long to wait for the run to end",
    )
    stop.add_argument("--json", action="store_true", help="print the run's row as JSON")
    stop.set_defaults(handler=cmd_runs_stop)


def _add_runs_rm(rsub: Any) -> None:
    """`runs rm`."""
    rm = rsub.add_parser("rm", help="remove runs (their records and index rows)")
    run_argument(rm, "run_ids", nargs="+", help="run ids, prefixes or suffixes")
    rm.add_argument("--dry-run", action="store_true", help="say what would go; remove nothing")
    rm.add_argument("--json", action="store_true", help="print the removed ids as JSON")
    rm.set_defaults(handler=cmd_runs_rm)


def _add_runs_prune(rsub: Any) -> None:
    """`runs prune`."""
    pr = rsub.add_parser(
        "prune",
        help="remove ended runs older than an age",
        description="Remove ended runs created before an age (records and index rows). Runs "
        "still going are never removed.",
    )
    pr.add_argument(
        "--older-than",
        required=True,
        metavar="AGE",
        help="45s, 90m, 12h, 30d or 2w (a bare number is days)",
    )
    pr.add_argument(
        "--status",
        action="append",
        choices=STATUSES,
        metavar="STATUS",
        help="only runs with this status; repeat for several (default: any ended run)",
    )
    pr.add_argument("--dry-run", action="store_true", help="say what would go; remove nothing")
    pr.add_argument("--json", action="store_true", help="print the removed runs as JSON")
    pr.set_defaults(handler=cmd_runs_prune)


def _add_runs_export(rsub: Any) -> None:
    """`runs export`."""
    ex = rsub.add_parser("export", help="write a run's record as a .tar.gz archive")
    run_argument(ex, "run_id", help=RUN_HELP)
    ex.add_argument(
        "--output",
        "-o",
        metavar="PATH",
        help="archive file, or folder to write RUN_ID.tar.gz in (default: ./RUN_ID.tar.gz); "
        "its folder must exist",
    )
    ex.add_argument("--force", action="store_true", help="replace an archive that exists")
    ex.add_argument("--json", action="store_true", help="print {run_id, path} as JSON")
    ex.set_defaults(handler=cmd_runs_export)


RUN_HELP = "run id, a unique prefix or suffix of one (or of its random tail), or @latest"


def run_argument(p: argparse.ArgumentParser, name: str, **kwargs: Any) -> None:
    """A RUN positional that the shell completes with run ids (not file names)."""
    action = p.add_argument(name, metavar="RUN", **kwargs)
    action.completer = complete_runs  # type: ignore[attr-defined]


def complete_runs(prefix: str, **_: Any) -> list[str]:
    """Shell completion of a RUN: recent run ids and @latest (argcomplete calls this)."""
    from ..records.store import LATEST, Store

    ids = [r["run_id"] for r in Store().list_runs(limit=200)]
    return [name for name in (LATEST, *ids) if name.startswith(prefix)]


def count(text: str) -> int:
    """A whole number from 0 up (argparse refuses the rest, naming the option)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is below 0; use 0 for all")
    return value


def _store() -> Any:
    from ..records.store import Store

    tidy_store()
    return Store()


def cmd_runs_list(args: argparse.Namespace) -> int:
    from ..records.handles import resolve_batch

    store = _store()
    rows = store.list_runs(
        limit=args.limit,
        status=args.status,
        schedule=args.schedule,
        batch=resolve_batch(store, args.batch) if args.batch else None,
        kind="check" if args.checks else "run",
    )
    if args.json:
        print_json(rows)
        return 0
    if not rows:
        filtered = args.status or args.schedule or args.batch or args.checks
        which = " matching these filters" if filtered else ""
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
    row = resolve_run(store, args.run_id)
    result = store.read_result(row["record_dir"])
    if args.json:
        print_json(result or row)
        return 0
    print_fields(show_fields(row, result or {}))
    return 0


def show_fields(row: dict[str, Any], result: dict[str, Any]) -> list[tuple[str, Any]]:
    """What `runs show` prints, from the index row and result.json (absent ones left out)."""
    from ..policy import hosts_line
    from ..records.record import describe_isolation, describe_max_steps

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
        error = str(RunError.from_dict(error))
    answer = r.get("answer")
    if answer is not None and not isinstance(answer, str):
        answer = json.dumps(answer, default=str)
    duration = timings.get("duration", row.get("duration"))
    ended = timings.get("ended", row.get("ended_at"))
    return [
        ("run", r["run_id"]),
        ("status", r.get("status")),
        ("kind", CHECK_KIND if row.get("kind") == "check" else None),
        ("exit code", row.get("exit_code") if row.get("exit_code") is not None else None),
        ("payload", r.get("payload")),
        ("task", row.get("task")),
        ("answer", answer),
        ("error", error),
        ("model", r.get("model")),
        ("backend", r.get("backend")),
        ("network", r.get("network")),
        ("sandbox runtime", describe_isolation(result.get("sandbox"))),
        ("node", _node(result.get("node"))),
        ("allowlist", hosts_line(result.get("allowlist") or []) or None),
        ("limits", _limits(result.get("limits"))),
        ("max steps", describe_max_steps(result.get("agent_max_steps"))),
        ("egress blocked", result.get("egress_blocked") or None),
        ("secrets", _injected(result.get("secrets_injected"))),
        ("steps", result.get("steps") if result else None),
        ("tokens", tokens),
        ("tokens reported", _reported(result) if result.get("token_usage_mismatch") else None),
        ("model calls", (result.get("gateway") or {}).get("calls")),
        ("trace", describe_trace(result.get("traces"))),
        ("created", f"{local_time(row['created_at'])} ({age(row['created_at'])})"),
        ("ended", local_time(ended) if ended else None),
        ("duration", human_duration(duration) if duration is not None else None),
        ("schedule", row.get("schedule")),
        ("batch", row.get("batch")),
        ("image", result.get("image")),
        ("record", row.get("record_dir")),
    ]


def _injected(entries: list[dict[str, Any]] | None) -> str | None:
    """`injected ANALYTICS_TOKEN api.example.com header:Authorization (3 requests); ...`:
    where the run's bound secrets went (never a value)."""
    lines = []
    for e in entries or []:
        times = f" ({e['count']} requests)" if (e.get("count") or 1) > 1 else ""
        lines.append(f"injected {e.get('secret')} {e.get('host')} {e.get('place')}{times}")
    return "; ".join(lines) or None


CHECK_KIND = (
    "check (the payload's agent tree loaded by `validate` or a batch's preflight; no step ran)"
)


def describe_trace(traces: dict[str, Any] | None) -> str | None:
    """`12 spans, exported to URL` / `not exported (why)` / `... flagged: 2 wrong_parent`."""
    if not traces:
        return None
    text = f"{traces.get('spans', 0)} spans ({traces.get('trace_id')})"
    if traces.get("exported"):
        text += f", exported to {traces.get('endpoint')}"
    elif traces.get("endpoint"):
        text += f", NOT exported to {traces.get('endpoint')}: {traces.get('error')}"
    flags = traces.get("flags") or {}
    if flags:
        text += "; flagged: " + ", ".join(f"{n} {k}" for k, n in flags.items())
    return text


def _limits(limits: dict[str, Any] | None) -> str | None:
    """`max_steps 6 · timeout 120s · memory 512 MiB · ...`, as the run had them (no
    `max_steps` when nobody set it: each agent kept its own, the `max steps` line)."""
    if not limits:
        return None
    units = {"timeout_seconds": ("timeout", "s"), "memory_mb": ("memory", " MiB")}
    parts = []
    for key, value in limits.items():
        if value is None:
            continue
        name, unit = units.get(key, (key, ""))
        shown = f"{value:g}" if isinstance(value, float) else value
        parts.append(f"{name} {shown}{unit}")
    return " · ".join(parts)


def _node(node: dict[str, Any] | None) -> str | None:
    """`Ray node 3f2a...c9 at 10.0.0.5 (gpu-box-2)`: where a run of a `--ray` batch ran."""
    if not node:
        return None
    return f"Ray node {node.get('node_id')} at {node.get('address')} ({node.get('hostname')})"


def _reported(result: dict[str, Any]) -> str:
    """What the sandbox claimed, shown when it differs from what the gateway measured."""
    usage = result.get("token_usage_reported") or {}
    return f"{usage.get('input_tokens', 0)} in · {usage.get('output_tokens', 0)} out (sandbox)"


def cmd_runs_logs(args: argparse.Namespace) -> int:
    from .display import describe_event, network_of

    store = _store()
    row = resolve_run(store, args.run_id)
    name = {"events": "events.jsonl", "stderr": "stderr.log", "stdout": "stdout.log"}[args.stream]
    path = Path(row["record_dir"]) / name
    lines = follow(store, row["run_id"], path) if args.follow else read_lines(path)
    network = row.get("network")
    for line in lines:
        if reader_gone():  # nobody reads on: stop following
            break
        if args.stream == "events" and not args.json:
            try:
                event = json.loads(line)
                if event.get("type") == "sandbox_created":
                    network = network_of(event)
                text = describe_event(event, full=args.full, network=network)
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
    from ..records.housekeeping import is_live

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


def cmd_runs_stop(args: argparse.Namespace) -> int:
    from ..records.housekeeping import stop_run

    row = stop_run(_store(), args.run_id, wait=args.wait)
    ended = row.get("ended_at") is not None
    if args.json:
        print_json(row)
    elif ended:
        print(f"stopped {row['run_id']}: {row['status']}")
    if not ended:
        say(
            f"asked run {row['run_id']} to stop; it has not ended after {args.wait:g}s (see "
            f"`orchestrator runs show {row['run_id']}`)",
            kind="warning",
        )
        return 1
    return 0


def cmd_runs_rm(args: argparse.Namespace) -> int:
    from ..records.housekeeping import remove_runs

    ids = remove_runs(_store(), args.run_ids, dry_run=args.dry_run)
    if args.json:
        print_json({"removed": ids, "dry_run": args.dry_run})
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for run_id in ids:
        print(f"{verb} {run_id}")
    return 0


def cmd_runs_prune(args: argparse.Namespace) -> int:
    from ..records.housekeeping import parse_age, prune_runs

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
    from ..records.housekeeping import export_run

    store = _store()
    path = export_run(store, args.run_id, args.output, force=args.force)
    if args.json:
        print_json({"run_id": resolve_run(store, args.run_id)["run_id"], "path": str(path)})
    else:
        print(path)
    return 0
