"""Where a batch's tasks come from: datasets as evaluators have them, mapped onto task fields.

A source is a JSONL or CSV tasks file (`tasks.py`), a JSON array, a Parquet file, a Hugging
Face dataset on the hub (`hf://org/name[:config][@split]`) or a local dataset folder (saved
with `Dataset.save_to_disk`, or holding its data files; `FOLDER@split` picks a split). A field
mapping (`--field task=question`, or `<source>.fields.toml` beside the data) says which column
is which task field; with one, other columns are kept under `metadata`. Every row is checked
before anything starts (`tasks.tasks_from_rows`, errors as `source:line`, or `source:index`
for a table's rows, counted from 0 as `dataset[i]` counts them); then `--sample-id`,
`--shuffle` and `--limit` select the tasks to run.

Parquet is read with `pyarrow` and datasets with Hugging Face's `datasets`, the standard
readers of both formats (what the hub itself and pandas use); they are heavy
(benchmarks/results/code_figures.md#sizes-on-disk), so they are the optional extra
`orchestrator[datasets]`, imported only when such a source is read.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError, OrchestratorError
from ..options import TASK_ALIASES
from .tasks import (
    TASK_FIELDS,
    BadLine,
    OnBadLine,
    Rows,
    Task,
    TaskFile,
    TaskFileError,
    listing,
    missing_file,
    tasks_from_rows,
    text_rows,
)

HUB_PREFIX = "hf://"
EXTRA = "pip install 'orchestrator[datasets]'"
#: How long the hub may take to answer before its cache is read instead.
HUB_PROBE_SECONDS = 5.0
FIELDS_FIX = "Map each field to one of its columns: --field FIELD=COLUMN, or in {where}."

Table = tuple[list[str], list[dict[str, Any]]]  # its columns, its rows


def read_tasks(
    source: str | Path,
    *,
    fields: Mapping[str, str] | None = None,
    on_bad_line: OnBadLine = "fail",
    limit: int | None = None,
    sample_ids: Sequence[str] = (),
    shuffle: int | None = None,
) -> TaskFile:
    """Read every task of `source` (any format above), every row checked, then select.

    `fields`: task field -> column (`task`, `expected`, `id`, `additional_args`, `metadata`,
    a limit, or `args.NAME`), over the mapping of `<source>.fields.toml` when there is one.
    Raises TaskFileError (exit 2) for a source that cannot be read, a mapping naming a column
    the source lacks (with the columns it has), bad rows (unless `on_bad_line="skip"`),
    duplicate ids, or `sample_ids` not in it."""
    name = str(source)
    mapping = {**fields_beside(name), **(fields or {})}
    check_fields(mapping)
    columns, rows = source_rows(name, mapped=bool(mapping))
    display: str | Path = name if name.startswith(HUB_PREFIX) else Path(name)
    file = tasks_from_rows(
        display, mapped_rows(display, rows, mapping, columns), on_bad_line=on_bad_line
    )
    file.fields = mapping
    return select(file, limit=limit, sample_ids=sample_ids, shuffle=shuffle)


# --- the field mapping ----------------------------------------------------------------------


def parse_fields(items: Sequence[str]) -> dict[str, str]:
    """`--field FIELD=COLUMN` flags as a mapping (ConfigError, exit 2, for a bad one)."""
    mapping: dict[str, str] = {}
    for item in items:
        target, sep, column = item.partition("=")
        if not sep or not target.strip() or not column.strip():
            raise ConfigError(
                f"--field {item!r} is not FIELD=COLUMN.",
                "e.g. --field task=question --field expected=answer --field id=task_id",
            )
        mapping[target.strip()] = column.strip()
    check_fields(mapping)
    return mapping


def check_fields(mapping: Mapping[str, str]) -> None:
    bad = [
        t
        for t in mapping
        if TASK_ALIASES.get(t, t) not in TASK_FIELDS and not (t.startswith("args.") and t[5:])
    ]
    if bad:
        raise ConfigError(
            f"No task field {', '.join(map(repr, bad))} to map a column to.",
            f"Map columns to {', '.join(TASK_FIELDS)} or args.NAME (one argument).",
        )
    if not all(isinstance(c, str) and c for c in mapping.values()):
        raise ConfigError("Each field maps to a column's name (text).", FIELDS_FIX.format(where=""))


def fields_file(source: str) -> Path:
    """The mapping file beside a local source: `<file or folder>.fields.toml`."""
    return Path(source.rstrip("/") + ".fields.toml")


def fields_beside(source: str) -> dict[str, str]:
    """The mapping in `fields_file(source)`, {} when there is none (or the source is a hub
    dataset): flat TOML, `task = "question"`, one field a line."""
    if source.startswith(HUB_PREFIX):
        return {}
    folder, _, split = source.rpartition("@")
    path = fields_file(folder if split and not Path(source).exists() else source)
    if not path.is_file():
        return {}
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid TOML ({exc}).", 'Write task = "COLUMN"') from exc
    if not all(isinstance(v, str) for v in data.values()):
        raise ConfigError(
            f"{path}: each field maps to a column's name (text).", 'e.g. task = "question"'
        )
    return dict(data)


def mapped_rows(
    source: str | Path, rows: Rows, mapping: Mapping[str, str], columns: list[str] | None
) -> Rows:
    """Rows with the mapped columns renamed to their fields; a mapped column the source
    does not have is refused before any row (naming the columns it has)."""
    if not mapping:
        return rows
    listed = list(rows)
    if columns is None:  # JSON rows: the columns of every row
        columns = list(dict.fromkeys(k for _, r in listed if isinstance(r, dict) for k in r))
    missing = [f"{c!r} (for `{t}`)" for t, c in mapping.items() if c not in columns]
    if missing:
        where = str(source) if str(source).startswith(HUB_PREFIX) else fields_file(str(source))
        raise TaskFileError(
            f"{source} has no column {', '.join(missing)}; its columns are: "
            f"{', '.join(columns) or 'none'}.",
            FIELDS_FIX.format(where=where),
        )
    return iter([(n, r if isinstance(r, BadLine) else map_row(r, mapping)) for n, r in listed])


def map_row(row: dict[str, Any], mapping: Mapping[str, str]) -> dict[str, Any]:
    """One row as task fields: each mapped column under its field, `args.NAME` into
    `additional_args`, unmapped columns named as a task field kept as that field, every
    other column under `metadata`."""
    out: dict[str, Any] = {}
    args: dict[str, Any] = {}
    for target, column in mapping.items():
        if column in row:  # absent from one JSON row: unset (a missing `task` is named)
            (args if target.startswith("args.") else out)[target.removeprefix("args.")] = row[
                column
            ]
    used = set(mapping.values())
    extras: dict[str, Any] = {}
    for column, value in row.items():
        if column in used or column in out:
            continue
        if TASK_ALIASES.get(column, column) in TASK_FIELDS:
            out[column] = value
        else:
            extras[column] = value
    if args:
        base = out.get("additional_args")
        out["additional_args"] = {**base, **args} if isinstance(base, dict) else args
    if extras:
        meta = out.get("metadata")
        out["metadata"] = {**extras, **meta} if isinstance(meta, dict) else meta or extras
    return out


# --- sources --------------------------------------------------------------------------------


def source_rows(source: str, *, mapped: bool) -> tuple[list[str] | None, Rows]:
    """The columns (None: each JSON row has its own) and numbered rows of `source`."""
    if source.startswith(HUB_PREFIX):
        return _numbered(hub_table(source))
    path = Path(source)
    folder, _, split = source.rpartition("@")
    if not path.exists() and folder and Path(folder).is_dir():
        return _numbered(folder_table(Path(folder), split, source))
    if path.is_dir():
        return _numbered(folder_table(path, None, source))
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        return _numbered(parquet_table(path))
    if suffix == ".json" and path.is_file():
        text = path.read_text(encoding="utf-8-sig", errors="surrogateescape")
        if text.lstrip().startswith("["):
            return None, json_array_rows(path, text)
    return None, text_rows(path, mapped=mapped)


def _numbered(table: Table) -> tuple[list[str], Rows]:
    columns, rows = table
    return columns, iter([(i, _plain(row)) for i, row in enumerate(rows)])


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    """A table's row as JSON values (dates, decimals, bytes as text): what a JSONL line would
    hold, so ids derive and results write the same way."""
    plain: dict[str, Any] = json.loads(json.dumps(row, default=str))
    return plain


def json_array_rows(path: Path, text: str) -> Rows:
    """A JSON array of objects, each numbered by the line it starts on."""
    decoder = json.JSONDecoder()
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TaskFileError(
            f"{path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno}).",
            "Fix the file: a JSON array of task objects.",
        ) from exc
    position = text.index("[") + 1
    for item in items:
        while text[position] in " \t\r\n,":
            position += 1
        line = text.count("\n", 0, position) + 1
        _, position = decoder.raw_decode(text, position)
        if isinstance(item, dict):
            yield line, item
        else:
            yield line, BadLine(line, f"expected a JSON object, got {type(item).__name__}")


def _need(module: str, what: str) -> Any:
    """`module`, imported now (it is heavy and optional), or an error naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise TaskFileError(
            f"Reading {what} needs the `{module.split('.')[0]}` package, which is not installed.",
            f"Install the datasets extra: {EXTRA}.",
        ) from exc


def parquet_table(path: Path) -> Table:
    if not path.is_file():
        raise missing_file(path)
    parquet = _need("pyarrow.parquet", f"a Parquet file ({path})")
    try:
        table = parquet.read_table(path)
    except Exception as exc:  # pyarrow's own errors (ArrowInvalid...), no common base
        raise TaskFileError(f"{path} is not a readable Parquet file ({exc}).", "") from exc
    return list(table.column_names), table.to_pylist()


def folder_table(folder: Path, split: str | None, source: str) -> Table:
    """A local dataset: saved with `save_to_disk` (a Dataset or a DatasetDict), or a folder
    of data files (Parquet, CSV, JSON) as the hub lays them out."""
    datasets = _need("datasets", f"a dataset folder ({folder})")
    saved = (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()
    try:
        with quiet(datasets):
            data = (
                datasets.load_from_disk(str(folder))
                if saved
                else datasets.load_dataset(str(folder))
            )
    except Exception as exc:  # the library's own errors, no common base
        raise TaskFileError(
            f"{folder} is not a dataset folder ({type(exc).__name__}: {exc}).",
            "Pass a folder saved with Dataset.save_to_disk, or one holding its data files "
            "(.parquet, .csv, .jsonl).",
        ) from exc
    return _table(data, split, source, f"{folder}@SPLIT")


def hub_table(source: str) -> Table:
    """`hf://org/name[:config][@split]` from the hub, or from the local cache when the hub
    cannot be reached (the error names both)."""
    name, _, split = source[len(HUB_PREFIX) :].partition("@")
    name, _, config = name.partition(":")
    if not name:
        raise ConfigError(f"{source} names no dataset.", "e.g. hf://openai/gsm8k:main@test")
    datasets = _need("datasets", f"a Hugging Face dataset ({source})")
    load = (name, config or None)
    unreachable = "offline mode is on (HF_HUB_OFFLINE)" if _offline_set(datasets) else None
    unreachable = unreachable or hub_unreachable(datasets.config.HF_ENDPOINT, name)
    if unreachable is None:
        try:
            with quiet(datasets):
                data = datasets.load_dataset(*load, split=split or None)
        except ConnectionError as exc:  # the hub went away meanwhile: its cache, as below
            unreachable = str(exc)
        except Exception as exc:  # the library's own errors (not found, gated, bad config)
            raise TaskFileError(
                f"Cannot read {source} from the Hugging Face hub: {type(exc).__name__}: {exc}",
                "Check the name, config and split on the dataset's page (gated ones need "
                "HF_TOKEN).",
            ) from exc
        else:
            return _table(data, split or None, source, f"{source}@SPLIT")
    try:
        with offline(datasets), quiet(datasets):
            data = datasets.load_dataset(*load, split=split or None)
    except Exception as exc:  # not cached (FileNotFoundError, ConnectionError, ValueError)
        raise TaskFileError(
            f"Cannot read {source}: the Hugging Face hub ({datasets.config.HF_ENDPOINT}) could "
            f"not be reached ({unreachable}), and the local cache "
            f"({datasets.config.HF_DATASETS_CACHE}) holds no copy of it ({exc}).",
            "On a machine that reaches the hub, save it (datasets.load_dataset(...)"
            ".save_to_disk(FOLDER)) and pass FOLDER (or a folder of its data files) instead; "
            "or set HF_HOME to a cache that holds it.",
        ) from exc
    return _table(data, split or None, source, f"{source}@SPLIT")


def _table(data: Any, split: str | None, source: str, pick: str) -> Table:
    """One split of a loaded dataset as columns and rows; a DatasetDict of several splits
    needs `@split` (the error lists them)."""
    if isinstance(data, dict):  # a DatasetDict
        splits = list(data.keys())
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in splits:
            raise TaskFileError(
                f"{source} has the splits {', '.join(splits)}"
                + (f", not {split!r}." if split else "; which one?"),
                f"Choose one: {pick.replace('SPLIT', splits[0])}.",
            )
        data = data[split]
    elif split and getattr(data, "split", None) and str(data.split) != split:
        raise TaskFileError(f"{source} holds the split {data.split}, not {split!r}.", "")
    return list(data.column_names), data.to_list()


def hub_unreachable(endpoint: str, name: str) -> str | None:
    """Why the hub cannot be reached now (None: it answers), asked once with a short
    timeout: the library itself retries a dead hub for ~25 s before it reads its cache."""
    request = urllib.request.Request(f"{endpoint}/api/datasets/{name}", method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=HUB_PROBE_SECONDS):
            return None
    except urllib.error.HTTPError:  # an answer (401 gated, 404 unknown): the load says what
        return None
    except (urllib.error.URLError, OSError) as exc:
        return str(getattr(exc, "reason", exc))


def _offline_set(datasets: Any) -> bool:
    return bool(datasets.config.HF_HUB_OFFLINE)


@contextlib.contextmanager
def offline(datasets: Any) -> Iterator[None]:
    """The libraries in offline mode for one load (they read HF_HUB_OFFLINE once, at import;
    setting the variable now would change nothing and stay set for the caller's process)."""
    hub: Any = importlib.import_module("huggingface_hub.constants")
    before = (datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = before


@contextlib.contextmanager
def quiet(datasets: Any) -> Iterator[None]:
    """No progress bars while a dataset loads: the batch's own display owns the terminal."""
    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if shown:
            datasets.enable_progress_bars()


# --- the selection --------------------------------------------------------------------------


def select(
    file: TaskFile,
    *,
    limit: int | None = None,
    sample_ids: Sequence[str] = (),
    shuffle: int | None = None,
) -> TaskFile:
    """The tasks to run: those of `sample_ids` (all when empty), in the order `shuffle`
    (a seed) gives, the first `limit` of them. The order depends on the seed and each task's
    id only, so the same seed picks the same sample from the same tasks in any file order."""
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be at least 1, not {limit}.", "Leave it out for all.")
    tasks = file.tasks
    wanted = list(dict.fromkeys(i.strip() for i in sample_ids if i.strip()))
    if wanted:
        ids = {t.id for t in tasks}
        unknown = [i for i in wanted if i not in ids]
        if unknown:
            raise TaskFileError(
                listing(f"{file.path} has no task with the id(s):", unknown),
                f"Its ids include {', '.join(sorted(ids)[:5])}; pass ids as they are "
                "(derived ids look like t-3f2a9c1b0d4e).",
            )
        tasks = [t for t in tasks if t.id in set(wanted)]
    if shuffle is not None:
        tasks = sorted(tasks, key=lambda t: hashlib.sha256(f"{shuffle}:{t.id}".encode()).digest())
    return replace(file, tasks=tasks[:limit] if limit is not None else tasks)


def split_ids(values: Sequence[str]) -> list[str]:
    """`--sample-id a --sample-id b,c` as ['a', 'b', 'c']."""
    return [i.strip() for value in values for i in value.split(",") if i.strip()]


def is_local(source: str) -> bool:
    return not source.startswith(HUB_PREFIX)


def recorded_tasks(meta: Mapping[str, Any], *, local_only: bool = False) -> list[Task]:
    """The tasks a batch was started with (its batch.json: `meta`), read again from its tasks
    file or dataset with the field mapping it recorded; [] when that is gone or no longer
    reads (read only, best effort: rescore, export and the viewer do without task texts).
    `local_only`: not from the hub (a viewer's page does not wait on the network)."""
    path = meta.get("tasks_file")
    if not isinstance(path, str) or (local_only and not is_local(path)):
        return []
    fields = (meta.get("options") or {}).get("fields")  # the mapping it was read with
    try:
        return read_tasks(path, fields=fields, on_bad_line="skip").tasks
    except (OSError, ValueError, OrchestratorError):
        return []
