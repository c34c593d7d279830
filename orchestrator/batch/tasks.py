"""Tasks files (JSONL or CSV): read, validate and give every task a stable id."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..errors import OrchestratorError, Problem
from ..options import TASK_ALIASES, options_for
from ..schema import JSON_TYPES, Field, Table, check_table

#: The run options a row may set for its task (`options.RUN_OPTIONS`: the limits, ...).
OVERRIDES = {o.name: o for o in options_for("task")}
TASK_FIELDS = ("id", "task", "additional_args", "expected", "metadata", *OVERRIDES)


def _id_problem(task_id: str | int) -> str | None:
    text = str(task_id).strip()
    if not text or len(text) > 200 or any(c in text for c in "\n\r\0"):
        return "must be 1 to 200 characters on one line"
    return None


def _text_problem(text: str) -> str | None:
    return None if text.strip() else "is empty"


#: One row of a tasks file (a JSONL line, a CSV row): the fields and, per run option it may
#: override, the option's rule (a limit: the same type and range as a manifest's `[limits]`).
ROW = Table(
    {
        "id": Field(
            (str, int),
            check=_id_problem,
            fix="Give a string or an integer, or leave it out (an id is derived).",
        ),
        "task": Field(str, required=True, check=_text_problem, fix="Give the task as text."),
        "additional_args": Field(dict),
        "expected": Field(object),
        "metadata": Field(dict),
        **{name: option.rule for name, option in OVERRIDES.items()},
    },
    unknown_fix="Put other data under `metadata`.",
)


#: How many bad lines an error message lists before it says "and N more".
MAX_LISTED = 10


OnBadLine = Literal["skip", "fail"]


class TaskFileError(OrchestratorError):
    """The tasks file cannot be used as it is; nothing has been started."""


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
    #: The file (a Path), or the dataset as named (`hf://org/name@split`).
    path: Path | str
    tasks: list[Task]
    bad_lines: list[BadLine]
    #: The field mapping the rows were read with (field -> column; `sources.py`).
    fields: dict[str, str] = field(default_factory=dict)

    def where(self) -> str:
        """The source as batch.json records it: a file's absolute path, a dataset's name."""
        return str(self.path.resolve()) if isinstance(self.path, Path) else self.path


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


def nearest_tasks_file(path: Path) -> Path | None:
    """The tasks file in `path`'s folder whose name is closest to the one given (`task.jsonl`
    for `tasks.jsonl`), as the folder's path was typed; None when none is close."""
    import difflib  # only for a name that is wrong

    try:
        files = [
            p
            for p in sorted(path.parent.iterdir())
            if p.suffix.lower() in (".jsonl", ".csv", ".json", ".parquet") and p.is_file()
        ]
    except OSError:
        return None
    by_stem = {p.stem: p.name for p in reversed(files)}  # names compared without `.jsonl`
    matches = difflib.get_close_matches(path.stem, list(by_stem), n=1, cutoff=0.6)
    return path.parent / by_stem[matches[0]] if matches else None


def read_tasks(path: str | Path, *, on_bad_line: OnBadLine = "fail") -> TaskFile:
    """Parse a JSONL or CSV tasks file. Malformed lines are skipped or rejected (naming every
    one; a line with bytes that are not UTF-8 is malformed too); duplicate ids are always an
    error, since resuming keys everything on the id. (Other formats and field mappings:
    `sources.read_tasks`.)"""
    path = Path(path)
    return tasks_from_rows(path, text_rows(path), on_bad_line=on_bad_line)


def missing_file(path: Path) -> TaskFileError:
    """No tasks file at `path`: the error names the closest one beside it."""
    near = nearest_tasks_file(path)
    hint = f" Did you mean {near}?" if near else ""
    return TaskFileError(
        f"No tasks file at {path}.{hint}",
        f"Pass {near}, or another .jsonl or .csv file of tasks."
        if near
        else "Pass a .jsonl or .csv file of tasks.",
    )


Rows = Iterator[tuple[int, "dict[str, Any] | BadLine"]]


def text_rows(path: Path, *, mapped: bool = False) -> Rows:
    """The rows of a JSONL or CSV file, numbered by line. `mapped`: a field mapping renames
    the columns later, so a CSV header is not checked against the task fields here."""
    if not path.is_file():
        raise missing_file(path)
    # Bytes that are not UTF-8 become lone surrogates here, found and named line by line.
    text = path.read_bytes().decode("utf-8-sig", errors="surrogateescape")
    return _csv_rows(path, text, mapped=mapped) if _is_csv(path, text) else _jsonl_rows(text)


def tasks_from_rows(source: str | Path, rows: Rows, *, on_bad_line: OnBadLine = "fail") -> TaskFile:
    """Every row checked (`task_from_row`): bad ones skipped or the source refused, naming
    each as `source:line`; duplicate ids refused."""
    tasks: list[Task] = []
    bad: list[BadLine] = []
    problems: list[Problem] = []  # each with its line and field, for --json
    for line, row in rows:
        if isinstance(row, BadLine):
            bad.append(row)
            problems.append(Problem("", row.message, line=line))
            continue
        try:
            tasks.append(task_from_row(row, line))
        except BadRow as exc:
            bad.append(BadLine(line, str(exc)))
            problems.extend(exc.problems)
    if bad and on_bad_line == "fail":
        error = TaskFileError(
            listing(
                f"{source} has {len(bad)} malformed line(s):", [b.describe(source) for b in bad]
            ),
            "Fix the lines, or pass --on-bad-line skip to run the others.",
        )
        error.problems, error.source = tuple(problems), str(source)
        raise error
    check_duplicates(source, tasks)
    if not tasks:
        raise TaskFileError(f"{source} holds no tasks.", "Add one task per line.")
    return TaskFile(path=source, tasks=tasks, bad_lines=bad)


def check_duplicates(path: str | Path, tasks: list[Task]) -> None:
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
            problems.append(
                f"{path}:{task.line}: duplicate id {task.id!r} (first on line {seen.line})"
            )
    if problems:
        raise TaskFileError(
            listing(f"{path} has {len(problems)} duplicate task id(s):", problems),
            "Give every task a unique `id` (results and resume are keyed on it).",
        )


def listing(head: str, items: list[str]) -> str:
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


_UNDECODABLE_RE = re.compile("[\udc80-\udcff]")


def _undecodable(text: str, unit: str = "column") -> str | None:
    """The first byte that is not UTF-8 in `text` (left by `surrogateescape`), described."""
    match = _UNDECODABLE_RE.search(text)
    if match is None:
        return None
    byte = ord(match.group()) - 0xDC00
    return f"byte 0x{byte:02x} at {unit} {match.start() + 1} is not valid UTF-8"


def _jsonl_rows(text: str) -> Iterator[tuple[int, dict[str, Any] | BadLine]]:
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        problem = _undecodable(line)
        if problem:
            yield number, BadLine(number, problem)
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


def _csv_rows(
    path: Path, text: str, *, mapped: bool = False
) -> Iterator[tuple[int, dict[str, Any] | BadLine]]:
    """CSV with a header row. Empty cells are unset; `additional_args` and `metadata` cells
    hold JSON objects; `args.NAME` columns add one argument each (JSON, else text)."""
    reader = csv.reader(io.StringIO(text))
    try:
        header = next(reader)
    except StopIteration:
        return
    except csv.Error as exc:
        raise TaskFileError(f"{path}:1: not a CSV header ({exc}).", "Fix the header.") from exc
    problem = _undecodable(",".join(header), "character")
    if problem:
        raise TaskFileError(f"{path}:1: header: {problem}.", "Save the file as UTF-8.")
    header = [h.strip() for h in header]
    header_end = reader.line_num
    unknown = [
        h for h in header if TASK_ALIASES.get(h, h) not in TASK_FIELDS and not h.startswith("args.")
    ]
    if (unknown or "task" not in header) and not mapped:
        problem = (
            f"unknown column(s) {', '.join(map(repr, unknown))}" if unknown else "no `task` column"
        )
        raise TaskFileError(
            f"{path}:1: {problem}.",
            f"Columns may be {', '.join([*TASK_FIELDS, *TASK_ALIASES])} and args.NAME; "
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
            undecodable = _undecodable(cell, "character")
            if undecodable:
                problem = f"column `{name}`: {undecodable}"
                break
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


class BadRow(ValueError):
    """A row with problems; `problems` names each field (message: all of them, for
    `file:line: message`)."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("; ".join(_row_problem(p) for p in problems))


def task_from_row(row: dict[str, Any], line: int) -> Task:
    """Validate one row against `ROW`; raises BadRow (a ValueError) naming every problem
    of the row, with a message fit for `file:line: message`."""
    row = {TASK_ALIASES.get(k, k): v for k, v in row.items()}
    for name in ("id", "additional_args", "metadata", *OVERRIDES):
        if row.get(name) is None or (name == "id" and row[name] == ""):
            row.pop(name, None)  # unset: a derived id, no override
        elif name in OVERRIDES and isinstance(row[name], str):  # a CSV cell
            row[name] = _from_text(row[name], OVERRIDES[name].kind)
    values, problems = check_table(ROW, row, types=JSON_TYPES)
    if problems:
        raise BadRow([p.replace(message=f"`{p.field}` {p.message}", line=line) for p in problems])
    text = values["task"]
    args = values.get("additional_args")
    task_id = str(values["id"]).strip() if "id" in values else derive_id(text, args)
    return Task(
        id=task_id,
        task=text,
        line=line,
        additional_args=args,
        expected=values.get("expected"),
        overrides={k: OVERRIDES[k].value(v) for k, v in values.items() if k in OVERRIDES},
        metadata=values.get("metadata"),
    )


def _from_text(value: str, kind: type) -> Any:
    """A CSV cell as the option's type: a number, true/false; else the text as written
    (refused by the schema if it is not text it may be)."""
    if kind is bool and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if kind not in (int, float):
        return value
    try:
        return float(value) if kind is float else int(value)
    except ValueError:
        return value


def _row_problem(problem: Problem) -> str:
    fix = problem.fix.rstrip(".")
    return problem.message + (f" ({fix[:1].lower()}{fix[1:]})" if fix else "")


def merged_args(base: dict[str, Any] | None, task: dict[str, Any] | None) -> dict[str, Any] | None:
    """The template's additional_args (shared by every task) under the task's own."""
    if base is None or task is None:
        return task if base is None else dict(base)
    return {**base, **task}
