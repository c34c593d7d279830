"""One firing of a schedule: take its lock, hand the run to an executor, record it."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING

from filelock import FileLock, Timeout

from ..errors import OrchestratorError
from ..images.imagedef import Progress
from ..records.store import new_run_id
from ..spec import EXIT_CODES
from .clock import Clock, SystemClock
from .cron import local_iso, utc_iso
from .file import Schedule
from .notify import maybe_notify
from .store import Firing, ScheduleStore

if TYPE_CHECKING:
    from ..execution.executor import AttemptExecutor
    from ..lifecycle.runner import RunObservers

#: `schedule run` exit code when the previous run of the schedule still goes (sysexits'
#: EX_TEMPFAIL: "try again later"), distinct from every run status.
EXIT_SKIPPED = 75


#: How long a `replace` firing waits for the previous run to stop before giving up (skip).
REPLACE_WAIT = 90.0


def print_log(line: str) -> None:
    print(line, flush=True)


def firing_line(firing: Firing, schedule: Schedule, now: datetime) -> str:
    """The one log line per firing: grep-able key=value pairs, UTC timestamp first."""
    parts = [utc_iso(now), f"schedule={schedule.name}", f"trigger={firing.trigger}"]
    if firing.scheduled_for is not None:
        parts.append(f"scheduled={local_iso(firing.scheduled_for, schedule.cron.tz)}")
    parts.append(f"outcome={firing.outcome}")
    if firing.run_id:
        parts.append(f"run={firing.run_id}")
    parts.append(f"exit={firing.exit_code}")
    if firing.duration is not None:
        parts.append(f"duration={firing.duration:.1f}s")
    if firing.reason:
        parts.append(f"reason={json.dumps(' '.join(firing.reason.split())[:300])}")
    return " ".join(parts)


def fire(
    schedule: Schedule,
    *,
    store: ScheduleStore,
    trigger: str = "manual",
    scheduled_for: datetime | None = None,
    clock: Clock | None = None,
    executor: AttemptExecutor | None = None,
    observers: RunObservers | None = None,
    log: Progress = print_log,
    run_id: str | None = None,
) -> Firing:
    """Fire a schedule once: claim the fire time, apply the concurrency rule, run, record,
    notify. Never raises for a run's failure (only re-raises Ctrl-C/SIGTERM after recording).
    `executor`: where the run goes (default: a cold sandbox on this host); `observers`: its
    events, progress and cancel event (the run is recorded in `store`'s run store);
    `run_id`: the run's id when it is chosen already (reserved with `executor`, say for a
    warm sandbox)."""
    from ..execution.executor import LocalExecutor
    from ..labels import owner_label
    from ..lifecycle.runner import RunObservers

    clock = clock or SystemClock()
    executor = executor or LocalExecutor()
    observers = replace(observers or RunObservers(), store=store.store)
    now = clock.now()
    # The run id is known from the claim on, so a skipped rival can always name it.
    firing = Firing(
        None, schedule.name, "running", trigger, scheduled_for, now, run_id or new_run_id()
    )
    firing.id = store.claim(
        schedule.name, scheduled_for, now, trigger, owner_label(), run_id=firing.run_id
    )
    if firing.id is None:  # serve and a cron line (or two cron lines) chose the same instant
        firing.run_id = None
        firing.outcome, firing.reason = "duplicate", "this fire time was already handled"
        log(firing_line(firing, schedule, now))
        return firing
    try:
        return _fire_claimed(
            schedule,
            firing,
            store=store,
            clock=clock,
            executor=executor,
            observers=observers,
            log=log,
        )
    except BaseException as exc:  # never leave the row `running` (SIGTERM while waiting, ...)
        with contextlib.suppress(Exception):
            if firing.outcome == "running":
                cancelled = isinstance(exc, KeyboardInterrupt)
                store.update(
                    firing.id,
                    outcome="cancelled" if cancelled else "error",
                    reason=f"{type(exc).__name__}: {exc}"[:500],
                    ended_at=time.time(),
                )
        raise


def _fire_claimed(
    schedule: Schedule,
    firing: Firing,
    *,
    store: ScheduleStore,
    clock: Clock,
    executor: AttemptExecutor,
    observers: RunObservers,
    log: Progress,
) -> Firing:
    from ..execution.executor import Attempt
    from ..lifecycle.runner import prepare

    assert firing.id is not None
    lock = None if schedule.concurrency == "allow" else store.lock(schedule.name)
    if lock is not None and not _acquire(lock, schedule, store, firing, REPLACE_WAIT):
        holders = [r["run_id"] for r in store.running(schedule.name) if r["id"] != firing.id] or [
            "unknown"
        ]
        firing.run_id = None
        firing.outcome, firing.exit_code = "skipped", EXIT_SKIPPED
        firing.reason = f"previous run still going ({', '.join(holders)})"
        if schedule.concurrency == "replace":
            firing.reason = f"previous run did not stop within {REPLACE_WAIT:.0f}s"
        store.update(
            firing.id,
            outcome="skipped",
            run_id=None,
            reason=firing.reason,
            exit_code=EXIT_SKIPPED,
            ended_at=time.time(),
        )
        log(firing_line(firing, schedule, clock.now()))
        maybe_notify(schedule, firing, store, log)
        return firing

    interrupted: BaseException | None = None
    started = time.monotonic()
    try:
        store.reap_lost(schedule.name, keep=firing.id)
        replaceable = schedule.concurrency == "replace"
        watcher = _CancelWatcher(store, firing.id, observers.cancel) if replaceable else None
        try:
            schedule.check_secrets()
            prepared = prepare(schedule.run_spec(firing.run_id))
            result = executor.run(Attempt(prepared), observers)
        except OrchestratorError as exc:  # bad input: nothing was started
            firing.outcome, firing.exit_code = "error", exc.exit_code
            firing.reason = f"{exc.cause} {exc.fix}".strip()
        except KeyboardInterrupt as exc:
            interrupted = exc
            firing.outcome, firing.exit_code = "cancelled", EXIT_CODES["cancelled"]
            firing.reason = "interrupted (SIGINT/SIGTERM)"
        except Exception as exc:  # an engine problem the runner did not turn into a status
            firing.outcome, firing.exit_code = "error", EXIT_CODES["infra_error"]
            firing.reason = f"{type(exc).__name__}: {exc}"
        else:
            firing.result = result
            firing.outcome, firing.exit_code = result.status, result.cli_exit_code
            if result.error:
                firing.reason = result.error.message or result.error.type
            if watcher is not None and watcher.replaced:
                firing.reason = "replaced by a newer firing"
        finally:
            if watcher is not None:
                watcher.stop()
        if firing.run_id and store.store.get_run(firing.run_id) is None:
            firing.run_id = None  # refused before the run existed: no record to point at
        firing.duration = time.monotonic() - started
        store.update(
            firing.id,
            outcome=firing.outcome,
            run_id=firing.run_id,
            exit_code=firing.exit_code,
            reason=firing.reason,
            ended_at=time.time(),
        )
    finally:
        if lock is not None:
            lock.release()
    log(firing_line(firing, schedule, clock.now()))
    if interrupted is not None:
        raise interrupted
    maybe_notify(schedule, firing, store, log)
    return firing


def _acquire(
    lock: FileLock, schedule: Schedule, store: ScheduleStore, firing: Firing, wait: float
) -> bool:
    """Take the schedule's lock now (forbid), or after cancelling the holder (replace)."""
    assert firing.id is not None
    try:
        lock.acquire(timeout=0)
        return True
    except Timeout:
        if schedule.concurrency != "replace":
            return False
    replaced = [r["run_id"] for r in store.running(schedule.name) if r["id"] != firing.id]
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        # Asked again each round: the holder may have claimed its row only just now.
        store.request_cancel(schedule.name, firing.id)
        try:
            lock.acquire(timeout=0.25)
        except Timeout:
            continue
        firing.reason = f"replaced {', '.join(filter(None, replaced)) or 'the running firing'}"
        return True
    return False


class _CancelWatcher:
    """Polls the store for a `replace` request aimed at this firing and cancels its run."""

    def __init__(self, store: ScheduleStore, firing_id: int, cancel: threading.Event) -> None:
        self.store, self.firing_id, self.cancel = store, firing_id, cancel
        self.replaced = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="schedule-cancel", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.25):
            try:
                if self.store.cancel_requested(self.firing_id):
                    self.replaced = True
                    self.cancel.set()
                    return
            except Exception:  # a busy database must not kill the run; try again
                continue

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
