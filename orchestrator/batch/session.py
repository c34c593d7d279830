"""Batch evaluation: every task of a dataset in its own fresh sandbox, in parallel, scored,
resumable, with nothing lost or written twice.

The life of a batch, top to bottom:

  read the tasks file (bad lines named by number; duplicate ids refused)
  → prepare every task with the single-run API (bad input fails before anything starts)
  → lock the output directory (one batch writes to it at a time)
  → clean up sandboxes that dead orchestrators left behind
  → resume: tasks with a result are done; unfinished and infra-failed ones run again
    (with --epochs N, each (task, epoch) is its own unit of work: run, retried, recorded)
  → the executor gets ready (`executor.py`; on this host: the image once, warm sandboxes
    when there are more tasks than workers) → N workers hand each task's attempts to it,
    retrying only infrastructure faults (with exponential backoff and jitter); every
    attempt is logged
  → each result is appended to `results.jsonl` and fsynced as its task ends
  → `summary.json` (`ledger.py`): counts per status, accuracy, durations, tokens.

Output directory:

  batch.json      the batch's id and the options it was started with (checked on resume)
  results.jsonl   one line per finished task (the source of truth for resume)
  attempts.jsonl  a start and an end line for every attempt, retries and cancels included
  summary.json    written at the end of every session (complete, interrupted or stopped)
  runs/<id>       a link to the run record of each task's final attempt

What a batch is lives here; where its attempts run is the executor's (`executor.py`).

Over 500 lines for a reason: the workers, the stop rules, retries, the spend caps and the
scorers all share one lock and one view of what is done (`_BatchRun`); split across files
they would reach into each other's state. Its parts that need none of it live beside it
(`attempts.py`, `budget.py`, `grading.py`, `epochs.py`, `ledger.py`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import tenacity

from ..backends.base import Backend
from ..execution.concurrency import Slots
from ..execution.executor import Attempt, AttemptExecutor, DelegatingExecutor, LocalExecutor
from ..execution.pool import MIN_BUILDERS
from ..images.imagedef import Progress
from ..lifecycle.interrupts import stop_on_interrupt
from ..lifecycle.runner import PreparedRun, RunObservers
from ..records.store import Store
from ..spec import RunResult, StopRequest
from .attempts import AttemptLog, infra_result, retrying
from .budget import Spend, cap_reached_before
from .epochs import Key, units
from .grading import Scoring
from .ledger import SessionFacts, open_meta, result_row, summarize
from .output import FINISHED, BatchDir, OutputWriteError
from .pace import batch_limit, describe
from .plan import (
    BatchPlan,
    BatchProgress,
    BatchSpec,
    BatchSummary,
    check_payload_loads,
    default_output,
    plan_batch,
)
from .scoring import MODEL_SCORER, scorer_names
from .tasks import Task


class _Stopped(Exception):
    """The batch is stopping; the task is left for the next session."""


@dataclass(frozen=True)
class BatchObservers:
    """Who watches a batch and who may stop it (as `RunObservers` for one run).

    `cancel`: set it to stop the batch (SIGINT/SIGTERM in the CLI); `monitor`: a progress
    snapshot twice a second, from the calling thread; `on_message`: what the batch says as
    it goes (retries, stops, warm sandboxes); `on_result`: each task's result row as it is
    recorded."""

    cancel: threading.Event = field(default_factory=threading.Event)
    monitor: Callable[[BatchProgress], None] | None = None
    on_message: Progress | None = None
    on_result: Callable[[dict[str, Any]], None] | None = None


def run_batch(
    spec: BatchSpec,
    *,
    executor: AttemptExecutor | None = None,
    backend: Backend | None = None,
    store: Store | None = None,
    observers: BatchObservers | None = None,
) -> BatchSummary:
    """Run (or resume) a batch and return its summary.

    Bad input raises `OrchestratorError` before anything starts. Setting `cancel` (the CLI
    does on SIGINT/SIGTERM) stops launching, cancels running sandboxes and returns an
    `interrupted` summary; Ctrl-C sets `cancel` (`interrupts.py`), then raises
    KeyboardInterrupt once the summary is written and every sandbox removed.
    An output file that cannot be written (disk full, read-only) stops the batch the same
    way: a `stopped` summary, `stop_reason` `write_error: cannot write PATH: ERROR` (exit
    code 5; nothing half-written: the same call resumes); before any task, `OutputWriteError`.
    `observers`: the cancel event and who is told what happens (`BatchObservers`).
    `executor`: where the attempts run (default: this host, `LocalExecutor`), opened and
    closed by the batch."""
    if spec.output is None:
        spec = replace(spec, output=default_output(spec.run.payload, spec.tasks))
    plan = plan_batch(spec)
    observers = observers or BatchObservers()
    executor = executor or LocalExecutor(
        backend, pool_size=spec.warm, on_message=observers.on_message
    )
    store = store or Store()
    assert spec.output is not None  # the default was filled in above
    out = BatchDir(Path(spec.output))
    done = out.done_ids(rerun_failed=spec.rerun_failed)
    todo = {(t.id, e) for t, e in units(plan.file.tasks, spec.epochs)} - done
    with stop_on_interrupt(observers.cancel):
        if todo and not cap_reached_before(spec, plan):
            check_payload_loads(plan, executor, store, observers.cancel)
        with out.locked():
            return _BatchRun(spec, plan, out, executor=executor, store=store, observers=observers)()


class _BatchRun:
    """One session of a batch (the first, or a resume) inside the output directory's lock."""

    def __init__(
        self,
        spec: BatchSpec,
        plan: BatchPlan,
        out: BatchDir,
        *,
        executor: AttemptExecutor,
        store: Store,
        observers: BatchObservers,
    ) -> None:
        self.spec = spec
        self.plan = plan
        self.tasks = {t.id: t for t in plan.file.tasks}
        self.out = out
        self.executor = DelegatingExecutor(executor)  # the optional parts answer if it lacks them
        #: The batch's run template: what the executor gets ready for.
        self.template = next(iter(plan.prepared.values()))
        self.store = store
        self.cancel = observers.cancel
        self.stop = StopRequest()  # on cancel, --fail-on-error, a spend cap, a write error
        self.stop_reason: str | None = None
        #: The first output file that could not be written: the batch stops at it.
        self.write_error: OutputWriteError | None = None
        self.monitor = observers.monitor
        self.message = observers.on_message or (lambda _text: None)
        self.on_result = observers.on_result
        self.lock = threading.Lock()
        self.results: dict[Key, dict[str, Any]] = {}  # by (task id, epoch): `epochs.py`
        self.epochs = spec.epochs
        self.attempts = AttemptLog(out, self.lock, spec.epochs)  # counts, history, attempts.jsonl
        self.running = 0
        self.ran = 0
        self.retries = 0
        self.infra_failed = 0
        self.session = 1
        self.slots: Slots  # how many attempts at once (`pace.py`), from the session's start
        self.started = time.time()
        self.spend = Spend(
            spec,
            plan,
            out.load_attempts(),
            stop=self.stop,
            on_reached=self.halt,
            message=self.message,
        )
        #: The batch's scorers; the judge's calls count in its spend (`grading.py`).
        self.scoring = Scoring(
            scorer_names(spec.scorer),
            tolerance=spec.tolerance,
            judge=spec.judge,
            folder=out.path,
            on_call=self.spend.judged,
        )
        self.scoring.message = self.message

    # -- setup ------------------------------------------------------------------------------

    def __call__(self) -> BatchSummary:
        meta = open_meta(self.out, self.plan)
        self.batch_id, self.session = meta["batch_id"], meta["sessions"]
        self.reap_orphans()
        todo = self.resume()
        todo = [] if self.spend.check() else todo  # earlier sessions spent the cap already
        self.first = self.plan.prepared[todo[0][0].id] if todo else self.template
        control = batch_limit(
            self.spec,
            list(self.plan.prepared.values()),
            self.executor,
            todo=len(todo),
            message=self.message,
        )
        self.slots = Slots(control, on_change=self.pace)
        interrupted: BaseException | None = None
        try:
            if self.cancel.is_set():  # before the start (during the payload's check, say)
                self.halt("interrupted")
            if todo and not self.stop.is_set():
                self.message(f"preparing the image for {self.first.manifest.name}")
                self.executor.open(self.first, attempts=len(todo), concurrency=control.ceiling)
                self.pace(control.limit)
            times = f" x {self.epochs} epochs" if self.epochs > 1 else ""
            self.message(
                f"batch {self.batch_id}: {len(self.tasks)} tasks{times}, {len(self.results)} "
                f"already done, {len(todo)} to run at concurrency {describe(control)}"
            )
            self.run_all(todo, control.ceiling)
        except KeyboardInterrupt as exc:
            interrupted = exc
        finally:
            self.executor.close()
        summary = self.summarize()
        try:
            self.out.write_summary(summary.to_dict())
        except OutputWriteError as exc:  # the summary says so; the caller reports it
            self.write_failed(exc)
            summary = self.summarize()
        if interrupted is not None:
            raise interrupted
        return summary

    def reap_orphans(self) -> None:
        """Sandboxes of orchestrators that died (a SIGKILLed batch, say) are removed and their
        runs closed, so a resumed batch starts clean."""
        try:
            removed = self.executor.reap_orphans(self.template, self.store)
        except Exception as exc:  # cleanup is best effort; the batch itself can still run
            self.message(f"warning: cleaning up orphaned sandboxes failed: {exc}")
            return
        if removed:
            self.message(f"removed {removed} orphaned sandbox(es) of dead runs")

    def resume(self) -> list[tuple[Task, int]]:
        """Keep results with an agent outcome; drop the lines of tasks to run again. Returns
        the (task, epoch) pairs to run (`epochs.units`)."""
        previous = self.out.load_results()
        self.attempts.load()
        rerun = set(FINISHED) - {"succeeded"} if self.spec.rerun_failed else set()
        keep = {}
        for unit, row in previous.items():
            if row.get("status") in FINISHED and row.get("status") not in rerun:
                keep[unit] = row
            elif unit[0] not in self.tasks:
                keep[unit] = row  # not ours to re-run; kept as it was
        if len(keep) != len(previous):
            again = "without an agent outcome" + (" or not succeeded" if rerun else "")
            self.message(f"running {len(previous) - len(keep)} recorded task(s) again ({again})")
            self.out.rewrite_results(list(keep.values()))
        self.results = {k: v for k, v in keep.items() if k[0] in self.tasks}
        todo = units(self.plan.file.tasks, self.epochs)
        return [(t, e) for t, e in todo if (t.id, e) not in self.results]

    def pace(self, limit: int) -> None:
        """The limit moved: the warm pool follows it (unless --warm): a sandbox per slot, and
        at least two coming. A warm run is shorter than a sandbox's making, so one per slot
        left a batch at concurrency 1 waiting on each sandbox in turn: slower than cold
        (figures: benchmarks/results/code_figures.md#a-batchs-pool-at-least-two-sandboxes)."""
        if self.spec.warm is None:
            self.executor.keep_ready(self.first, max(limit, MIN_BUILDERS))

    # -- running ----------------------------------------------------------------------------

    def run_all(self, todo: list[tuple[Task, int]], limit: int) -> None:
        pending: queue.Queue[tuple[Task, int]] = queue.Queue()
        for unit in todo:
            pending.put(unit)
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
                self.slots.tick()  # the limit adapts between attempts' ends too
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

    def write_failed(self, error: OutputWriteError) -> None:
        """An output file could not be written: stop as on --fail-on-error (cancelled runs
        record nothing), so that no result is lost and the next session resumes cleanly. Call
        without holding `self.lock`."""
        with self.lock:
            first = self.write_error is None
            if first:
                self.write_error = error
        if first:
            self.message(
                f"stopping: an output file cannot be written ({error.error.strerror or error}); "
                "cancelling the running tasks"
            )
        self.halt("write_error")

    def worker(self, pending: queue.Queue[tuple[Task, int]]) -> None:
        while not self.stop.is_set():
            try:
                task, epoch = pending.get_nowait()
            except queue.Empty:
                return
            try:
                self.run_task(task, epoch)
            except _Stopped:
                return
            except OutputWriteError as exc:
                self.write_failed(exc)
                return
            except Exception as exc:  # a bug here must not take the other tasks down
                self.message(
                    f"{self.name(task, epoch)}: internal error {type(exc).__name__}: {exc}"
                )

    def sit_out(self, seconds: float) -> None:
        """A retry's backoff, cut short when the batch stops (it does not sit one out)."""
        self.stop.wait(seconds)

    def name(self, task: Task, epoch: int) -> str:
        """How messages name a unit of work: `task q001`, with epochs `task q001 (epoch 2)`."""
        return f"task {task.id}" + (f" (epoch {epoch})" if self.epochs > 1 else "")

    def run_task(self, task: Task, epoch: int) -> None:
        """The (task, epoch)'s attempts, retried on infrastructure faults, then its line."""
        prepared = self.plan.prepared[task.id]
        first_start = time.time()
        unit = (task.id, epoch)
        history = list(self.attempts.history.get(unit, []))

        def attempt() -> RunResult:
            if self.stop.is_set() or not self.slots.acquire(self.stop):
                raise _Stopped
            try:
                return self.attempt(unit, prepared, history)
            finally:
                self.slots.release()

        def before_sleep(state: tenacity.RetryCallState) -> None:
            result = state.outcome.result() if state.outcome else None
            error = result.error if result else None
            wait = state.next_action.sleep if state.next_action else 0
            with self.lock:
                self.retries += 1
            self.executor.expect(prepared)  # the retry is one more attempt to come
            self.message(
                f"{self.name(task, epoch)}: attempt {state.attempt_number} hit an infrastructure "
                f"fault ({error}); retrying in {wait:.1f}s"
            )

        result: RunResult = retrying(self.spec, self.stop, self.sit_out, before_sleep)(attempt)
        if result.status == "cancelled":
            return  # stopped mid-run: no result; the next session runs it again
        self.record(task, epoch, result, history, first_start)

    def attempt(self, unit: Key, prepared: PreparedRun, history: list[dict[str, Any]]) -> RunResult:
        """One attempt of the (task, epoch), handed to the executor and logged before and
        after; its run id is the executor's (a warm sandbox's, say)."""
        number = self.attempts.count(unit)
        this = replace(prepared, spec=replace(prepared.spec, batch=self.batch_id, task_id=unit[0]))
        try:
            attempt = self.executor.reserve(this, number=number, cancel=self.stop)
        except BaseException:
            self.attempts.uncount(unit)
            raise
        try:
            return self.run_attempt(unit, attempt, history)
        finally:
            self.executor.release(attempt)  # one run per sandbox (the run removed it already)

    def run_attempt(self, unit: Key, attempt: Attempt, history: list[dict[str, Any]]) -> RunResult:
        run_id = attempt.run_id
        try:
            self.attempts.started(unit, attempt, self.session)
        except OutputWriteError as exc:  # not started (uncounted): the next session runs it
            self.write_failed(exc)
            raise _Stopped from None
        with self.lock:
            self.running += 1
        try:
            watch = self.spend.watch(run_id)
            observers = RunObservers(store=self.store, on_event=watch, cancel=self.stop)
            result = self.executor.run(attempt, observers)
        except Exception as exc:  # before the run record existed (store, engine)
            result = infra_result(run_id, exc)
        finally:
            with self.lock:
                self.running -= 1
        try:
            self.attempts.ended(unit, attempt, self.session, result, self.spend, history)
        except OutputWriteError as exc:  # its result could not be kept either: run it again
            self.write_failed(exc)
            raise _Stopped from None
        return result

    def record(
        self, task: Task, epoch: int, result: RunResult, history: list[dict[str, Any]], start: float
    ) -> None:
        unit, numbered = (task.id, epoch), epoch if self.epochs > 1 else None
        scored = self.scoring.score(task.row(), result.status, result.answer)
        for name, why in scored.errors.items():
            which = "the judge" if name == MODEL_SCORER else "the scorer"
            which += f" ({name})" if len(scored.scores) > 1 and name != MODEL_SCORER else ""
            self.message(f"{self.name(task, epoch)}: {which} failed: {why}")
        row = result_row(
            task,
            result,
            score=scored.score,
            attempts=self.attempts.counts[unit],
            history=history,
            first_start=start,
            session=self.session,
            epoch=numbered,
        )
        row.update(scored.fields())
        with self.lock:
            if unit in self.results:  # cannot happen; never write a task twice
                return
            try:
                self.out.append_result(row)
            except OutputWriteError as exc:  # no line at all: the next session runs it again
                failed: OutputWriteError | None = exc
            else:
                failed = None
                self.results[unit] = row
                self.ran += 1
                if result.status == "infra_error":
                    self.infra_failed += 1
        if failed is not None:
            self.write_failed(failed)
            raise _Stopped
        self.out.link_record(task.id, result.record_dir, numbered)
        if self.on_result:
            self.on_result(row)
        if result.status == "infra_error":
            self.check_fail_on_error()

    def check_fail_on_error(self) -> None:
        limit = self.spec.fail_on_error
        if limit is None:
            return
        threshold = limit * len(self.tasks) * self.epochs if limit < 1 else limit
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
                total=len(self.tasks) * self.epochs,
                done=len(self.results),
                running=self.running,
                counts=dict(counts),
                ran=self.ran,
                retries=self.retries,
                elapsed=time.time() - self.started,
                stopping=self.stop_reason,
                **self.spend.progress(),
                concurrency=self.slots.limit,
                concurrency_text=describe(self.slots.control),
            )

    def summarize(self) -> BatchSummary:
        with self.lock:
            done = [(t.id, e) for t, e in units(self.plan.file.tasks, self.epochs)]
            rows = [self.results[unit] for unit in done if unit in self.results]
        return summarize(
            self.plan,
            self.spec,
            self.out,
            rows,
            SessionFacts(
                batch_id=self.batch_id,
                number=self.session,
                started=self.started,
                ran=self.ran,
                stop_reason=self.stop_reason,
                write_error=self.write_error.cause if self.write_error is not None else None,
                concurrency=self.slots.control.describe(),
            ),
        )
