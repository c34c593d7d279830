"""A batch's live progress: a bar on a terminal (rich), a plain line every PLAIN_INTERVAL
seconds otherwise, so that logs of cron jobs and CI stay readable."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from ..batch.budget import usd
from ..batch.epochs import describe as describe_epochs
from ..batch.plan import BatchProgress, BatchSummary
from .output import PREFIX, is_terminal

#: Plain progress lines (no terminal) come this often, in seconds.
PLAIN_INTERVAL = float(os.environ.get("ORCHESTRATOR_PROGRESS_INTERVAL", "10"))


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


#: The width a summary is laid out in when no terminal shows it: wider than any row.
PIPED_WIDTH = 400


class BatchDisplay:
    """A live bar on a terminal (rich); a plain line every PLAIN_INTERVAL seconds otherwise,
    so logs of cron jobs and CI stay readable."""

    def __init__(self, *, quiet: bool = False, stream: Any = None) -> None:
        from rich.console import Console

        self.stream = stream or sys.stderr
        self.tty = is_terminal(self.stream)  # styled lines (also under FORCE_COLOR=1)
        self.interactive = self.stream.isatty()  # the live bar only where a person watches
        # Piped (a log, a cron mail): each summary row on one line, however long its figures,
        # so that a row is found by grep; rich would wrap at 80 columns.
        width = None if self.tty else PIPED_WIDTH
        self.console = Console(
            file=self.stream, highlight=False, no_color=not self.tty, width=width
        )
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
        table.add_row("accuracy", s.accuracy_text(s.scorer) or "n/a (no expected answers scored)")
        for name, figures in list(s.scorers.items())[1:]:  # the first is the accuracy above
            if figures["accuracy"] is not None:
                share = f"{figures['correct']:g}/{figures['scored']}"
                table.add_row(f"  {name}", f"{figures['accuracy']:.1%} ({share})")
        if (judge := s.spend.get("judge")) is not None:
            table.add_row("judge", f"{judge['calls']} call(s), {judge['tokens']} tokens")
        if s.epochs > 1:  # each task's epochs reduced, with standard errors across tasks
            if s.accuracy_stderr is not None:
                table.add_row("std error", f"{s.accuracy_stderr:.1%} (clustered by task)")
            table.add_row("epochs", f"{s.epochs} per task")
            for label, text in describe_epochs(s.epoch_metrics):
                table.add_row(label, text)
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
