"""A batch as an Inspect AI eval log, built from Inspect AI's own types (`EvalLog`,
`EvalSpec`, `EvalSample`, `EvalResults`, ...): each attempt a sample (id the task id, epoch
the attempt's), the batch's scorers as Inspect scorers with Inspect's own `accuracy` and
`stderr` metrics, the batch's state as the log's status.

Imported only by `export.write_inspect`, once the `export` extra is known to be installed:
importing Inspect AI takes seconds.
"""

from __future__ import annotations

import re
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from inspect_ai.log import (
    EvalConfig,
    EvalDataset,
    EvalError,
    EvalLog,
    EvalMetric,
    EvalResults,
    EvalSample,
    EvalSampleReductions,
    EvalScore,
    EvalSpec,
    EvalStats,
)
from inspect_ai.log import EvalSampleScore as InspectSampleScore
from inspect_ai.model import ChatMessageAssistant, ChatMessageUser, ModelOutput, ModelUsage
from inspect_ai.scorer import CORRECT, INCORRECT, SampleScore, Score, accuracy, mean_score, stderr

from ..paths import VERSION
from .attempt_rows import AttemptRow, BatchExport, as_text, timestamp
from .output import FINISHED

#: Said as a sample's input when the tasks file is gone (results.jsonl keeps no task text).
NO_TASK_TEXT = "(the task's text: its tasks file is no longer where the batch read it)"


def inspect_model(description: str) -> str:
    """Inspect's `provider/model` from our `provider:model (at ..., the program's ...)`."""
    name = description.split(" ", 1)[0]
    provider, _, model = name.partition(":")
    return f"{provider}/{model}" if model else name


def inspect_id(batch_id: str) -> str:
    """The batch id as Inspect's ids are spelled (no `-`: its file names split on it)."""
    return batch_id.replace("-", "")


def log_path(export: BatchExport) -> Path:
    """Where an eval log goes by default: `BATCH/inspect/`, named as Inspect names its logs
    (`<created>_<task>_<id>.eval`), so `inspect view --log-dir BATCH/inspect` lists it."""
    created = timestamp(export.meta.get("created_at")) or datetime.now(timezone.utc)
    stamp = created.strftime("%Y-%m-%dT%H-%M-%S+00-00")
    task = re.sub(r"[^A-Za-z0-9-]+", "-", export.payload).strip("-") or "batch"
    return export.path / "inspect" / f"{stamp}_{task}_{inspect_id(export.batch_id)}.eval"


def iso(seconds: float | None) -> str:
    stamp = datetime.fromtimestamp(seconds or 0.0, timezone.utc)
    return stamp.isoformat()


Status = Literal["started", "success", "cancelled", "error"]


def log_status(export: BatchExport) -> tuple[Status, EvalError | None]:
    """Inspect's status for the batch's state: `success` for a complete batch whose every
    task has an agent outcome; `cancelled` interrupted; `error` stopped (a cap, a write
    error, --fail-on-error) or infrastructure errors left; `started` while no summary yet."""
    summary = export.summary
    state = summary.get("state")
    if state is None:
        return "started", None
    if state == "interrupted":
        return "cancelled", None
    left = int((summary.get("counts") or {}).get("infra_error") or 0)
    if state == "complete" and not left and not summary.get("pending"):
        return "success", None
    why = summary.get("stop_reason") or f"{left} task(s) ended in infra_error"
    return "error", EvalError(message=f"batch {state}: {why}", traceback="", traceback_ansi="")


def binary(export: BatchExport, scorer: str) -> bool:
    """Whether a scorer's scores are all 0 or 1: then written as Inspect's C and I."""
    return all(a.scores.get(scorer) in (None, 0, 1) for a in export.attempts)


def score_value(value: float, as_letters: bool) -> str | float:
    if as_letters:
        return CORRECT if value >= 1 else INCORRECT
    return float(value)


def sample(
    export: BatchExport, attempt: AttemptRow, model: str, letters: dict[str, bool]
) -> EvalSample:
    """The attempt as an `EvalSample`: input the task's text, target the expected answer(s),
    output the answer, one score per scorer (none when unscored), our figures as metadata.
    An infrastructure error (not the agent's outcome, never scored) is the sample's error."""
    task = export.tasks.get(attempt.task_id)
    completion = as_text(attempt.answer) or ""
    expected = attempt.expected
    target = [as_text(e) or "" for e in expected] if isinstance(expected, list) else None
    text = task.task if task else NO_TASK_TEXT
    usage = ModelUsage(
        input_tokens=attempt.input_tokens,
        output_tokens=attempt.output_tokens,
        total_tokens=attempt.input_tokens + attempt.output_tokens,
        total_cost=attempt.cost_usd,
    )
    scores = {
        name: Score(value=score_value(value, letters[name]), answer=completion)
        for name, value in attempt.scores.items()
        if value is not None
    }
    started = (
        (attempt.ended_at - attempt.duration) if attempt.ended_at and attempt.duration else None
    )
    finished = attempt.status in FINISHED
    failure = None if attempt.status == "succeeded" else attempt.error or attempt.status
    return EvalSample(
        id=attempt.task_id,
        epoch=attempt.epoch,
        input=text,
        target=target if target is not None else as_text(expected) or "",
        messages=[ChatMessageUser(content=text), ChatMessageAssistant(content=completion)],
        output=ModelOutput.from_content(model, completion, error=failure),
        scores=scores or None,
        metadata={
            "run_id": attempt.run_id,
            "status": attempt.status,
            "error": attempt.error or None,
            "line": attempt.line,
            "steps": attempt.steps,
            "attempts": attempt.attempts,
            "tokens_source": attempt.tokens_source,
            "record_dir": attempt.record_dir,
            "additional_args": task.additional_args if task else None,
            "task_metadata": task.metadata if task else None,
        },
        model_usage={model: usage},
        started_at=iso(started) if started else None,
        completed_at=iso(attempt.ended_at) if attempt.ended_at else None,
        total_time=attempt.duration,
        working_time=attempt.duration,
        error=None
        if finished
        else EvalError(
            message=f"{attempt.status}: {attempt.error}".rstrip(": "),
            traceback="",
            traceback_ansi="",
        ),
    )


def results(
    export: BatchExport, samples: list[EvalSample], letters: dict[str, bool]
) -> tuple[EvalResults, list[EvalSampleReductions]]:
    """Each scorer's `accuracy` and `stderr`, computed by Inspect's own metrics over the
    scored tasks; with several epochs a task's scores are first reduced to their mean, as
    Inspect reduces epochs."""
    epochs = max((s.epoch for s in samples), default=1)
    scores, reductions = [], []
    for name in export.scorers:
        by_task: dict[str, list[Score]] = defaultdict(list)
        for each in samples:
            if each.scores and name in each.scores:
                by_task[str(each.id)].append(each.scores[name])
        reduce = mean_score()
        reduced = [
            SampleScore(score=reduce(found) if epochs > 1 else found[0], sample_id=task_id)
            for task_id, found in by_task.items()
        ]
        if epochs > 1:
            reductions.append(
                EvalSampleReductions(
                    scorer=name,
                    reducer="mean",
                    samples=[
                        InspectSampleScore(**r.score.model_dump(), sample_id=r.sample_id)
                        for r in reduced
                    ],
                )
            )
        metrics = {}
        if reduced:
            for metric, compute in (("accuracy", accuracy()), ("stderr", stderr())):
                value = compute(reduced)  # type: ignore[arg-type]  # SampleScore since 0.3.50
                metrics[metric] = EvalMetric(name=metric, value=float(value))  # type: ignore[arg-type]
        scores.append(
            EvalScore(
                name=name,
                scorer=name,
                reducer="mean" if epochs > 1 else None,
                scored_samples=len(reduced),
                unscored_samples=len({str(s.id) for s in samples}) - len(reduced),
                metrics=metrics,
                metadata={"values": "C/I" if letters[name] else "numeric"},
            )
        )
    summary = export.summary
    return (
        EvalResults(
            total_samples=len(samples),
            completed_samples=sum(1 for s in samples if s.error is None),
            scores=scores,
            metadata={
                "accuracy_ci95_wilson": summary.get("accuracy_ci95"),
                "counts": summary.get("counts"),
                "state": summary.get("state"),
            },
        ),
        reductions,
    )


def eval_spec(export: BatchExport, model: str, epochs: int) -> EvalSpec:
    """The batch as an eval: task the payload, model ours as `provider/model`, dataset the
    tasks file, run and eval id the batch id."""
    options = export.meta.get("options") or {}
    tasks_file = str(export.meta.get("tasks_file") or export.summary.get("tasks_file") or "")
    import inspect_ai  # for its version

    return EvalSpec(
        eval_id=export.batch_id,
        run_id=export.batch_id,
        created=iso(export.meta.get("created_at")),
        task=export.payload,
        task_id=inspect_id(export.batch_id),
        task_file=options.get("payload"),
        solver="orchestrator",
        dataset=EvalDataset(
            name=Path(tasks_file).stem if tasks_file else None,
            location=tasks_file or None,
            samples=int(export.summary.get("total") or len({a.task_id for a in export.attempts})),
            sample_ids=list(dict.fromkeys(a.task_id for a in export.attempts)),
        ),
        model=model,
        model_base_url=options.get("api_base"),
        config=EvalConfig(epochs=epochs),
        packages={"orchestrator": VERSION, "inspect_ai": inspect_ai.__version__},
        metadata={
            "orchestrator": {
                "batch_dir": str(export.path),
                "model": export.model,
                "options": options,
                "sessions": export.meta.get("sessions"),
            }
        },
    )


def eval_log(export: BatchExport) -> EvalLog:
    """The whole log: spec, samples, results, stats and status."""
    model = inspect_model(export.model)
    letters = {name: binary(export, name) for name in export.scorers}
    samples = [sample(export, a, model, letters) for a in export.attempts]
    epochs = max((a.epoch for a in export.attempts), default=1)
    status, error = log_status(export)
    scored, reductions = results(export, samples, letters)
    session = export.summary.get("session") or {}
    inputs = sum(a.input_tokens for a in export.attempts)
    outputs = sum(a.output_tokens for a in export.attempts)
    log = EvalLog(
        status=status,
        eval=eval_spec(export, model, epochs),
        results=scored,
        stats=EvalStats(
            started_at=iso(export.meta.get("created_at")),
            completed_at=iso(session.get("ended_at")) if session.get("ended_at") else "",
            model_usage={
                model: ModelUsage(
                    input_tokens=inputs, output_tokens=outputs, total_tokens=inputs + outputs
                )
            },
        ),
        error=error,
        samples=samples,
    )
    # Set after: EvalLog's validator fails on `reductions` given beside an EvalResults object.
    log.reductions = reductions or None
    return log
