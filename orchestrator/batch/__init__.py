"""Batch: every task of a tasks file in its own sandbox, scored, resumable; built on the
single-run API (`runner.prepare` / `runner.execute`).

`tasks.py` the tasks file, `scoring.py` scorers and statistics, `output.py` the output
folder, `plan.py` the batch as data and its up-front checks, `session.py` the worker session.
"""

from .output import BatchDir, BatchLocked
from .plan import BatchProgress, BatchSpec, BatchSummary, plan_batch
from .scoring import BUILTIN_SCORERS, make_scorer, percentile, wilson_interval
from .session import run_batch
from .tasks import Task, TaskFile, TaskFileError, derive_id, read_tasks

__all__ = [
    "BUILTIN_SCORERS",
    "BatchDir",
    "BatchLocked",
    "BatchProgress",
    "BatchSpec",
    "BatchSummary",
    "Task",
    "TaskFile",
    "TaskFileError",
    "derive_id",
    "make_scorer",
    "percentile",
    "plan_batch",
    "read_tasks",
    "run_batch",
    "wilson_interval",
]
