"""Batch: every task of a tasks file in its own sandbox, scored, resumable. Each attempt is
prepared with the single-run API (`lifecycle.runner.prepare`) and handed to an executor
(`execution.executor`), which decides where it runs.

`tasks.py` the tasks file, `sources.py` other datasets (Parquet, JSON arrays, Hugging Face)
and the field mapping, `plan.py` the batch as data and its up-front checks,
`session.py` the worker session, `attempts.py` its attempts counted and logged (and the retry
rule), `pace.py` how many attempts at once, `output.py` the output folder, `ledger.py` what
is written there (batch.json, result lines, summary.json), `figures.py` the figures the
summary and the report share,
`budget.py` the spend caps, `prices.py` what calls cost, `scoring.py` scorers and
statistics, `epochs.py` a task's epochs reduced (pass@k, clustered standard error),
`stats.py` the formulas, `grading.py` several scorers together, `judge.py` the model
scorer's judge, `report.py` a batch read back, `rescore.py` recorded answers scored again,
`compare.py` two batches paired, `evaluate.py` a batch from keyword arguments
(`orchestrator.evaluate`), `export.py` (with `attempt_rows.py`, `inspect_log.py`) a batch for
other tools: Inspect AI's eval log, Parquet.
"""

from .output import BatchDir, BatchLocked
from .plan import BatchProgress, BatchSpec, BatchSummary, plan_batch
from .scoring import BUILTIN_SCORERS, make_scorer, percentile, wilson_interval
from .session import BatchObservers, run_batch
from .sources import read_tasks
from .tasks import Task, TaskFile, TaskFileError, derive_id

__all__ = [
    "BatchObservers",
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
