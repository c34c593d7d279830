"""`orchestrator schedule ...`: list, validate, run, serve and install scheduled agent jobs.

Heavy imports happen inside the handlers so `orchestrator --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..schedules.file import DEFAULT_FILE
from ..schedules.firing import EXIT_SKIPPED
from ..spec import EXIT_CODES
from . import signals
from .cluster import add_ray_option, leave_cluster, ray_executor
from .output import print_table, say
from .parser import HELP

EPILOG = f"""\
Exit codes of `schedule run`: {", ".join(f"{c} {s}" for s, c in EXIT_CODES.items())}
(the run's status); 2 bad input (schedule file, unknown name, a secret the schedule does
not allow: nothing started); {EXIT_SKIPPED} skipped, the previous run of the schedule is
still going; 0 also when --if-due finds nothing due. Other commands: 0 ok, 2 bad input.

Example:
  orchestrator schedule validate --file schedules.toml
  orchestrator schedule install --dry-run
  orchestrator schedule serve
"""


def add_schedule_parser(sub: Any) -> None:
    p = sub.add_parser(
        "schedule",
        help=HELP["schedule"],
        description="Run payloads on cron schedules (a TOML file of [[schedule]] tables): "
        "with system cron (`install`) or the built-in foreground scheduler (`serve`). "
        "Every firing, skip and failure is recorded in the run store.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--file", default=DEFAULT_FILE, help=f"schedules file (default: ./{DEFAULT_FILE})"
    )
    ssub = p.add_subparsers(title="schedule commands", metavar="ACTION")

    ls = ssub.add_parser("list", parents=[common], help="schedules, next fire times, last status")
    ls.add_argument("--json", action="store_true", help="print the schedules as a JSON array")
    ls.set_defaults(handler=cmd_list)

    va = ssub.add_parser(
        "validate", parents=[common], help="check the file and payloads; show next fire times"
    )
    va.add_argument("--json", action="store_true", help="print the report as a JSON object")
    va.set_defaults(handler=cmd_validate)

    rn = ssub.add_parser(
        "run",
        parents=[common],
        help="fire one schedule now (what cron lines call)",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rn.add_argument("name", help="the schedule's `name` in the file")
    mode = rn.add_mutually_exclusive_group()
    mode.add_argument(
        "--if-due", action="store_true", help="fire only if a fire time is due this minute (cron)"
    )
    mode.add_argument(
        "--catch-up",
        action="store_true",
        help="apply the missed-run rule since the last recorded firing (cron @reboot)",
    )
    rn.add_argument("--quiet", "-q", action="store_true", help="no live events on a terminal")
    rn.set_defaults(handler=cmd_run, watches_stop=True)

    se = ssub.add_parser(
        "serve", parents=[common], help="foreground scheduler (stop with SIGTERM or Ctrl-C)"
    )
    se.add_argument(
        "--grace",
        type=float,
        default=0.0,
        help="on shutdown, seconds to let running firings finish before cancelling them "
        "(default: 0)",
    )
    se.add_argument(
        "--no-warm",
        action="store_true",
        help="start each firing's sandbox at its time (default: a warm one shortly before)",
    )
    add_ray_option(
        se,
        "each firing (cold, on the node with the most room; the lock and the "
        "overlap rules stay here)",
    )
    se.set_defaults(handler=cmd_serve, watches_stop=True)

    ins = ssub.add_parser(
        "install", parents=[common], help="write crontab lines that call `schedule run`"
    )
    ins.add_argument("--dry-run", action="store_true", help="print the lines, change nothing")
    ins.add_argument("--remove", action="store_true", help="remove this file's lines")
    ins.add_argument(
        "--log-dir",
        type=Path,
        help="folder of the cron jobs' log files (default: $ORCHESTRATOR_HOME/schedules/logs)",
    )
    ins.set_defaults(handler=cmd_install)

    hi = ssub.add_parser(
        "history", parents=[common], help="a schedule's firings, skips, misses and notifications"
    )
    hi.add_argument("name", nargs="?", help="one schedule (default: every schedule)")
    hi.add_argument("--limit", type=int, default=20, help="at most this many firings")
    hi.add_argument("--json", action="store_true", help="firings and notifications as JSON")
    hi.set_defaults(handler=cmd_history)

    p.set_defaults(handler=lambda a: (p.print_help(), 2)[1])


def _ts(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def cmd_list(args: argparse.Namespace) -> int:
    from ..labels import owner_alive
    from ..schedules.cron import local_iso
    from ..schedules.file import load_schedules
    from ..schedules.store import ScheduleStore

    sf = load_schedules(args.file, check_payloads=False)
    store = ScheduleStore()
    now = datetime.now(timezone.utc)
    rows: list[dict[str, Any]] = []
    for s in sf.schedules:
        last = store.last_firing(s.name)
        running = [r for r in store.running(s.name) if owner_alive(r["owner"] or "")]
        rows.append(
            {
                "name": s.name,
                "cron": s.cron.expression,
                "timezone": s.timezone,
                "enabled": s.enabled,
                "next": [local_iso(t, s.cron.tz) for t in s.cron.next_times(now, 3)]
                if s.enabled
                else [],
                "concurrency": s.concurrency,
                "missed": s.missed,
                "last_outcome": last["outcome"] if last else None,
                "last_fired_at": _ts(last["fired_at"]) if last else None,
                "last_run_id": last["run_id"] if last else None,
                "running": [r["run_id"] for r in running],
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        say(f"no schedules in {sf.path}")
        return 0
    print_table(
        ("NAME", "CRON", "TIMEZONE", "NEXT", "CONCURRENCY", "MISSED", "LAST", "RUNNING"),
        [
            (
                r["name"],
                r["cron"],
                r["timezone"],
                r["next"][0] if r["next"] else "disabled",
                r["concurrency"],
                r["missed"],
                f"{r['last_outcome']} {r['last_fired_at']} {r['last_run_id'] or ''}".strip()
                if r["last_outcome"]
                else "never fired",
                ", ".join(filter(None, r["running"])),
            )
            for r in rows
        ],
    )
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from ..schedules.cron import local_iso
    from ..schedules.file import load_schedules

    sf = load_schedules(args.file)
    now = datetime.now(timezone.utc)
    report: dict[str, Any] = {
        "file": str(sf.path),
        "ok": True,
        "schedules": [
            {
                "name": s.name,
                "cron": s.cron.expression,
                "timezone": s.timezone,
                "enabled": s.enabled,
                "next": [local_iso(t, s.cron.tz) for t in s.cron.next_times(now, 5)],
            }
            for s in sf.schedules
        ],
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for s in report["schedules"]:
        state = "" if s["enabled"] else " (disabled)"
        times = ", ".join(s["next"])
        print(f"{s['name']}: ok{state}: {s['cron']} in {s['timezone']}; next: {times}")
    print(f"{sf.path}: {len(sf.schedules)} schedule(s) ok")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from ..lifecycle.runner import RunObservers
    from ..schedules.due import run_due
    from ..schedules.file import load_schedules
    from ..schedules.firing import fire
    from ..schedules.store import ScheduleStore
    from .common import tidy_store
    from .display import RunDisplay

    sf = load_schedules(args.file, check_payloads=False, only=args.name)
    schedule = sf.get(args.name)
    tidy_store()
    # Live events only for a person at a terminal; cron's log gets the one firing line.
    display = RunDisplay(quiet=args.quiet or not sys.stderr.isatty())
    signals.on_stop(display.progress)
    kwargs: dict[str, Any] = {
        "observers": RunObservers(
            on_event=display.event, on_progress=display.progress, cancel=signals.STOP
        )
    }
    try:
        store = ScheduleStore()
        if args.if_due or args.catch_up:
            firing = run_due(schedule, store=store, catch_up=args.catch_up, **kwargs)
            return 0 if firing is None else firing.exit_code
        return fire(schedule, store=store, trigger="manual", **kwargs).exit_code
    except KeyboardInterrupt:
        return EXIT_CODES["cancelled"]
    finally:
        display.stop()


def cmd_serve(args: argparse.Namespace) -> int:
    from ..schedules.file import load_schedules
    from ..schedules.serve import Scheduler
    from ..schedules.store import ScheduleStore

    sf = load_schedules(args.file)
    ray = ray_executor(args, say)
    if ray is not None:  # its nodes keep no sandbox warm between firings
        say(f"firing on the Ray cluster: {ray.capacity()} sandbox(es) at once")
        try:
            Scheduler(sf.schedules, store=ScheduleStore(), executor=ray).serve(
                signals.STOP, grace=args.grace
            )
        finally:
            leave_cluster(ray)
        return 0
    if args.no_warm:
        Scheduler(sf.schedules, store=ScheduleStore()).serve(signals.STOP, grace=args.grace)
        return 0
    from ..execution.executor import LocalExecutor
    from ..execution.pool import MAX_SIZE, Pool

    with Pool(size=min(max(1, len(sf.schedules)), MAX_SIZE)) as pool:
        executor = LocalExecutor(pool=pool)
        Scheduler(sf.schedules, store=ScheduleStore(), executor=executor).serve(
            signals.STOP, grace=args.grace
        )
    return 0


def cmd_install(args: argparse.Namespace) -> int:
    from ..schedules.crontab import crontab_block, install
    from ..schedules.file import load_schedules

    sf = load_schedules(args.file)
    if args.dry_run:
        print("\n".join(crontab_block(sf, log_dir=args.log_dir)))
        return 0
    _, block = install(sf, log_dir=args.log_dir, remove=args.remove)
    verb = "removed from" if args.remove else "installed in"
    count = sum(1 for line in block if line and not line.startswith(("#", "@reboot")))
    say(f"{count} schedule line(s) of {sf.path} {verb} the crontab")
    return 0


def cmd_history(args: argparse.Namespace) -> int:
    from ..schedules.store import ScheduleStore

    store = ScheduleStore()
    rows = store.history(args.name, limit=args.limit)
    notes = store.notifications(args.name, limit=args.limit) if args.name else []
    if args.json:
        print(json.dumps({"firings": rows, "notifications": notes}, indent=2))
        return 0
    if not rows and not notes:
        say("no firings recorded" + (f" for schedule {args.name!r}" if args.name else ""))
        return 0
    print_table(
        ("FIRED", "SCHEDULE", "TRIGGER", "SCHEDULED FOR", "OUTCOME", "RUN", "EXIT", "REASON"),
        [
            (
                _ts(r["fired_at"]),
                r["schedule"],
                r["trigger"],
                _ts(r["scheduled_for"]),
                r["outcome"],
                r["run_id"],
                r["exit_code"],
                r["reason"],
            )
            for r in rows
        ],
    )
    for n in notes:
        state = "ok" if n["ok"] else "FAILED"
        print(f"notify {_ts(n['at'])}  {n['kind']} {state}: {n['target']}  {n['detail'] or ''}")
    return 0
