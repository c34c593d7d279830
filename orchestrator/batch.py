"""Batch evaluation: every task of a dataset in its own fresh sandbox, in parallel, scored,
resumable, with nothing lost or written twice.

The life of a batch, top to bottom:

  read the tasks file (bad lines named by number; duplicate ids refused)
  → prepare every task with the single-run API (bad input fails before anything starts)
  → lock the output directory (one batch writes to it at a time)
  → clean up sandboxes that dead orchestrators left behind
  → resume: tasks with a result are done; unfinished and infra-failed ones run again
  → prepare the image once → N workers run tasks through `runner.execute`, retrying only
    infrastructure faults (with exponential backoff and jitter); every attempt is logged
  → each result is appended to `results.jsonl` and fsynced as its task ends
  → `summary.json`: counts per status, accuracy with a Wilson interval, durations, tokens.

Output directory:

  batch.json      the batch's id and the options it was started with (checked on resume)
  results.jsonl   one line per finished task (the source of truth for resume)
  attempts.jsonl  a start and an end line for every attempt, retries and cancels included
  summary.json    written at the end of every session (complete, interrupted or stopped)
  runs/<id>       a link to the run record of each task's final attempt
"""

from __future__ import annotations

import csv
import hashlib
import importlib
import importlib.util
import inspect
import io
import json
import math
import os
import queue
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import tenacity

from .backends.base import Backend, Progress
from .errors import ConfigError, OrchestratorError
from .runner import PreparedRun, RunResult, RunSpec, execute, get_backend, prepare
from .store import Store, new_run_id

#: Per-task limit overrides a tasks file may set (same names as RunSpec and the manifest).
OVERRIDE_FIELDS: dict[str, type] = {
    "max_steps": int,
    "timeout_seconds": float,
    "memory_mb": int,
    "cpus": float,
    "pids": int,
}
TASK_FIELDS = ("id", "task", "additional_args", "expected", "metadata", *OVERRIDE_FIELDS)
FIELD_ALIASES = {"timeout": "timeout_seconds"}
#: Statuses that are the agent's own outcome: a result, never retried, kept on resume.
FINISHED = ("succeeded", "failed", "timed_out", "oom_killed")
#: How many bad lines an error message lists before it says "and N more".
MAX_LISTED = 10

OnBadLine = Literal["skip", "fail"]
Scorer = Callable[[Any, Any, dict[str, Any]], "float | None"]


class TaskFileError(OrchestratorError):
    """The tasks file cannot be used as it is; nothing has been started."""


class BatchLocked(OrchestratorError):
    """Another batch is writing to the same output directory."""


# --- tasks ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """One line of the tasks file, validated."""

    id: str
    task: str
    line: int
    additional_args: dict[str, Any] | None = None
    expected: Any = None
    overrides: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] | None = None

    def row(self) -> dict[str, Any]:
        """What a user scorer sees of the task."""
        return {
            "id": self.id,
            "task": self.task,
            "additional_args": self.additional_args,
            "expected": self.expected,
            "metadata": self.metadata,
        }


@dataclass(frozen=True)
class BadLine:
    line: int
    message: str

    def describe(self, path: str | Path) -> str:
        return f"{path}:{self.line}: {self.message}"


@dataclass
class TaskFile:
    path: Path
    tasks: list[Task]
    bad_lines: list[BadLine]


def derive_id(task: str, additional_args: dict[str, Any] | None) -> str:
    """A stable id from what is run: the same task and arguments get the same id in any file,
    so a file without ids can still be resumed after lines are added or reordered."""
    canonical = json.dumps(
        {"task": task, "additional_args": additional_args},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return "t-" + hashlib.sha256(canonical.encode()).hexdigest()[:12]


def read_tasks(path: str | Path, *, on_bad_line: OnBadLine = "fail") -> TaskFile:
    """Parse a JSONL or CSV tasks file. Malformed lines are skipped or rejected (naming every
    one); duplicate ids are always an error, since resuming keys everything on the id."""
    path = Path(path)
    if not path.is_file():
        raise TaskFileError(f"No tasks file at {path}.", "Pass a .jsonl or .csv file of tasks.")
    text = path.read_text(encoding="utf-8-sig")
    rows = _csv_rows(path, text) if _is_csv(path, text) else _jsonl_rows(text)
    tasks: list[Task] = []
    bad: list[BadLine] = []
    for line, row in rows:
        if isinstance(row, BadLine):
            bad.append(row)
            continue
        try:
            tasks.append(task_from_row(row, line))
        except ValueError as exc:
            bad.append(BadLine(line, str(exc)))
    if bad and on_bad_line == "fail":
        raise TaskFileError(
            _listing(f"{path} has {len(bad)} malformed line(s):", [b.describe(path) for b in bad]),
            "Fix the lines, or pass --on-bad-line skip to run the others.",
        )
    check_duplicates(path, tasks)
    if not tasks:
        raise TaskFileError(f"{path} holds no tasks.", "Add one task per line.")
    return TaskFile(path=path, tasks=tasks, bad_lines=bad)


def check_duplicates(path: Path, tasks: list[Task]) -> None:
    first: dict[str, Task] = {}
    problems = []
    for task in tasks:
        seen = first.setdefault(task.id, task)
        if seen is task:
            continue
        if task.id.startswith("t-") and task.id == derive_id(task.task, task.additional_args):
            problems.append(
                f"{path}:{task.line}: repeats the task and additional_args of line {seen.line} "
                f"(derived id {task.id})"
            )
        else:
            problems.append(f"{path}:{task.line}: duplicate id {task.id!r} (first on line "
                            f"{seen.line})")  # fmt: skip
    if problems:
        raise TaskFileError(
            _listing(f"{path} has {len(problems)} duplicate task id(s):", problems),
            "Give every task a unique `id` (results and resume are keyed on it).",
        )


def _listing(head: str, items: list[str]) -> str:
    shown = items[:MAX_LISTED]
    more = f"\n  … and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else ""
    return head + "".join(f"\n  {item}" for item in shown) + more


def _is_csv(path: Path, text: str) -> bool:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        return False
    if suffix == ".csv":
        return True
    return not text.lstrip().startswith("{")


def _jsonl_rows(text: str) -> Iterator[tuple[int, dict[str, Any] | BadLine]]:
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            yield number, BadLine(number, f"not valid JSON ({exc.msg} at column {exc.colno})")
            continue
        if not isinstance(row, dict):
            yield number, BadLine(number, f"expected a JSON object, got {type(row).__name__}")
            continue
        yield number, row


def _csv_rows(path: Path, text: str) -> Iterator[tuple[int, dict[str, Any] | BadLine]]:
    """CSV with a header row. Empty cells are unset; `additional_args` and `metadata` cells
    hold JSON objects; `args.NAME` columns add one argument each (JSON, else text)."""
    reader = csv.reader(io.StringIO(text))
    try:
        header = next(reader)
    except StopIteration:
        return
    except csv.Error as exc:
        raise TaskFileError(f"{path}:1: not a CSV header ({exc}).", "Fix the header.") from exc
    header = [h.strip() for h in header]
    header_end = reader.line_num
    unknown = [
        h
        for h in header
        if FIELD_ALIASES.get(h, h) not in TASK_FIELDS and not h.startswith("args.")
    ]
    if unknown or "task" not in header:
        problem = (
            f"unknown column(s) {', '.join(map(repr, unknown))}" if unknown else "no `task` column"
        )
        raise TaskFileError(
            f"{path}:1: {problem}.",
            f"Columns may be {', '.join(TASK_FIELDS)}, timeout and args.NAME; "
            "put other data in a `metadata` column as a JSON object.",
        )
    end = header_end
    while True:
        start = end + 1
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            end = reader.line_num
            yield start, BadLine(start, f"not valid CSV ({exc})")
            continue
        end = reader.line_num
        if not cells or all(not c.strip() for c in cells):
            continue
        if len(cells) != len(header):
            yield (
                start,
                BadLine(start, f"has {len(cells)} fields where the header has {len(header)}"),
            )
            continue
        row: dict[str, Any] = {}
        problem = None
        for name, cell in zip(header, cells, strict=True):
            if cell == "":
                continue
            if name in ("additional_args", "metadata"):
                try:
                    row[name] = json.loads(cell)
                except ValueError:
                    problem = f"column `{name}` is not a JSON object"
                    break
            elif name.startswith("args."):
                try:
                    value = json.loads(cell)
                except ValueError:
                    value = cell
                row.setdefault("additional_args", {})
                if isinstance(row["additional_args"], dict):
                    row["additional_args"][name[5:]] = value
            else:
                row[name] = cell
        yield start, row if problem is None else BadLine(start, problem)


def task_from_row(row: dict[str, Any], line: int) -> Task:
    """Validate one row; raises ValueError with a message fit for `file:line: message`."""
    row = {FIELD_ALIASES.get(k, k): v for k, v in row.items()}
    unknown = sorted(set(row) - set(TASK_FIELDS))
    if unknown:
        raise ValueError(
            f"unknown field(s) {', '.join(map(repr, unknown))} (known: {', '.join(TASK_FIELDS)}; "
            "put other data under `metadata`)"
        )
    text = row.get("task")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("`task` is missing or not a non-empty string")
    args = row.get("additional_args")
    if args is not None and not isinstance(args, dict):
        raise ValueError("`additional_args` must be a JSON object")
    metadata = row.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise ValueError("`metadata` must be a JSON object")
    task_id = row.get("id")
    if task_id is None or task_id == "":
        task_id = derive_id(text, args)
    elif isinstance(task_id, bool) or not isinstance(task_id, (str, int)):
        raise ValueError("`id` must be a string or an integer")
    task_id = str(task_id).strip()
    if not task_id or len(task_id) > 200 or any(c in task_id for c in "\n\r\0"):
        raise ValueError("`id` must be 1 to 200 characters on one line")
    overrides = {}
    for name, kind in OVERRIDE_FIELDS.items():
        value = row.get(name)
        if value is None:
            continue
        overrides[name] = _number(name, value, kind)
    return Task(
        id=task_id,
        task=text,
        line=line,
        additional_args=args,
        expected=row.get("expected"),
        overrides=overrides,
        metadata=metadata,
    )


def _number(name: str, value: Any, kind: type) -> int | float:
    if isinstance(value, str):  # CSV cells
        try:
            value = float(value) if kind is float else int(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"`{name}` must be a number")
    if kind is int and value != int(value):
        raise ValueError(f"`{name}` must be a whole number")
    return kind(value)


# --- scoring --------------------------------------------------------------------------------

_SPACE = re.compile(r"\s+")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?")
_NUMBER = re.compile(r"[-+]?(?:\d[\d,_]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def normalize(value: Any) -> str:
    """Text for comparison: case-folded, whitespace collapsed, outer quotes and a trailing
    full stop removed (what a model adds around an answer, not what changes it)."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = _SPACE.sub(" ", text.strip().casefold())
    text = text.strip("\"'`").strip()
    text = text[:-1].rstrip() if text.endswith(".") else text
    if _PLAIN_NUMBER.fullmatch(text):  # 42, 42.0 and "42" are the same answer
        number = float(text)
        return str(int(number)) if number.is_integer() and abs(number) < 2**53 else repr(number)
    return text


def to_number(value: Any) -> float | None:
    """A number from an answer: the value itself, else the last number written in the text."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if not isinstance(value, str):
        return None
    text = value.strip()
    try:
        return float(text.replace(",", "").replace("_", ""))
    except ValueError:
        pass
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", "").replace("_", ""))
    except ValueError:
        return None


def score_exact(answer: Any, expected: Any) -> float:
    return float(normalize(answer) == normalize(expected))


def score_contains(answer: Any, expected: Any) -> float:
    return float(normalize(expected) in normalize(answer))


def score_numeric(answer: Any, expected: Any, tolerance: float) -> float:
    """Equal within `tolerance`, absolute for small numbers and relative for large ones."""
    got, want = to_number(answer), to_number(expected)
    if got is None or want is None or math.isnan(got) or math.isnan(want):
        return 0.0
    return float(abs(got - want) <= tolerance * max(1.0, abs(want)))


BUILTIN_SCORERS = ("exact", "contains", "numeric")


def make_scorer(name: str, *, tolerance: float = 1e-6) -> Scorer:
    """A built-in scorer by name, or a user's `module:function` / `path/file.py:function`.

    A user scorer is called as `fn(answer, expected)` or `fn(answer, expected, task)` and
    returns a bool or a number from 0 to 1 (None: not scored). A list as `expected` means
    "any of these" for the built-in scorers.
    """

    def any_of(one: Callable[[Any, Any], float]) -> Scorer:
        def scorer(answer: Any, expected: Any, task: dict[str, Any]) -> float:
            options = expected if isinstance(expected, list) else [expected]
            return max((one(answer, option) for option in options), default=0.0)

        return scorer

    if name == "exact":
        return any_of(score_exact)
    if name == "contains":
        return any_of(score_contains)
    if name == "numeric":
        return any_of(lambda a, e: score_numeric(a, e, tolerance))
    function = load_user_scorer(name)
    try:
        inspect.signature(function).bind(None, None, None)
        takes_task = True
    except (TypeError, ValueError):
        takes_task = False

    def user(answer: Any, expected: Any, task: dict[str, Any]) -> float | None:
        value = function(answer, expected, task) if takes_task else function(answer, expected)
        if value is None:
            return None
        if isinstance(value, bool):
            return float(value)
        if isinstance(value, (int, float)) and 0 <= value <= 1:
            return float(value)
        raise ValueError(f"the scorer returned {value!r}, not a bool or a number from 0 to 1")

    return user


def load_user_scorer(spec: str) -> Callable[..., Any]:
    module_name, sep, function_name = spec.rpartition(":")
    fix = (
        f"Use one of {', '.join(BUILTIN_SCORERS)}, or module:function / path/to/file.py:function "
        "(the function takes answer, expected[, task] and returns a bool or 0..1)."
    )
    if not sep or not module_name or not function_name.isidentifier():
        raise ConfigError(f"Unknown scorer {spec!r}.", fix)
    try:
        if module_name.endswith(".py"):
            file = Path(module_name)
            loader = importlib.util.spec_from_file_location(f"_scorer_{file.stem}", file)
            if loader is None or loader.loader is None or not file.is_file():
                raise ImportError(f"no file {file}")
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())  # as `python -m` would: scorers next to data
            module = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(
            f"Cannot load the scorer module {module_name!r} ({type(exc).__name__}: {exc}).", fix
        ) from exc
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ConfigError(
            f"The scorer module {module_name!r} has no function {function_name}.", fix
        )
    return function


def wilson_interval(successes: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95 % Wilson score interval: unlike the normal approximation it stays inside [0, 1] and
    is honest for small batches and accuracies near 0 or 1."""
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return (max(0.0, centre - half), min(1.0, centre + half))


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    low, high = math.floor(k), math.ceil(k)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


# --- the batch ------------------------------------------------------------------------------


@dataclass
class BatchSpec:
    """A batch: a tasks file run against one payload/model/policy (`run` is the template;
    each task's text, arguments and limit overrides are filled in per task)."""

    tasks: str | Path
    output: str | Path
    run: RunSpec
    concurrency: int | None = None
    scorer: str = "exact"
    tolerance: float = 1e-6
    #: Attempts per task for infrastructure faults (1 = no retry).
    max_attempts: int = 3
    backoff_seconds: float = 2.0
    backoff_max_seconds: float = 60.0
    rerun_failed: bool = False
    #: Stop when this share (< 1) or number (>= 1) of tasks ended in `infra_error`.
    fail_on_error: float | None = None
    on_bad_line: OnBadLine = "fail"


@dataclass
class BatchProgress:
    """A snapshot for live displays."""

    total: int
    done: int
    running: int
    counts: dict[str, int]
    ran: int
    retries: int
    elapsed: float
    stopping: str | None

    @property
    def rate_per_minute(self) -> float:
        return self.ran / self.elapsed * 60 if self.elapsed > 0 else 0.0

    @property
    def eta_seconds(self) -> float | None:
        remaining = self.total - self.done
        if remaining <= 0:
            return 0.0
        rate = self.rate_per_minute
        return remaining / rate * 60 if rate > 0 else None


@dataclass
class BatchSummary:
    batch_id: str
    state: str  # complete | interrupted | stopped
    output_dir: str
    tasks_file: str
    payload: str
    model: str
    scorer: str
    total: int
    counts: dict[str, int]
    pending: int
    scored: int
    correct: float
    accuracy: float | None
    accuracy_ci95: list[float] | None
    duration_p50: float | None
    duration_p95: float | None
    tokens: dict[str, int]
    tokens_all_attempts: dict[str, int]
    attempts: int
    retries: int
    skipped_lines: list[dict[str, Any]]
    stop_reason: str | None
    session: dict[str, Any]

    @property
    def exit_code(self) -> int:
        """0 every task has an agent outcome; 5 infrastructure faults remain or the batch was
        stopped by --fail-on-error; 130 interrupted (resume with the same command)."""
        if self.state == "interrupted":
            return 130
        if self.state == "stopped" or self.counts.get("infra_error") or self.pending:
            return 5
        return 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_concurrency(memory_mb: int | None = None) -> int:
    """min(4, CPUs, memory/limit): a mock or local-model run is CPU-bound (`import
    smolagents` alone is ~1 s of CPU), so more sandboxes than cores only queue on the CPU;
    4 caps a laptop's default. Runs against hosted models mostly wait on the network, so raise
    --concurrency for those (and mind the provider's rate limits)."""
    cpus = os.cpu_count() or 1
    limit = min(4, cpus)
    if memory_mb:
        try:
            total_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
            limit = min(limit, max(1, int(total_mb * 0.75) // memory_mb))
        except (ValueError, OSError, AttributeError):
            pass
    return max(1, limit)


def safe_name(task_id: str) -> str:
    """A file name for a task id (ids are free text); unique because a hash is added when
    anything had to be replaced."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", task_id)[:80]
    if name != task_id or name in (".", ".."):
        name += "-" + hashlib.sha256(task_id.encode()).hexdigest()[:8]
    return name


class BatchDir:
    """The output directory: the lock, the append-only files and the resume state."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.results_path = path / "results.jsonl"
        self.attempts_path = path / "attempts.jsonl"
        self._lock = threading.Lock()
        self._file_lock: Any = None

    @contextmanager
    def locked(self) -> Iterator[BatchDir]:
        """Hold the directory's lock file: a second batch on the same directory would write
        tasks twice. The OS drops the lock when the process dies, even by SIGKILL."""
        from filelock import FileLock, Timeout

        self.path.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(self.path / ".lock"), timeout=0)
        try:
            lock.acquire()
        except Timeout:
            raise BatchLocked(
                f"Another batch is running with the output directory {self.path}.",
                "Wait for it to end (or stop it), or use another --output directory.",
            ) from None
        try:
            yield self
        finally:
            lock.release()

    def read_meta(self) -> dict[str, Any] | None:
        path = self.path / "batch.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def write_meta(self, meta: dict[str, Any]) -> None:
        _atomic_write(self.path / "batch.json", json.dumps(meta, indent=2) + "\n")

    def load_results(self) -> dict[str, dict[str, Any]]:
        """Result lines by task id. A torn last line (the process died mid-write) is dropped
        here and rewritten away, so it can never be mistaken for a result."""
        results: dict[str, dict[str, Any]] = {}
        if not self.results_path.is_file():
            return results
        torn = False
        for line in self.results_path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
                results[str(row["id"])] = row
            except (ValueError, KeyError, TypeError):
                torn = True
        if torn:
            self.rewrite_results(list(results.values()))
        return results

    def load_attempts(self) -> list[dict[str, Any]]:
        rows = []
        if self.attempts_path.is_file():
            for line in self.attempts_path.read_text(encoding="utf-8").splitlines():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue  # a torn last line: that attempt's run record still exists
        return rows

    def rewrite_results(self, rows: list[dict[str, Any]]) -> None:
        """Replace results.jsonl atomically (old or new, never half), before re-running tasks
        whose old lines must go so that no task is ever written twice."""
        text = "".join(json.dumps(row, default=str) + "\n" for row in rows)
        _atomic_write(self.results_path, text)

    def append_result(self, row: dict[str, Any]) -> None:
        self._append(self.results_path, row)

    def append_attempt(self, row: dict[str, Any]) -> None:
        self._append(self.attempts_path, row)

    def _append(self, path: Path, row: dict[str, Any]) -> None:
        """One write(2) per line with O_APPEND, then fsync: a line is on disk before the
        batch moves on, and a kill can at worst tear the line being written."""
        data = (json.dumps(row, default=str) + "\n").encode()
        with self._lock:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)

    def link_record(self, task_id: str, record_dir: str) -> None:
        """`runs/<task>` → the run record of the task's final attempt (replaced atomically)."""
        if not record_dir:
            return
        runs = self.path / "runs"
        runs.mkdir(exist_ok=True)
        link = runs / safe_name(task_id)
        tmp = runs / f".{link.name}.{os.getpid()}.tmp"
        try:
            if tmp.is_symlink():
                tmp.unlink()
            tmp.symlink_to(record_dir)
            os.replace(tmp, link)
        except OSError:
            pass  # the record path is in results.jsonl anyway

    def write_summary(self, summary: BatchSummary) -> None:
        _atomic_write(self.path / "summary.json", json.dumps(summary.to_dict(), indent=2) + "\n")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class _ImageOnce:
    """A backend whose image is prepared once per batch: the image's inputs cannot change
    during a batch, so per-run re-hashing is waste, and N workers must never race to build."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._images: dict[tuple[str, ...], str] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def prepare_image(self, extra_requirements: tuple[str, ...], progress: Progress) -> str:
        key = tuple(extra_requirements)
        with self._lock:
            if key not in self._images:
                self._images[key] = self._backend.prepare_image(key, progress)
            return self._images[key]


class _Stopped(Exception):
    """The batch is stopping; the task is left for the next session."""


@dataclass
class _Plan:
    file: TaskFile
    prepared: dict[str, PreparedRun]
    fingerprint: dict[str, Any]


def plan_batch(spec: BatchSpec) -> _Plan:
    """Read the tasks and prepare every one of them: every input problem surfaces here,
    before a lock is taken or a sandbox started."""
    if spec.max_attempts < 1:
        raise ConfigError("--max-attempts must be at least 1.", "Use 1 for no retries.")
    if spec.concurrency is not None and spec.concurrency < 1:
        raise ConfigError("--concurrency must be at least 1.", "Use 1 to run tasks one by one.")
    if spec.fail_on_error is not None and spec.fail_on_error < 0:
        raise ConfigError(
            "--fail-on-error must be a share from 0 to 1 or a count.", "e.g. 0.1 or 5"
        )
    make_scorer(spec.scorer, tolerance=spec.tolerance)  # a bad scorer fails now, not per task
    file = read_tasks(spec.tasks, on_bad_line=spec.on_bad_line)
    # Batch-wide problems (payload, model, network, secrets) are raised once, not per line.
    template = prepare(replace(spec.run, task=file.tasks[0].task, run_id="template"))
    prepared: dict[str, PreparedRun] = {}
    kept: list[Task] = []
    bad = list(file.bad_lines)
    for task in file.tasks:
        run_spec = replace(
            spec.run,
            task=task.task,
            additional_args=_merged(spec.run.additional_args, task.additional_args),
            run_id="pending",
            **task.overrides,
        )
        try:
            prepared[task.id] = prepare(run_spec)
        except OrchestratorError as exc:
            bad.append(BadLine(task.line, exc.cause))
            continue
        kept.append(task)
    if len(bad) > len(file.bad_lines):
        if spec.on_bad_line == "fail":
            raise TaskFileError(
                _listing(
                    f"{file.path} has {len(bad)} unusable line(s):",
                    [b.describe(file.path) for b in bad],
                ),
                "Fix the lines, or pass --on-bad-line skip to run the others.",
            )
        if not kept:
            raise TaskFileError(f"{file.path} holds no usable tasks.", "Fix the lines.")
    file = TaskFile(path=file.path, tasks=kept, bad_lines=sorted(bad, key=lambda b: b.line))
    run = spec.run
    fingerprint = {
        "payload": str(template.manifest.folder.resolve()),
        "model": template.model.describe(),
        "api_base": run.api_base,
        "backend": template.backend,
        "network": template.network.mode,
        "allow_hosts": list(run.allow_hosts),
        "limits": asdict(template.limits),
        "allow_dangerous_imports": run.allow_dangerous_imports,
        "scorer": spec.scorer,
        "tolerance": spec.tolerance if spec.scorer == "numeric" else None,
    }
    return _Plan(file=file, prepared=prepared, fingerprint=fingerprint)


def run_batch(
    spec: BatchSpec,
    *,
    backend: Backend | None = None,
    store: Store | None = None,
    cancel: threading.Event | None = None,
    monitor: Callable[[BatchProgress], None] | None = None,
    on_message: Callable[[str], None] | None = None,
    on_result: Callable[[dict[str, Any]], None] | None = None,
) -> BatchSummary:
    """Run (or resume) a batch and return its summary.

    Bad input raises `OrchestratorError` before anything starts. Setting `cancel` (the CLI
    does on SIGINT/SIGTERM) stops launching, cancels running sandboxes and returns an
    `interrupted` summary; so does KeyboardInterrupt, which is re-raised after cleanup.
    `monitor` is called with a progress snapshot about twice a second from the calling thread.
    """
    plan = plan_batch(spec)
    backend = backend or get_backend(plan.fingerprint["backend"], env_file=spec.run.env_file)
    store = store or Store()
    out = BatchDir(Path(spec.output))
    with out.locked():
        return _BatchRun(spec, plan, out, backend, store, cancel, monitor, on_message, on_result)()


class _BatchRun:
    """One session of a batch (the first, or a resume) inside the output directory's lock."""

    def __init__(
        self,
        spec: BatchSpec,
        plan: _Plan,
        out: BatchDir,
        backend: Backend,
        store: Store,
        cancel: threading.Event | None,
        monitor: Callable[[BatchProgress], None] | None,
        on_message: Callable[[str], None] | None,
        on_result: Callable[[dict[str, Any]], None] | None,
    ) -> None:
        self.spec = spec
        self.plan = plan
        self.tasks = {t.id: t for t in plan.file.tasks}
        self.out = out
        self.backend = _ImageOnce(backend)
        self.raw_backend = backend
        self.store = store
        self.cancel = cancel or threading.Event()
        self.stop = threading.Event()  # set on cancel and on --fail-on-error: runs are killed
        self.stop_reason: str | None = None
        self.monitor = monitor
        self.message = on_message or (lambda _text: None)
        self.on_result = on_result
        self.scorer = make_scorer(spec.scorer, tolerance=spec.tolerance)
        self.lock = threading.Lock()
        self.results: dict[str, dict[str, Any]] = {}
        self.attempt_counts: Counter[str] = Counter()
        #: Earlier sessions' attempts per task; "lost" when the process died during one.
        self.history: dict[str, list[dict[str, Any]]] = {}
        self.running = 0
        self.ran = 0
        self.retries = 0
        self.infra_failed = 0
        self.session = 1
        self.limit = 1
        self.started = time.time()

    # -- setup ------------------------------------------------------------------------------

    def __call__(self) -> BatchSummary:
        meta = self.open_batch()
        self.batch_id = meta["batch_id"]
        self.reap_orphans()
        todo = self.resume()
        limit = self.limit = self.concurrency()
        if todo:
            first = self.plan.prepared[todo[0].id]
            self.message(f"preparing the image for {first.manifest.name}")
            extra = first.manifest.requirements + _provider_requirements(first)
            self.backend.prepare_image(extra, self.message)
        self.message(
            f"batch {self.batch_id}: {len(self.tasks)} tasks, {len(self.results)} already done, "
            f"{len(todo)} to run at concurrency {min(limit, max(1, len(todo)))}"
        )
        interrupted: BaseException | None = None
        try:
            self.run_all(todo, limit)
        except KeyboardInterrupt as exc:
            interrupted = exc
        summary = self.summarize()
        self.out.write_summary(summary)
        if interrupted is not None:
            raise interrupted
        return summary

    def open_batch(self) -> dict[str, Any]:
        """Start a new batch directory, or check that a resume uses the same options."""
        meta = self.out.read_meta()
        fingerprint = json.loads(json.dumps(self.plan.fingerprint))
        if meta is None:
            meta = {
                "batch_id": "b-" + new_run_id()[2:],
                "created_at": time.time(),
                "tasks_file": str(self.plan.file.path.resolve()),
                "options": fingerprint,
                "sessions": 1,
            }
        else:
            changed = [
                f"{key}: {meta['options'].get(key)!r} → {value!r}"
                for key, value in fingerprint.items()
                if meta.get("options", {}).get(key) != value
            ]
            if changed:
                raise ConfigError(
                    f"{self.out.path} holds batch {meta['batch_id']}, started with other options "
                    f"({'; '.join(changed)}); resuming would mix results.",
                    "Resume with the same options, or use another --output directory.",
                )
            meta["sessions"] = int(meta.get("sessions", 1)) + 1
        self.session = meta["sessions"]
        self.out.write_meta(meta)
        return meta

    def reap_orphans(self) -> None:
        """Sandboxes of orchestrators that died (a SIGKILLed batch, say) are removed and their
        runs closed, so a resumed batch starts clean."""
        from .cleanup import cleanup

        try:
            report = cleanup(self.raw_backend, store=self.store)
        except Exception as exc:  # cleanup is best effort; the batch itself can still run
            self.message(f"warning: cleaning up orphaned sandboxes failed: {exc}")
            return
        if report.removed:
            self.message(f"removed {len(report.removed)} orphaned sandbox(es) of dead runs")

    def resume(self) -> list[Task]:
        """Keep results with an agent outcome; drop the lines of tasks to run again."""
        previous = self.out.load_results()
        for row in self.out.load_attempts():
            task_id, run_id = str(row.get("id")), row.get("run_id")
            if row.get("event") == "start":
                self.attempt_counts[task_id] += 1
                entry = {"attempt": row.get("attempt"), "run_id": run_id, "status": "lost",
                         "session": row.get("session")}  # fmt: skip
                self.history.setdefault(task_id, []).append(entry)
            elif row.get("event") == "end":
                for entry in self.history.get(task_id, []):
                    if entry["run_id"] == run_id:
                        entry["status"] = row.get("status")
        rerun = set(FINISHED) - {"succeeded"} if self.spec.rerun_failed else set()
        keep = {}
        for task_id, row in previous.items():
            if row.get("status") in FINISHED and row.get("status") not in rerun:
                keep[task_id] = row
            elif task_id not in self.tasks:
                keep[task_id] = row  # not ours to re-run; kept as it was
        if len(keep) != len(previous):
            again = "without an agent outcome" + (" or not succeeded" if rerun else "")
            self.message(f"running {len(previous) - len(keep)} recorded task(s) again ({again})")
            self.out.rewrite_results(list(keep.values()))
        self.results = {k: v for k, v in keep.items() if k in self.tasks}
        return [t for t in self.plan.file.tasks if t.id not in self.results]

    def concurrency(self) -> int:
        requested = self.spec.concurrency
        if requested is None:
            memory = max((p.limits.memory_mb for p in self.plan.prepared.values()), default=None)
            requested = default_concurrency(memory)
        cap = getattr(self.raw_backend, "max_concurrency", None)
        if isinstance(cap, int) and 0 < cap < requested:
            self.message(f"concurrency {requested} lowered to {cap}, the backend's limit")
            requested = cap
        return requested

    # -- running ----------------------------------------------------------------------------

    def run_all(self, todo: list[Task], limit: int) -> None:
        pending: queue.Queue[Task] = queue.Queue()
        for task in todo:
            pending.put(task)
        workers = [
            threading.Thread(target=self.worker, args=(pending,), name=f"batch-worker-{i}")
            for i in range(min(limit, len(todo)))
        ]
        for worker in workers:
            worker.start()
        try:
            while any(w.is_alive() for w in workers):
                if self.cancel.is_set() and not self.stop.is_set():
                    self.halt("interrupted")
                if self.monitor:
                    self.monitor(self.progress())
                for worker in workers:
                    worker.join(timeout=0.5 / len(workers))
        except KeyboardInterrupt:
            self.halt("interrupted")
            for worker in workers:
                worker.join()
            raise
        finally:
            if self.monitor:
                self.monitor(self.progress())

    def halt(self, reason: str) -> None:
        """Stop launching and cancel every running sandbox (each run removes its own)."""
        with self.lock:
            if self.stop_reason is None:
                self.stop_reason = reason
        self.stop.set()

    def worker(self, pending: queue.Queue[Task]) -> None:
        while not self.stop.is_set():
            try:
                task = pending.get_nowait()
            except queue.Empty:
                return
            try:
                self.run_task(task)
            except _Stopped:
                return
            except Exception as exc:  # a bug here must not take the other tasks down
                self.message(f"task {task.id}: internal error {type(exc).__name__}: {exc}")

    def run_task(self, task: Task) -> None:
        prepared = self.plan.prepared[task.id]
        first_start = time.time()
        history = list(self.history.get(task.id, []))

        def attempt() -> RunResult:
            if self.stop.is_set():
                raise _Stopped
            return self.attempt(task, prepared, history)

        def before_sleep(state: tenacity.RetryCallState) -> None:
            result = state.outcome.result() if state.outcome else None
            error = (result.error or {}) if result else {}
            wait = state.next_action.sleep if state.next_action else 0
            with self.lock:
                self.retries += 1
            self.message(
                f"task {task.id}: attempt {state.attempt_number} hit an infrastructure fault "
                f"({error.get('type')}: {error.get('message')}); retrying in {wait:.1f}s"
            )

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_result(lambda r: r.status == "infra_error"),
            stop=tenacity.stop_after_attempt(self.spec.max_attempts)
            | tenacity.stop_when_event_set(self.stop),
            wait=tenacity.wait_exponential_jitter(
                multiplier=self.spec.backoff_seconds,
                max=self.spec.backoff_max_seconds,
                jitter=self.spec.backoff_seconds,
            ),
            sleep=self.stop.wait,  # a stopping batch does not sit out a backoff
            before_sleep=before_sleep,
            retry_error_callback=lambda state: state.outcome.result() if state.outcome else None,
        )
        result: RunResult = retrying(attempt)
        if result.status == "cancelled":
            return  # stopped mid-run: no result; the next session runs it again
        self.record(task, result, history, first_start)

    def attempt(
        self, task: Task, prepared: PreparedRun, history: list[dict[str, Any]]
    ) -> RunResult:
        """One run of the task through the single-run API, logged before and after."""
        run_id = new_run_id()
        with self.lock:
            self.attempt_counts[task.id] += 1
            number = self.attempt_counts[task.id]
            self.running += 1
        self.out.append_attempt(
            {"event": "start", "id": task.id, "attempt": number, "run_id": run_id,
             "session": self.session, "ts": time.time()}
        )  # fmt: skip
        try:
            result = execute(
                replace(prepared, run_id=run_id, spec=replace(prepared.spec, batch=self.batch_id)),
                backend=self.backend,  # type: ignore[arg-type]
                store=self.store,
                cancel=self.stop,
            )
        except Exception as exc:  # before the run record existed (store, engine)
            result = RunResult(
                run_id=run_id,
                status="infra_error",
                error={"type": type(exc).__name__, "message": str(exc), "kind": "infra"},
                timings={"duration": 0.0},
            )
        finally:
            with self.lock:
                self.running -= 1
        entry = {
            "event": "end", "id": task.id, "attempt": number, "run_id": run_id,
            "session": self.session, "status": result.status, "error": result.error,
            "duration": result.timings.get("duration"), "tokens": result.token_usage,
            "record_dir": result.record_dir, "ts": time.time(),
        }  # fmt: skip
        self.out.append_attempt(entry)
        history.append({k: entry[k] for k in ("attempt", "run_id", "status", "session")})
        return result

    def record(
        self, task: Task, result: RunResult, history: list[dict[str, Any]], first_start: float
    ) -> None:
        score, score_error = self.score(task, result)
        row = {
            "id": task.id,
            "line": task.line,
            "status": result.status,
            "answer": result.answer,
            "expected": task.expected,
            "score": score,
            "duration": result.timings.get("duration"),
            "elapsed": round(time.time() - first_start, 3),
            "tokens": {
                "input": int(result.token_usage.get("input_tokens") or 0),
                "output": int(result.token_usage.get("output_tokens") or 0),
            },
            "steps": result.steps,
            "attempts": self.attempt_counts[task.id],
            "attempt_history": history,
            "run_id": result.run_id,
            "record_dir": result.record_dir,
            "error": result.error,
            "session": self.session,
            "ended_at": time.time(),
        }
        if score_error:
            row["score_error"] = score_error
        with self.lock:
            if task.id in self.results:  # cannot happen; never write a task twice
                return
            self.out.append_result(row)
            self.results[task.id] = row
            self.ran += 1
            if result.status == "infra_error":
                self.infra_failed += 1
        self.out.link_record(task.id, result.record_dir)
        if self.on_result:
            self.on_result(row)
        if result.status == "infra_error":
            self.check_fail_on_error()

    def score(self, task: Task, result: RunResult) -> tuple[float | None, str | None]:
        """None without an expected answer or when the infrastructure failed (not the
        agent's doing); 0 for an agent that failed, timed out or ran out of memory."""
        if task.expected is None or result.status not in FINISHED:
            return None, None
        if result.status != "succeeded":
            return 0.0, None
        try:
            return self.scorer(result.answer, task.expected, task.row()), None
        except Exception as exc:
            self.message(f"task {task.id}: the scorer failed: {type(exc).__name__}: {exc}")
            return None, f"{type(exc).__name__}: {exc}"

    def check_fail_on_error(self) -> None:
        limit = self.spec.fail_on_error
        if limit is None:
            return
        threshold = limit * len(self.tasks) if limit < 1 else limit
        too_many = self.infra_failed > threshold if limit < 1 else self.infra_failed >= threshold
        if too_many and not self.stop.is_set():
            self.message(
                f"stopping: {self.infra_failed} task(s) failed for infrastructure reasons "
                f"(--fail-on-error {limit:g})"
            )
            self.halt("fail_on_error")

    # -- reporting --------------------------------------------------------------------------

    def progress(self) -> BatchProgress:
        with self.lock:
            counts = Counter(row["status"] for row in self.results.values())
            return BatchProgress(
                total=len(self.tasks),
                done=len(self.results),
                running=self.running,
                counts=dict(counts),
                ran=self.ran,
                retries=self.retries,
                elapsed=time.time() - self.started,
                stopping=self.stop_reason,
            )

    def summarize(self) -> BatchSummary:
        with self.lock:
            rows = [self.results[t.id] for t in self.plan.file.tasks if t.id in self.results]
        counts = {status: 0 for status in (*FINISHED, "infra_error")}
        counts.update(Counter(row["status"] for row in rows))
        scores = [row["score"] for row in rows if row.get("score") is not None]
        correct = float(sum(scores))
        accuracy = correct / len(scores) if scores else None
        durations = [row["duration"] for row in rows if row.get("duration") is not None]
        all_tokens = {"input": 0, "output": 0}
        attempts = 0
        for entry in self.out.load_attempts():
            if entry.get("event") != "end" or entry.get("id") not in self.tasks:
                continue
            attempts += 1
            usage = entry.get("tokens") or {}
            all_tokens["input"] += int(usage.get("input_tokens") or 0)
            all_tokens["output"] += int(usage.get("output_tokens") or 0)
        state = {"interrupted": "interrupted", "fail_on_error": "stopped"}.get(
            self.stop_reason or "", "complete"
        )
        if state == "complete" and len(rows) < len(self.tasks):
            state = "interrupted"
        elapsed = time.time() - self.started
        first = next(iter(self.plan.prepared.values()))
        return BatchSummary(
            batch_id=self.batch_id,
            state=state,
            output_dir=str(self.out.path),
            tasks_file=str(self.plan.file.path),
            payload=first.manifest.name,
            model=first.model.describe(),
            scorer=self.spec.scorer,
            total=len(self.tasks),
            counts=counts,
            pending=len(self.tasks) - len(rows),
            scored=len(scores),
            correct=correct,
            accuracy=accuracy,
            accuracy_ci95=list(wilson_interval(correct, len(scores))) if scores else None,
            duration_p50=percentile(durations, 50),
            duration_p95=percentile(durations, 95),
            tokens={
                "input": sum(row["tokens"]["input"] for row in rows),
                "output": sum(row["tokens"]["output"] for row in rows),
            },
            tokens_all_attempts=all_tokens,
            attempts=attempts,
            retries=sum(max(0, int(row.get("attempts") or 1) - 1) for row in rows),
            skipped_lines=[asdict(b) for b in self.plan.file.bad_lines],
            stop_reason=self.stop_reason,
            session={
                "number": self.session,
                "started_at": self.started,
                "ended_at": time.time(),
                "wall_seconds": round(elapsed, 3),
                "tasks_run": self.ran,
                "tasks_per_minute": round(self.ran / elapsed * 60, 2) if elapsed > 0 else None,
                "concurrency": self.limit,
            },
        )


def _merged(base: dict[str, Any] | None, task: dict[str, Any] | None) -> dict[str, Any] | None:
    """The template's additional_args (shared by every task) under the task's own."""
    if base is None or task is None:
        return task if base is None else dict(base)
    return {**base, **task}


def _provider_requirements(prepared: PreparedRun) -> tuple[str, ...]:
    from .models import PROVIDERS

    return PROVIDERS[prepared.model.provider].extra_requirements
