"""A batch's attempts, counted and logged: the retry rule a task's attempts follow, how many
each task has had (earlier sessions' too), what became of each (its history), and their
start and end lines in attempts.jsonl. The session (`session.py`) decides when to make one.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import tenacity

from ..execution.executor import Attempt
from ..lifecycle.outcome import unrun
from ..spec import RunError, RunResult
from .budget import Spend
from .epochs import Key, key
from .output import BatchDir, OutputWriteError
from .plan import BatchSpec


def retrying(
    spec: BatchSpec,
    stop: threading.Event,
    sleep: Callable[[float], None],
    before_sleep: Callable[[tenacity.RetryCallState], None],
) -> tenacity.Retrying:
    """The batch's retry rule: only `infra_error` runs again, up to `max_attempts`, after an
    exponential backoff with jitter; never once `stop` is set. The last result is returned
    whatever it was (nothing is raised for the retries running out)."""
    return tenacity.Retrying(
        retry=tenacity.retry_if_result(lambda r: r.status == "infra_error"),
        stop=tenacity.stop_after_attempt(spec.max_attempts) | tenacity.stop_when_event_set(stop),
        wait=tenacity.wait_exponential_jitter(
            multiplier=spec.backoff_seconds,
            max=spec.backoff_max_seconds,
            jitter=spec.backoff_seconds,
        ),
        sleep=sleep,
        before_sleep=before_sleep,
        retry_error_callback=lambda state: state.outcome.result() if state.outcome else None,
    )


def infra_result(run_id: str, exc: Exception) -> RunResult:
    """The result of an attempt whose executor raised before the run record existed (the
    store, the engine): `infra_error`, retried like any other."""
    return unrun(run_id, RunError.of(exc, kind="infra"), timings={"duration": 0.0})


class AttemptLog:
    """The attempts of a batch's tasks: their numbers per (task, epoch), their history from
    earlier sessions, their lines in attempts.jsonl. `lock` is the session's (the counts
    change under it, from the workers' threads). With `epochs` > 1 each line names its epoch
    (`epochs.py`); with one, lines are as they always were."""

    def __init__(self, out: BatchDir, lock: threading.Lock, epochs: int = 1) -> None:
        self.out = out
        self.lock = lock
        self.epochs = epochs
        self.counts: Counter[Key] = Counter()
        #: Earlier sessions' attempts per (task, epoch); "lost" when the process died in one.
        self.history: dict[Key, list[dict[str, Any]]] = {}

    def where(self, unit: Key) -> dict[str, Any]:
        """The fields that name a (task, epoch) in a line: its id, and its epoch if any."""
        return {"id": unit[0], **({"epoch": unit[1]} if self.epochs > 1 else {})}

    def load(self) -> None:
        """Count earlier sessions' attempts per task and keep what became of each (an
        attempt with a start line and no end line is `lost`)."""
        for row in self.out.load_attempts():
            unit, run_id = key({"id": None, **row}), row.get("run_id")  # no epoch: 1
            if row.get("event") == "start":
                self.counts[unit] += 1
                entry = {
                    "attempt": row.get("attempt"),
                    "run_id": run_id,
                    "status": "lost",
                    "session": row.get("session"),
                }
                self.history.setdefault(unit, []).append(entry)
            elif row.get("event") == "end":
                for entry in self.history.get(unit, []):
                    if entry["run_id"] == run_id:
                        entry["status"] = row.get("status")

    def count(self, unit: Key) -> int:
        """One more attempt of the (task, epoch); returns its number."""
        with self.lock:
            self.counts[unit] += 1
            return self.counts[unit]

    def uncount(self, unit: Key) -> None:
        """The attempt last counted never started (no sandbox, or no start line)."""
        with self.lock:
            self.counts[unit] -= 1

    def started(self, unit: Key, attempt: Attempt, session: int) -> None:
        """The attempt's start line. Raises OutputWriteError, the attempt uncounted: it
        never started, and the next session runs it."""
        try:
            self.out.append_attempt(
                {
                    "event": "start",
                    **self.where(unit),
                    "attempt": attempt.number,
                    "run_id": attempt.run_id,
                    "session": session,
                    "ts": time.time(),
                }
            )
        except OutputWriteError:
            self.uncount(unit)
            raise

    def ended(
        self,
        unit: Key,
        attempt: Attempt,
        session: int,
        result: RunResult,
        spend: Spend,
        history: list[dict[str, Any]],
    ) -> None:
        """The attempt's end line (with its cost, and whether a spend cap stopped it), then
        its entry in the task's `history`. Raises OutputWriteError (no entry then)."""
        run_id = attempt.run_id
        entry = {
            "event": "end",
            **self.where(unit),
            "attempt": attempt.number,
            "run_id": run_id,
            "session": session,
            "status": result.status,
            "error": None if result.error is None else result.error.to_dict(),
            "duration": result.timings.get("duration"),
            "tokens": result.token_usage,
            "record_dir": result.record_dir,
            "ts": time.time(),
            "tokens_source": result.token_usage_source,
        }
        entry.update(spend.ended(run_id, result))  # its cost; stopped by a cap?
        self.out.append_attempt(entry)
        history.append({k: entry[k] for k in ("attempt", "run_id", "status", "session")})
