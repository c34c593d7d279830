"""A batch's books: its `batch.json` (checked on resume), a task's line in `results.jsonl`,
its score, and the session's `summary.json` (counts, accuracy with a Wilson interval and its
standard error, the epochs' reducers, durations, tokens)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ConfigError
from ..records.store import new_run_id
from ..spec import RunResult
from .budget import BUDGET_EXCEEDED, spend_summary
from .epochs import epoch_metrics
from .figures import batch_figures
from .output import BatchDir
from .plan import BatchPlan, BatchSpec, BatchSummary
from .scoring import scorer_names, wilson_interval
from .tasks import Task


def open_meta(out: BatchDir, plan: BatchPlan) -> dict[str, Any]:
    """Start a new batch directory's `batch.json`, or count one more session in it once its
    options are checked to be the same (ConfigError: a resume would mix results)."""
    meta = out.read_meta()
    fingerprint = json.loads(json.dumps(plan.fingerprint))
    if meta is None:
        meta = {
            "batch_id": "b-" + new_run_id()[2:],
            "created_at": time.time(),
            "tasks_file": plan.file.where(),
            "options": fingerprint,
            "sessions": 1,
        }
    else:
        before, now = {"epochs": 1, **meta.get("options", {})}, {"epochs": 1, **fingerprint}
        changed = [  # (epochs: absent is 1, as batch.json of one epoch leaves it out)
            f"{key}: {before.get(key)!r} → {value!r}"
            for key, value in now.items()
            if before.get(key) != value
        ]
        if changed:
            rescore = (
                f" To score the recorded answers with another scorer, run nothing: "
                f"`orchestrator batch rescore {out.path} --scorer {fingerprint.get('scorer')}`."
                if any(line.startswith("scorer:") for line in changed)
                else ""
            )
            raise ConfigError(
                f"{out.path} holds batch {meta['batch_id']}, started with other options "
                f"({'; '.join(changed)}); resuming would mix results.",
                "Resume with the same options, or use another --output directory." + rescore,
            )
        meta["sessions"] = int(meta.get("sessions", 1)) + 1
    out.write_meta(meta)
    return meta


def result_row(
    task: Task,
    result: RunResult,
    *,
    score: float | None,
    attempts: int,
    history: list[dict[str, Any]],
    first_start: float,
    session: int,
    epoch: int | None = None,
) -> dict[str, Any]:
    """A finished task's line in `results.jsonl` (the source of truth for resume); `epoch`
    only in a batch of more than one (`epochs.py`)."""
    return {
        "id": task.id,
        **({} if epoch is None else {"epoch": epoch}),
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
            "source": result.token_usage_source,  # gateway: measured on the host
        },
        "steps": result.steps,
        "attempts": attempts,
        "attempt_history": history,
        "run_id": result.run_id,
        "record_dir": result.record_dir,
        "error": None if result.error is None else result.error.to_dict(),
        "session": session,
        "ended_at": time.time(),
    }


@dataclass(frozen=True)
class SessionFacts:
    """What one session of a batch knows of itself when it writes the summary.

    `number`: the session's number (1, then one more per resume); `started`: when it
    started (epoch seconds); `ran`: how many tasks it ran; `stop_reason`: why it stopped
    early (None: it did not); `write_error`: the output file that could not be written and
    why (the batch stopped); `concurrency`: the attempt limit's own description."""

    batch_id: str
    number: int
    started: float
    ran: int
    stop_reason: str | None
    write_error: str | None
    concurrency: dict[str, Any]


def summarize(
    plan: BatchPlan,
    spec: BatchSpec,
    out: BatchDir,
    rows: list[dict[str, Any]],
    session: SessionFacts,
) -> BatchSummary:
    """The summary of a batch whose recorded task lines are `rows` (in the tasks file's
    order), after the session `session`."""
    stop_reason, write_error, started = session.stop_reason, session.write_error, session.started
    names = scorer_names(spec.scorer)
    tasks = {t.id for t in plan.file.tasks}
    units = len(tasks) * spec.epochs  # (task, epoch) pairs
    all_tokens = {"input": 0, "output": 0}
    attempts = cancelled = retries = 0
    final = {row.get("run_id") for row in rows}
    entries = out.load_attempts()
    for entry in entries:
        if entry.get("event") != "end" or entry.get("id") not in tasks:
            continue
        attempts += 1
        # A retry is an attempt after an infrastructure fault; an attempt cancelled by an
        # interrupted session is run again by the next one, and is not counted as a retry.
        cancelled += entry.get("status") == "cancelled"
        retries += entry.get("status") == "infra_error" and entry.get("run_id") not in final
        usage = entry.get("tokens") or {}
        all_tokens["input"] += int(usage.get("input_tokens") or 0)
        all_tokens["output"] += int(usage.get("output_tokens") or 0)
    stopped = {"fail_on_error": "stopped", BUDGET_EXCEEDED: "stopped"}
    state = {"interrupted": "interrupted", **stopped}.get(stop_reason or "", "complete")
    if state == "complete" and len(rows) < units:
        state = "interrupted"
    if write_error is not None:  # whatever else happened, the disk needs attention
        state, stop_reason = "stopped", f"write_error: {write_error}"
    first = next(iter(plan.prepared.values()))
    elapsed = time.time() - started
    return BatchSummary(
        batch_id=session.batch_id,
        state=state,
        output_dir=str(out.path),
        tasks_file=str(plan.file.path),
        payload=first.manifest.name,
        model=first.model.describe(),
        scorer=names[0],
        scorers=scorer_figures(names, rows) if len(names) > 1 else {},
        total=len(tasks),
        pending=units - len(rows),
        **batch_figures(rows).fields(),
        tokens={
            "input": sum(row["tokens"]["input"] for row in rows),
            "output": sum(row["tokens"]["output"] for row in rows),
        },
        tokens_all_attempts=all_tokens,
        tokens_source=tokens_source(rows),
        attempts=attempts,
        retries=retries,
        cancelled=cancelled,
        skipped_lines=[asdict(b) for b in plan.file.bad_lines],
        stop_reason=stop_reason,
        spend=spend_summary(entries, plan, spec, stop_reason, out.path),
        session={
            "number": session.number,
            "started_at": started,
            "ended_at": time.time(),
            "wall_seconds": round(elapsed, 3),
            "tasks_run": session.ran,
            "tasks_per_minute": round(session.ran / elapsed * 60, 2) if elapsed > 0 else None,
            "concurrency": session.concurrency.get("limit"),
        },
        concurrency=session.concurrency,
        epochs=spec.epochs,
        epoch_metrics=epoch_metrics(rows, spec.epochs),
    )


def scorer_figures(names: list[str], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each scorer's figures of a batch scored several ways (`--scorer A --scorer B`): how
    many it scored, their sum, its accuracy and 95 % Wilson interval."""
    figures = {}
    for name in names:
        own = [(row.get("scores") or {}).get(name) for row in rows]
        scores = [float(s) for s in own if s is not None]
        correct = sum(scores)
        figures[name] = {
            "scored": len(scores),
            "correct": correct,
            "accuracy": correct / len(scores) if scores else None,
            "accuracy_ci95": list(wilson_interval(correct, len(scores))) if scores else None,
        }
    return figures


def tokens_source(rows: list[dict[str, Any]]) -> str:
    """Where the batch's token figures come from: `gateway` (measured on the host for every
    task), `sandbox` (as the sandboxes reported them) or `mixed`."""
    sources = {(row.get("tokens") or {}).get("source", "sandbox") for row in rows}
    return sources.pop() if len(sources) == 1 else ("mixed" if sources else "sandbox")
