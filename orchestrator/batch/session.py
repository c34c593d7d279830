"""Batch evaluation: every task of a dataset in its own fresh sandbox, in parallel, scored,
resumable, with nothing lost or written twice.

The life of a batch, top to bottom:

  read the tasks file (bad lines named by number; duplicate ids refused)
  → prepare every task with the single-run API (bad input fails before anything starts)
  → lock the output directory (one batch writes to it at a time)
  → clean up sandboxes that dead orchestrators left behind
  → resume: tasks with a result are done; unfinished and infra-failed ones run again
  → prepare the image once → warm sandboxes kept ready (a pool, when there are more tasks
    than workers) → N workers run tasks through `runner.execute`, retrying only
    infrastructure faults (with exponential backoff and jitter); every attempt is logged
  → each result is appended to `results.jsonl` and fsynced as its task ends
  → `summary.json`: counts per status, accuracy with a Wilson interval, durations, tokens.

Output directory:

  batch.json      the batch's id and the options it was started with (checked on resume)
  results.jsonl   one line per finished task (the source of truth for resume)
  attempts.jsonl  a start and an end line for every attempt, retries and cancels included
  summary.json    written at the end of every session (complete, interrupted or stopped)
  runs/<id>       a link to the run record of each task's final attempt

Over 500 lines for a reason: `_BatchRun` is one worker session whose parts share its state
(the queue, the counters, the lock, the output folder); split, one life cycle would be
scattered over files that each need all of it.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import tenacity

from ..backends import get_backend
from ..backends.base import Backend, Progress, Sandbox, SandboxInfo, SandboxSpec
from ..errors import ConfigError
from ..pool import MAX_SIZE, Claim, Pool
from ..runner import PreparedRun, execute
from ..spec import RunResult
from ..store import Store, new_run_id
from .output import FINISHED, BatchDir, OutputWriteError
from .plan import (
    BatchPlan,
    BatchProgress,
    BatchSpec,
    BatchSummary,
    check_payload_loads,
    default_concurrency,
    default_output,
    plan_batch,
)
from .scoring import make_scorer, percentile, wilson_interval
from .tasks import Task


class _ImageOnce(Backend):
    """A backend whose image is prepared once per batch: the image's inputs cannot change
    during a batch, so per-run re-hashing is waste, and N workers must never race to build.
    Everything else goes to the wrapped backend."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self.name = backend.name
        self.max_concurrency = backend.max_concurrency
        self._images: dict[tuple[str, ...], str] = {}
        self._lock = threading.Lock()

    def create(self, spec: SandboxSpec, progress: Progress) -> Sandbox:
        return self._backend.create(spec, progress)

    def list_sandboxes(self, labels: dict[str, str]) -> list[SandboxInfo]:
        return self._backend.list_sandboxes(labels)

    def remove_sandbox(self, info: SandboxInfo) -> None:
        self._backend.remove_sandbox(info)

    def prepare_image(self, extra_requirements: tuple[str, ...], progress: Progress) -> str:
        key = tuple(extra_requirements)
        with self._lock:
            if key not in self._images:
                self._images[key] = self._backend.prepare_image(key, progress)
            return self._images[key]


class _Stopped(Exception):
    """The batch is stopping; the task is left for the next session."""


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
    An output file that cannot be written (disk full, read-only) stops the batch the same
    way: a `stopped` summary whose `stop_reason` is `write_error: cannot write PATH: ERROR`
    (exit code 5; nothing half-written is left, so the same call resumes). Such an error
    before any task started raises `OutputWriteError` instead.
    `monitor` is called with a progress snapshot about twice a second from the calling thread.
    """
    if spec.output is None:
        spec = replace(spec, output=default_output(spec.run.payload, spec.tasks))
    plan = plan_batch(spec)
    backend = backend or get_backend(plan.fingerprint["backend"], env_file=spec.run.env_file)
    store = store or Store()
    check_payload_loads(plan, backend, store, cancel)
    out = BatchDir(Path(spec.output))
    with out.locked():
        return _BatchRun(spec, plan, out, backend, store, cancel, monitor, on_message, on_result)()


class _BatchRun:
    """One session of a batch (the first, or a resume) inside the output directory's lock."""

    def __init__(
        self,
        spec: BatchSpec,
        plan: BatchPlan,
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
        self.stop = threading.Event()  # on cancel, --fail-on-error, a write error: runs killed
        self.stop_reason: str | None = None
        #: The first output file that could not be written: the batch stops at it.
        self.write_error: OutputWriteError | None = None
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
        self.pool: Pool | None = None

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
            self.backend.prepare_image(first.image_requirements, self.message)
        self.message(
            f"batch {self.batch_id}: {len(self.tasks)} tasks, {len(self.results)} already done, "
            f"{len(todo)} to run at concurrency {min(limit, max(1, len(todo)))}"
        )
        interrupted: BaseException | None = None
        try:
            self.pool = self.warm_pool(todo, limit)
            self.run_all(todo, limit)
        except KeyboardInterrupt as exc:
            interrupted = exc
        finally:
            if self.pool is not None:
                self.pool.close()
        summary = self.summarize()
        try:
            self.out.write_summary(summary)
        except OutputWriteError as exc:  # the summary says so; the caller reports it
            self.write_failed(exc)
            summary = self.summarize()
        if interrupted is not None:
            raise interrupted
        return summary

    def warm_pool(self, todo: list[Task], limit: int) -> Pool | None:
        """Warm sandboxes for a batch longer than its concurrency (or as `--warm N` says)."""
        size = self.spec.warm
        if size is None:
            size = limit if len(todo) > limit else 0
        if size <= 0 or not todo:
            return None
        size = max(min(size, len(todo), MAX_SIZE), 2)  # no more than tasks to take them
        pool = Pool(size=size, backend=self.raw_backend, on_message=self.message)
        pool.warm(self.plan.prepared[todo[0].id])
        return pool

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
        from ..cleanup import cleanup

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
        cap = self.raw_backend.max_concurrency
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
            except OutputWriteError as exc:
                self.write_failed(exc)
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
        """One run of the task through the single-run API, logged before and after; in a
        warm sandbox when the batch has a pool (its run id is then the sandbox's)."""
        claim = self.pool.claim(prepared, cancel=self.stop) if self.pool else None
        try:
            return self.attempt_in(task, prepared, history, claim)
        finally:
            if claim is not None:
                claim.release()  # one run per sandbox (the run removed it already)

    def attempt_in(
        self,
        task: Task,
        prepared: PreparedRun,
        history: list[dict[str, Any]],
        claim: Claim | None,
    ) -> RunResult:
        run_id = claim.run_id if claim is not None else new_run_id()
        with self.lock:
            self.attempt_counts[task.id] += 1
            number = self.attempt_counts[task.id]
        try:
            self.out.append_attempt(
                {"event": "start", "id": task.id, "attempt": number, "run_id": run_id,
                 "session": self.session, "ts": time.time()}
            )  # fmt: skip
        except OutputWriteError as exc:  # not started: the next session runs it
            with self.lock:
                self.attempt_counts[task.id] -= 1
            self.write_failed(exc)
            raise _Stopped from None
        with self.lock:
            self.running += 1
        try:
            this = replace(
                prepared, run_id=run_id, spec=replace(prepared.spec, batch=self.batch_id)
            )
            if claim is not None and self.pool is not None:
                result = self.pool.execute_claimed(
                    this, claim, backend=self.backend, store=self.store, cancel=self.stop
                )
            else:
                result = execute(
                    this,
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
        try:
            self.out.append_attempt(entry)
        except OutputWriteError as exc:  # its result could not be kept either: run it again
            self.write_failed(exc)
            raise _Stopped from None
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
                "source": result.token_usage_source,  # gateway: measured on the host
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
            try:
                self.out.append_result(row)
            except OutputWriteError as exc:  # no line at all: the next session runs it again
                failed: OutputWriteError | None = exc
            else:
                failed = None
                self.results[task.id] = row
                self.ran += 1
                if result.status == "infra_error":
                    self.infra_failed += 1
        if failed is not None:
            self.write_failed(failed)
            raise _Stopped
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
        stop_reason = self.stop_reason
        if self.write_error is not None:  # whatever else happened, the disk needs attention
            state, stop_reason = "stopped", f"write_error: {self.write_error.cause}"
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
            tokens_source=tokens_source(rows),
            attempts=attempts,
            retries=sum(max(0, int(row.get("attempts") or 1) - 1) for row in rows),
            skipped_lines=[asdict(b) for b in self.plan.file.bad_lines],
            stop_reason=stop_reason,
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


def tokens_source(rows: list[dict[str, Any]]) -> str:
    """Where the batch's token figures come from: `gateway` (measured on the host for every
    task), `sandbox` (as the sandboxes reported them) or `mixed`."""
    sources = {(row.get("tokens") or {}).get("source", "sandbox") for row in rows}
    return sources.pop() if len(sources) == 1 else ("mixed" if sources else "sandbox")
