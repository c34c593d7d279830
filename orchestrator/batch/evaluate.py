"""`orchestrator.evaluate`: a batch from keyword arguments, for evaluation scripts and
notebooks. A thin layer over `run_batch`: the options are `RunSpec`'s and `BatchSpec`'s own
fields, so a field either gains is an argument here with nothing to add.

(Not `orchestrator.batch(...)`: that name is this sub-package, which Python's import system
sets on `orchestrator` whenever any of its modules is imported, so a function of that name
would be replaced by the module after its first call.)"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

from ..images.imagedef import Progress
from ..spec import RunSpec
from .plan import BatchProgress, BatchSpec, BatchSummary
from .session import BatchObservers, run_batch

_RUN = {f.name for f in dataclass_fields(RunSpec)} - {
    "payload",
    "task",
    "run_id",
    "batch",
    "task_id",
}
_BATCH = {f.name for f in dataclass_fields(BatchSpec)} - {
    "tasks",
    "output",
    "run",
    "field_map",  # `fields` here
    "sample_ids",
}


def evaluate(
    payload: str | Path,
    tasks: str | Path,
    *,
    output: str | Path | None = None,
    fields: Mapping[str, str] | None = None,
    sample_ids: str | tuple[str, ...] | list[str] = (),
    on_result: Callable[[dict[str, Any]], None] | None = None,
    on_message: Progress | None = None,
    monitor: Callable[[BatchProgress], None] | None = None,
    cancel: threading.Event | None = None,
    **options: Any,
) -> BatchSummary:
    """Run (or resume) `payload` on every task of `tasks` and return the summary that
    `orchestrator batch` prints (`BatchSummary`: counts, accuracy and its interval, tokens,
    durations; `.to_dict()` for JSON).

    `tasks`: any source `orchestrator batch` takes (a JSONL, CSV, JSON or Parquet file,
    `hf://org/name[:config][@split]`, a dataset folder); `fields`: task field -> column
    (`{"task": "question", "expected": "answer"}`); `sample_ids`: an id, or several.
    `options`: any field of `RunSpec` (`model`, `network`, `timeout_seconds`, `max_steps`...)
    or of `BatchSpec` (`concurrency`, `scorer`, `limit`, `shuffle`, `max_cost`...), by name.
    `output`: the batch folder (default `./batches/PAYLOAD-TASKS`; the same one resumes).
    `on_result` sees each task's result row as it is recorded, `on_message` what the batch
    says, `monitor` a progress snapshot twice a second; set `cancel` to stop it.

    Raises TypeError for an option that is neither, and OrchestratorError (exit code 2 on
    the command line) for bad input, before any sandbox starts. The summary's `exit_code`
    says how it ended (0 every task has an outcome, 5 infrastructure faults or a cap, 130
    interrupted)."""
    unknown = sorted(set(options) - _RUN - _BATCH)
    if unknown:
        raise TypeError(
            f"evaluate() got unknown option(s) {', '.join(unknown)}; it takes RunSpec's "
            f"fields ({', '.join(sorted(_RUN))}) and BatchSpec's ({', '.join(sorted(_BATCH))})"
        )
    run = RunSpec(payload=payload, **{k: v for k, v in options.items() if k in _RUN})
    ids = (sample_ids,) if isinstance(sample_ids, str) else tuple(sample_ids)
    spec = BatchSpec(
        tasks=tasks,
        output=output,
        run=run,
        field_map=dict(fields or {}),
        sample_ids=ids,
        **{k: v for k, v in options.items() if k in _BATCH},
    )
    observers = BatchObservers(
        cancel=cancel or threading.Event(),
        monitor=monitor,
        on_message=on_message,
        on_result=on_result,
    )
    return run_batch(spec, observers=observers)
