"""`orchestrator batch`: the command over `batch.run_batch`, with a live display and signals."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import threading
import time
from typing import Any

from ..batch.budget import usd
from ..batch.output import OutputWriteError
from ..batch.plan import BatchProgress, BatchSpec, BatchSummary
from ..batch.prices import PRICE_EXAMPLE, parse_price
from ..batch.scoring import BUILTIN_SCORERS
from ..batch.session import run_batch
from ..defaults import fill
from . import signals
from .cluster import add_ray_option, leave_cluster, ray_batch
from .common import add_run_options, spec_from_args, tidy_store
from .output import PREFIX, is_terminal, say
from .parser import HELP

#: Plain progress lines (no terminal) come this often, in seconds.
PLAIN_INTERVAL = float(os.environ.get("ORCHESTRATOR_PROGRESS_INTERVAL", "10"))


EPILOG = """\
Tasks file: JSONL (one object a line) or CSV (header row) with the fields
  id               optional; else derived from task + additional_args (stable)
  task             the task text (required)
  additional_args  object handed to the agent (CSV: JSON, or one args.NAME column each)
  expected         expected answer (a list means any of them)
  max_steps, timeout_seconds (or timeout), memory_mb, cpus, pids   per-task limits
  metadata         anything else, as an object (kept, shown to user scorers)

Resume: run the same command again with the same --output directory. Finished tasks are
kept; unfinished and infrastructure-failed ones run again (--rerun-failed: failed ones too).

Exit codes: 0 every task has an agent outcome (succeeded or not), 2 bad input (nothing
started), 5 tasks left with infrastructure errors, stopped by --fail-on-error,
--max-total-tokens or --max-cost (resume with a higher cap), or an output file could not
be written (disk full: free space, then resume with the same command), 130 interrupted
(resume with the same command).
"""


def add_batch_parser(sub: Any) -> None:
    p = sub.add_parser(
        "batch",
        help=HELP["batch"],
        description="Run a payload on every task of a tasks file, each in a fresh sandbox, in "
        "parallel; append results to OUTPUT/results.jsonl as tasks end and write "
        "OUTPUT/summary.json.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "payload", help="payload folder (holding manifest.toml), or a shipped example's name"
    )
    p.add_argument("tasks", help="tasks file (.jsonl or .csv)")
    p.add_argument(
        "--output",
        "-o",
        help="batch directory, created; the same one resumes (default: "
        "./batches/PAYLOAD-TASKS, from the payload folder's name and the tasks file's stem)",
    )
    add_run_options(p)
    _add_pace_options(p)
    _add_scoring_options(p)
    _add_retry_options(p)
    _add_spend_options(p)
    p.add_argument(
        "--on-bad-line",
        choices=["fail", "skip"],
        default="fail",
        help="a malformed tasks line: refuse the file (default) or skip the line with a warning",
    )
    add_ray_option(p, "the attempts")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.add_argument("--quiet", "-q", action="store_true", help="no live progress")
    p.set_defaults(handler=cmd_batch, watches_stop=True)


def _add_pace_options(p: argparse.ArgumentParser) -> None:
    """How many at once: the ceiling, fixed or adaptive, and the warm sandboxes."""
    p.add_argument(
        "--concurrency",
        "-j",
        type=concurrency_arg,
        metavar="auto|N",
        help="the most sandboxes at once: how many run adapts under it to what the host "
        "carries (starts at min(2 x CPUs, 75%% of free memory / memory limit); warm on runc, "
        "1 x CPUs: the pool starts sandboxes beside the runs; then more "
        "while throughput grows, fewer when it does not fall or memory runs short). Default: "
        "$ORCHESTRATOR_CONCURRENCY, the config file's concurrency, else auto (up to 32)",
    )
    p.add_argument(
        "--fixed-concurrency",
        action="store_true",
        help="run exactly --concurrency N at once, never adapting (for measurements; with "
        "--ray, each node runs all it declares)",
    )
    warm = p.add_mutually_exclusive_group()
    warm.add_argument(
        "--warm",
        type=int,
        metavar="N",
        help="keep N sandboxes (0 to 32) started ahead of the runs that take them, each used "
        "once (default: as many as the concurrency when there are more tasks than that)",
    )
    warm.add_argument(
        "--no-warm",
        dest="warm",
        action="store_const",
        const=0,
        help="start every run's sandbox when the run starts",
    )


def _add_scoring_options(p: argparse.ArgumentParser) -> None:
    """How an answer is scored."""
    p.add_argument(
        "--scorer",
        default="exact",
        help=f"{', '.join(BUILTIN_SCORERS)}, or module:function / file.py:function "
        "(default: exact, after normalising case, spaces, quotes and a final full stop)",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=1e-6,
        help="numeric scorer: |answer - expected| <= T * max(1, |expected|) (default 1e-6)",
    )


def _add_retry_options(p: argparse.ArgumentParser) -> None:
    """Retries on infrastructure faults, reruns on resume, and when to give up."""
    p.add_argument(
        "--max-attempts",
        type=int,
        default=3,
        help="attempts per task on infrastructure faults only (default 3; 1 = no retry)",
    )
    p.add_argument(
        "--backoff",
        type=float,
        default=2.0,
        dest="backoff_seconds",
        help="first retry wait in seconds, doubling each time, plus jitter (default 2)",
    )
    p.add_argument(
        "--rerun-failed",
        action="store_true",
        help="on resume, also run again tasks that failed, timed out or ran out of memory",
    )
    p.add_argument(
        "--fail-on-error",
        type=float,
        metavar="RATIO",
        help="stop (exit 5) once more than this share of tasks (< 1), or this many tasks "
        "(>= 1), ended in infra_error after their retries",
    )


def _add_spend_options(p: argparse.ArgumentParser) -> None:
    """The batch's spend caps: tokens, cost, and the prices cost is counted at."""
    p.add_argument(
        "--max-total-tokens",
        type=int,
        metavar="N",
        help="the batch's token cap: once its tasks spent N tokens (input + output, every "
        "attempt of every session, as the model gateway measured them, else as the sandboxes "
        "reported), no task starts and running ones are stopped (exit 5); re-run with a higher "
        "N to resume (default: no cap)",
    )
    p.add_argument(
        "--max-cost",
        metavar="USD",
        help="the batch's cost cap in US dollars: as --max-total-tokens, counting each model "
        "call's gateway-measured tokens at the price of the model it names (--price, else the "
        "prices bundled with genai-prices, offline); a model with no known price, or runs "
        "without the model gateway, are refused before anything starts, and a call whose cost "
        "cannot be counted stops the batch; mock costs 0 (default: no cap)",
    )
    p.add_argument(
        "--price",
        action="append",
        default=[],
        metavar="MODEL=IN/OUT",
        help="the price --max-cost counts MODEL (as --model spells it) at: US dollars per "
        f"million input and output tokens, e.g. {PRICE_EXAMPLE}; repeatable; wins over the "
        "bundled prices",
    )


def batch_spec_from_args(args: argparse.Namespace) -> BatchSpec:
    return BatchSpec(
        tasks=args.tasks,
        output=args.output,
        run=spec_from_args(args, task=None, additional_args=None),
        concurrency=None
        if args.concurrency == "auto"
        else fill({"concurrency": args.concurrency})["concurrency"],
        adapt=not args.fixed_concurrency,
        scorer=args.scorer,
        tolerance=args.tolerance,
        max_attempts=args.max_attempts,
        backoff_seconds=args.backoff_seconds,
        rerun_failed=args.rerun_failed,
        fail_on_error=args.fail_on_error,
        on_bad_line=args.on_bad_line,
        warm=args.warm,
        max_total_tokens=args.max_total_tokens,
        max_cost=args.max_cost,
        prices=dict(parse_price(text) for text in args.price),
    )


def concurrency_arg(value: str) -> int | str:
    """`auto` or a whole number of sandboxes (checked by the batch: at least 1)."""
    if value.strip().lower() == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither auto nor a whole number of sandboxes"
        ) from None


def cmd_batch(args: argparse.Namespace) -> int:
    tidy_store()
    spec = batch_spec_from_args(args)
    display = BatchDisplay(quiet=args.quiet)
    signals.on_stop(display.message)
    command = shlex.join(["orchestrator", *sys.argv[1:]])
    executor = None
    try:
        executor, spec = ray_batch(args, spec, display.message)
        summary = run_batch(
            spec,
            cancel=signals.STOP,
            monitor=display.update,
            on_message=display.message,
            executor=executor,
        )
    except OutputWriteError as exc:  # before any task started (batch.json, the lock)
        say(f"{exc.cause}. {write_advice(command)}", kind="error")
        return exc.exit_code
    finally:
        display.stop()
        leave_cluster(executor)
    display.final(summary)
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2, default=str))
    reason = summary.stop_reason or ""
    if reason.startswith("write_error:"):  # one line: what failed, what to do
        cause = reason.split(":", 1)[1].strip()
        say(f"{cause}. {write_advice(command)}", kind="stopped")
    elif reason == "budget_exceeded":
        what, then = spend_stop(summary.spend)
        say(f"stopped: {what}; finished tasks are in {summary.output_dir}/results.jsonl")
        print(f"  resume with the same command {then}: {command}", file=sys.stderr)
    elif summary.state != "complete" or summary.counts.get("infra_error"):
        what = {
            "interrupted": "interrupted: every sandbox was removed; finished tasks are in",
            "stopped": "stopped by --fail-on-error; finished tasks are in",
        }.get(summary.state, "tasks ended in infra_error; results are in")
        say(f"{what} {summary.output_dir}/results.jsonl")
        print(f"  resume with: {command}", file=sys.stderr)
    return summary.exit_code


def spend_stop(spend: dict[str, Any]) -> tuple[str, str]:
    """What stopped the batch (which cap, how much was spent), and what a resume needs."""
    if spend.get("stopped_by") == "max_cost":
        return (
            f"the batch's cap --max-cost {usd(spend['max_cost_usd'])} was reached "
            f"({usd(spend['cost_usd'])} spent, {spend['tokens']} tokens)",
            "and a higher --max-cost",
        )
    if spend.get("stopped_by") == "uncounted":
        return (
            f"the cost of {spend['uncounted_calls']} model call(s) could not be counted (no "
            "usage measured, or a model with no known price), so --max-cost cannot keep the "
            "cap (fail closed; the reason is in the stopped runs' attempts.jsonl lines)",
            "once the model server reports usage and every model called has a --price (or "
            "with --max-total-tokens instead)",
        )
    return (
        f"the batch's cap --max-total-tokens {spend['max_total_tokens']} was reached "
        f"({spend['tokens']} tokens spent)",
        "and a higher --max-total-tokens",
    )


def write_advice(command: str) -> str:
    return (
        "Finished tasks are kept; free space (or fix permissions), then re-run the same "
        f"command to resume: {command}"
    )


def pace_text(pace: dict[str, Any]) -> str:
    """How the concurrency moved, after its last value: ` (auto, up to 32; 2 to 4 at once,
    3 changes)`; nothing for an older summary."""
    if pace.get("mode") == "fixed":
        return " (fixed)"
    if pace.get("mode") != "auto":
        return ""
    changes = len(pace["changes"]) - 1
    moved = f"; {pace['lowest']} to {pace['highest']} at once, {changes} change(s)"
    return f" (auto, up to {pace['ceiling']}{moved if changes else ''})"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def progress_line(p: BatchProgress) -> str:
    c = p.counts
    other = sum(v for k, v in c.items() if k not in ("succeeded", "failed", "timed_out"))
    parts = [
        f"{p.done}/{p.total} done",
        f"{p.running} running",
        f"{c.get('succeeded', 0)} succeeded",
        f"{c.get('failed', 0)} failed",
        f"{c.get('timed_out', 0)} timed out",
    ]
    if other:
        parts.append(f"{other} other")
    if p.retries:
        parts.append(f"{p.retries} retries")
    parts.append(f"{p.rate_per_minute:.1f} tasks/min")
    if p.concurrency_text:
        parts.append(f"concurrency {p.concurrency_text}")
    parts.append(f"ETA {_duration(p.eta_seconds)}")
    if p.max_total_tokens is not None:
        parts.append(f"{p.spent_tokens}/{p.max_total_tokens} tokens")
    if p.max_cost is not None and p.spent_cost is not None:
        parts.append(f"{usd(p.spent_cost)}/{usd(p.max_cost)}")
    if p.stopping:
        parts.append(f"stopping ({p.stopping})")
    return " · ".join(parts)


class BatchDisplay:
    """A live bar on a terminal (rich); a plain line every PLAIN_INTERVAL seconds otherwise,
    so logs of cron jobs and CI stay readable."""

    def __init__(self, *, quiet: bool = False, stream: Any = None) -> None:
        from rich.console import Console

        self.stream = stream or sys.stderr
        self.tty = is_terminal(self.stream)  # styled lines (also under FORCE_COLOR=1)
        self.interactive = self.stream.isatty()  # the live bar only where a person watches
        self.console = Console(file=self.stream, highlight=False, no_color=not self.tty)
        self.quiet = quiet
        self._live: Any = None
        self._progress: Any = None
        self._details: Any = None
        self._task: Any = None
        self._last_plain = 0.0
        self._last_line = ""
        self._lock = threading.Lock()

    def message(self, text: str) -> None:
        if self.quiet and not text.startswith(("warning", "stopping", "SIG")):
            return
        from rich.markup import escape

        from .display import shown

        if not shown(text):
            return
        with self._lock:
            if self.tty:
                self.console.print(f"[dim]·[/dim] {escape(text)}")
            else:
                print(f"{PREFIX}{text}", file=self.stream, flush=True)

    def update(self, p: BatchProgress) -> None:
        if self.quiet:
            return
        if not self.interactive:
            now = time.monotonic()
            line = progress_line(p)
            final = p.done == p.total
            due = now - self._last_plain >= PLAIN_INTERVAL
            if line != self._last_line and (due or final):
                self._last_plain, self._last_line = now, line
                print(f"{PREFIX}batch: {line}", file=self.stream, flush=True)
            return
        from rich.console import Group
        from rich.live import Live
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
        from rich.text import Text

        with self._lock:
            if self._live is None:
                self._progress = Progress(
                    TextColumn("batch"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TextColumn("· ETA {task.fields[eta]}"),
                    console=self.console,
                )
                self._task = self._progress.add_task("", total=p.total, eta="?")
                self._details = Text()
                self._live = Live(
                    Group(self._progress, self._details),
                    console=self.console,
                    refresh_per_second=4,
                )
                self._live.start()
            eta = _duration(p.eta_seconds)
            self._progress.update(self._task, completed=p.done, eta=eta)
            self._details.plain = "  " + progress_line(p).split(" · ", 1)[1].rsplit(" · ETA", 1)[0]

    def stop(self) -> None:
        with self._lock:
            if self._live is not None:
                self._live.stop()
                self._live = None

    def final(self, s: BatchSummary) -> None:
        """The summary table: counts per status, accuracy, durations, tokens, retries."""
        from rich.table import Table

        table = Table(title=f"batch {s.batch_id}: {s.state}", show_header=False, box=None)
        table.add_column(style="bold")
        table.add_column()
        for status, count in s.counts.items():
            if count or status in ("succeeded", "failed"):
                table.add_row(status, str(count))
        if s.pending:
            table.add_row("pending", str(s.pending))
        table.add_row("total", str(s.total))
        if s.accuracy is not None and s.accuracy_ci95:
            low, high = s.accuracy_ci95
            table.add_row(
                "accuracy",
                f"{s.accuracy:.1%} ({s.correct:g}/{s.scored} scored, 95% CI {low:.1%}–{high:.1%}, "
                f"scorer {s.scorer})",
            )
        else:
            table.add_row("accuracy", "n/a (no expected answers scored)")
        if s.duration_p50 is not None:
            table.add_row("duration", f"p50 {s.duration_p50:.1f}s · p95 {s.duration_p95:.1f}s")
        table.add_row(
            "tokens",
            f"{s.tokens['input']} in · {s.tokens['output']} out"
            + (
                f" (all attempts: {s.tokens_all_attempts['input']} in · "
                f"{s.tokens_all_attempts['output']} out)"
                if s.tokens_all_attempts != s.tokens
                else ""
            )
            + {"gateway": " (measured by the model gateway)", "sandbox": " (as reported)"}.get(
                s.tokens_source, " (partly measured, partly as reported)"
            ),
        )
        spend = s.spend
        caps = []
        if spend.get("max_total_tokens") is not None:
            caps.append(
                f"{spend['tokens']} of --max-total-tokens {spend['max_total_tokens']} "
                f"({spend['source']})"
            )
        if spend.get("max_cost_usd") is not None and spend.get("price"):
            price = spend["price"]
            caps.append(
                f"{usd(spend['cost_usd'])} of --max-cost {usd(spend['max_cost_usd'])} "
                f"({price['model']} at ${price['input_per_mtok']:g}/${price['output_per_mtok']:g} "
                f"per M tokens, {price['source']})"
            )
        if caps:
            table.add_row(
                "spend",
                " · ".join(caps)
                + (f" · stopped by {spend['stopped_by']}" if spend.get("stopped_by") else "")
                + (
                    f" · {spend['attempts_stopped']} run(s) stopped by it: run again on resume"
                    if spend.get("attempts_stopped")
                    else ""
                ),
            )
        cancelled = f", {s.cancelled} cancelled: run again on resume" if s.cancelled else ""
        table.add_row("retries", f"{s.retries} ({s.attempts} attempts in all{cancelled})")
        session = s.session
        rate = session.get("tasks_per_minute")
        table.add_row(
            "this session",
            f"{session['tasks_run']} tasks in {session['wall_seconds']:.1f}s"
            + (f" · {rate:.1f} tasks/min" if rate else "")
            + f" · concurrency {session['concurrency']}{pace_text(s.concurrency)}",
        )
        if s.skipped_lines:
            table.add_row("skipped lines", ", ".join(str(b["line"]) for b in s.skipped_lines))
        table.add_row("results", f"{s.output_dir}/results.jsonl")
        self.console.print(table)
