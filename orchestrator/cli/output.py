"""How every command writes: one message style on stderr, tables, JSON, human units.

One style so that a person (and grep) reads every command the same way:
- stderr lines the tool writes on its own behalf start with `orchestrator: `; problems add
  their kind (`orchestrator: error: ...`, `orchestrator: warning: ...`), and an error's fix
  follows on its own line (`  fix: ...`);
- data goes to stdout: a rich table when stdout is a terminal (or rich is told it is one,
  `FORCE_COLOR=1`), plain space-aligned columns with a header row otherwise, so `awk`, `cut`
  and `column` work; `--json` prints JSON instead, errors included.

Every write survives a reader that goes away (`| head -2`): see `guard_streams`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

PREFIX = "orchestrator: "

#: Which streams found their reader gone (`| head`): the command's output is lost, not its work.
READER_GONE: list[str] = []


class ClosedPipeGuard:
    """A standard stream whose writes never raise because the reader closed the pipe.

    The first write that meets a closed pipe points the stream's file descriptor at
    /dev/null and notes it in READER_GONE; every later write then goes nowhere, quietly.
    The command itself goes on: a run still collects its result and is recorded as it
    ended, whoever stopped reading its live lines."""

    def __init__(self, stream: TextIO, name: str) -> None:
        self._stream = stream
        self._name = name

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._gone()
            return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()

    def _gone(self) -> None:
        if self._name not in READER_GONE:
            READER_GONE.append(self._name)
        try:  # the buffered rest, and Python's flush at exit, go to /dev/null
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self._stream.fileno())
            finally:
                os.close(devnull)
        except (OSError, ValueError, AttributeError):  # no descriptor (a test's StringIO)
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def guard_streams() -> tuple[Any, Any]:
    """Put ClosedPipeGuards in place of sys.stdout and sys.stderr; returns the streams they
    replace, for the caller to put back. READER_GONE starts empty."""
    READER_GONE.clear()
    saved = (sys.stdout, sys.stderr)
    if not isinstance(sys.stdout, ClosedPipeGuard):
        sys.stdout = ClosedPipeGuard(sys.stdout, "stdout")
    if not isinstance(sys.stderr, ClosedPipeGuard):
        sys.stderr = ClosedPipeGuard(sys.stderr, "stderr")
    return saved


def reader_gone() -> bool:
    """Whether a write of this command found its reader gone (see ClosedPipeGuard)."""
    return bool(READER_GONE)


def say(text: str, *, kind: str | None = None, stream: TextIO | None = None) -> None:
    """One message line on stderr: `orchestrator: [kind: ]text`."""
    head = f"{PREFIX}{kind}: " if kind else PREFIX
    print(head + text, file=stream or sys.stderr, flush=True)


def is_terminal(stream: TextIO) -> bool:
    """Whether `stream` gets terminal output, by rich's rule (`Console.is_terminal`):
    TTY_COMPATIBLE=1 or 0 says so, else FORCE_COLOR set and not empty, else a tty. Written
    out here because asking rich costs its import
    (benchmarks/results/code_figures.md#import-costs-on-the-start-path) on every piped run,
    which then never prints a styled line."""
    compatible = os.environ.get("TTY_COMPATIBLE", "")
    if compatible in ("0", "1"):
        return compatible == "1"
    force_color = os.environ.get("FORCE_COLOR")
    if force_color is not None:
        return force_color != ""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def error_object(
    cause: str, fix: str = "", exit_code: int = 2, field: str | None = None, problems: Any = ()
) -> dict:
    """What `--json` commands print on stdout when they refuse their input; an error about a
    file adds its `problems` (each with field path, line, message and fix)."""
    error = {"cause": cause, "fix": fix, "exit_code": exit_code, "field": field}
    if problems:
        error["problems"] = [p.to_dict() for p in problems]
    return {"error": error}


def print_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    title: str | None = None,
    stream: TextIO | None = None,
    right: Sequence[str] = (),
) -> None:
    """Rows under a header row: a rich table on a terminal, aligned plain text otherwise.

    `right` names columns aligned right (numbers, durations, sizes)."""
    stream = stream or sys.stdout
    cells = [["-" if v is None or v == "" else str(v) for v in row] for row in rows]
    if is_terminal(stream):
        from rich.console import Console
        from rich.table import Table

        table = Table(
            title=title, title_justify="left", box=None, header_style="bold", pad_edge=False
        )
        for name in headers:
            table.add_column(name, justify="right" if name in right else "left", overflow="fold")
        for row in cells:
            table.add_row(*row)
        Console(file=stream, highlight=False).print(table)
        return
    if title:
        print(title, file=stream)
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    for row in [list(headers), *cells]:
        parts = [
            value.rjust(width) if name in right else value.ljust(width)
            for name, value, width in zip(headers, row, widths, strict=True)
        ]
        print("  ".join(parts).rstrip(), file=stream)


def print_fields(fields: Sequence[tuple[str, Any]], *, stream: TextIO | None = None) -> None:
    """`name: value` lines, names aligned; absent values (None, "") are left out."""
    stream = stream or sys.stdout
    present = [(k, v) for k, v in fields if v is not None and v != ""]
    width = max((len(k) for k, _ in present), default=0)
    for key, value in present:
        text = str(value)
        first, *rest = text.splitlines() or [""]
        print(f"{key + ':':<{width + 1}} {first}", file=stream)
        for line in rest:
            print(f"{'':<{width + 1}} {line}", file=stream)


def human_size(size: float | None) -> str:
    """Bytes as 1.2 kB / 345 MB / 1.1 GB (decimal units, as `docker images` shows them)."""
    if size is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(size) < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.3g} {unit}"
        size /= 1000
    return f"{size:.3g} TB"  # pragma: no cover - unreachable


def human_duration(seconds: float | None) -> str:
    """1.2s, 3m05s, 2h10m; `-` when unknown."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def local_time(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def age(epoch: float | None, now: float | None = None) -> str:
    """How long ago, coarse: 12s ago, 5m ago, 3h ago, 4d ago."""
    if epoch is None:
        return "-"
    delta = max(0.0, (now or time.time()) - epoch)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if delta >= size:
            return f"{int(delta // size)}{unit} ago"
    return f"{int(delta)}s ago"
