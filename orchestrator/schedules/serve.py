"""The foreground scheduler (`schedule serve`): fires due schedules until stopped, each
through its executor; with one that keeps sandboxes warm, each firing's sandbox is started
shortly before its time. Firings that overlap run as many at once as the host carries
(`concurrency.AdaptiveLimit`, made by `executor.attempt_limit` as a batch's is): a run past
the limit waits for a slot (its firing has its schedule's lock already, so `forbid` and
`replace` hold while it waits)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import datetime

from ..execution.concurrency import AdaptiveLimit, Slots
from ..execution.executor import (
    Attempt,
    AttemptExecutor,
    DelegatingExecutor,
    LocalExecutor,
    attempt_limit,
)
from ..images.imagedef import Progress
from ..lifecycle.cleanup import closed_line
from ..lifecycle.cleanup import tidy as tidy_store
from ..lifecycle.runner import PreparedRun, RunObservers, prepare
from ..spec import RunResult
from .clock import Clock, SystemClock
from .cron import utc_iso
from .due import LATE_TOLERANCE, plan, record_missed
from .file import Schedule
from .firing import fire, print_log
from .store import ScheduleStore

#: How often `serve` closes runs whose orchestrator died, in seconds.
TIDY_INTERVAL = 60.0
#: How long before a firing its warm sandbox is started (well within the pool's TTL).
WARM_AHEAD = 20.0


class Paced(DelegatingExecutor):
    """`executor`, with at most `slots.limit` runs at once (the others wait for a slot; one
    whose cancel is set meanwhile goes on at once, to be recorded cancelled). Everything
    but `run` is the wrapped executor's (`DelegatingExecutor`)."""

    def __init__(self, executor: AttemptExecutor, slots: Slots, log: Progress) -> None:
        super().__init__(executor)
        self.slots, self.log = slots, log

    def run(self, attempt: Attempt, observers: RunObservers) -> RunResult:
        if self.slots.in_use >= self.slots.limit:
            self.log(f"run={attempt.run_id} waiting for a slot ({self.slots.limit} running)")
        held = self.slots.acquire(observers.cancel)
        try:
            return self.executor.run(attempt, observers)
        finally:
            if held:
                self.slots.release()


class Scheduler:
    """A foreground scheduler: fires due schedules, each firing in its own thread (so a
    long run never delays another schedule), survives any job's failure, and on start
    applies the missed-run rule from the last recorded firing. `executor`: where firings
    run (default: cold sandboxes on this host); its owner closes it. `concurrency`: the
    most runs at once: a number (adapting under it to the host), an `AdaptiveLimit` itself
    (tests inject one), or None (auto). `clock` and `spawn` (how a firing's thread is
    started) are what tests replace."""

    #: How late a firing may start and still count as on time (`due.plan`).
    late_tolerance: float = LATE_TOLERANCE
    #: The longest sleep between two looks at the schedules (and the store's tidying).
    max_sleep: float = 60.0

    def __init__(
        self,
        schedules: list[Schedule],
        *,
        store: ScheduleStore | None = None,
        clock: Clock | None = None,
        executor: AttemptExecutor | None = None,
        spawn: Callable[[Callable[[], None]], None] | None = None,
        log: Progress = print_log,
        concurrency: int | AdaptiveLimit | None = None,
    ) -> None:
        self.schedules = [s for s in schedules if s.enabled]
        self.store = store or ScheduleStore()
        self.clock = clock or SystemClock()
        self.log = log
        executor = executor or LocalExecutor()
        # Several schedules' runs, no one template: the executor's capacity is not asked.
        if not isinstance(concurrency, AdaptiveLimit):
            concurrency = attempt_limit(executor, None, requested=concurrency)
        self.slots = Slots(concurrency)
        self.executor = Paced(executor, self.slots, log)
        self._tidied: datetime | None = None
        self._spawn = spawn or self._thread
        self._threads: list[threading.Thread] = []
        self._cancels: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self.last: dict[str, datetime | None] = {}
        self._kept_ready: dict[str, tuple[datetime, PreparedRun]] = {}

    def tidy(self) -> None:
        """Close runs whose orchestrator died (another process's, or ours before a restart)."""
        for run_id in tidy_store(self.store.store, warn=self.log):
            self.log(f"{utc_iso(self.clock.now())} {closed_line(run_id)}")

    def _thread(self, job: Callable[[], None]) -> None:
        thread = threading.Thread(target=job, name="schedule-firing", daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def start(self) -> None:
        """Remember where each schedule left off (None: never fired, nothing to catch up)."""
        now = self.clock.now()
        for schedule in self.schedules:
            last = self.store.last_scheduled_for(schedule.name)
            self.last[schedule.name] = last if last is not None else now

    def tick(self) -> None:
        """Fire everything due now; a failure in one schedule never stops the others."""
        now = self.clock.now()
        for schedule in self.schedules:
            try:
                p = plan(
                    schedule, self.last.get(schedule.name), now, late_tolerance=self.late_tolerance
                )
                if p.fire_at is not None:
                    self.last[schedule.name] = p.fire_at
                elif p.missed_last is not None:
                    self.last[schedule.name] = p.missed_last
                record_missed(schedule, p, self.store, now, "serve", self.log)
                if p.fire_at is not None:
                    self._launch(schedule, p.fire_at, p.trigger)
            except Exception as exc:  # the scheduler outlives any one schedule
                self.log(
                    f"{utc_iso(now)} schedule={schedule.name} scheduler_error="
                    f"{json.dumps(f'{type(exc).__name__}: {exc}')}"
                )

    def keep_ready_ahead(self) -> None:
        """Ask the executor for a sandbox for each schedule that fires within WARM_AHEAD."""
        if not self.executor.has_pool:
            return
        now = self.clock.now()
        for schedule in self.schedules:
            at = schedule.cron.next_after(max(filter(None, [self.last.get(schedule.name), now])))
            ahead = (at - now).total_seconds()
            ready = self._kept_ready.get(schedule.name)
            if ahead > WARM_AHEAD or (ready is not None and ready[0] == at):
                continue
            try:
                prepared = prepare(schedule.run_spec(), secret_values=False)
                self.executor.keep_ready(prepared, 1)
                self._kept_ready[schedule.name] = (at, prepared)
            except Exception as exc:  # the firing then starts cold (and says why)
                self._kept_ready.pop(schedule.name, None)
                self.log(
                    f"{utc_iso(now)} schedule={schedule.name} warm_error="
                    f"{json.dumps(f'{type(exc).__name__}: {exc}')}"
                )

    def _reserve(self, schedule: Schedule) -> Attempt | None:
        """The run of this firing, reserved with the sandbox started for it (None: none was;
        the firing then chooses its run id and starts cold)."""
        ready = self._kept_ready.pop(schedule.name, None)
        if ready is None:
            return None
        prepared = ready[1]
        self.executor.keep_ready(prepared, 0)  # one sandbox per firing: no refill until the next
        return self.executor.reserve(prepared)  # the one being made (or made) is handed out

    def _launch(self, schedule: Schedule, at: datetime, trigger: str) -> None:
        cancel = threading.Event()
        key = id(cancel)
        with self._lock:  # registered before the thread starts: shutdown always sees it
            self._cancels[key] = cancel
        attempt = self._reserve(schedule)

        def job() -> None:
            try:
                fire(
                    schedule,
                    store=self.store,
                    trigger=trigger,
                    scheduled_for=at,
                    clock=self.clock,
                    executor=self.executor,
                    observers=RunObservers(cancel=cancel),
                    log=self.log,
                    run_id=attempt.run_id if attempt is not None else None,
                )
            except BaseException as exc:  # logged; the loop goes on
                self.log(
                    f"{utc_iso(self.clock.now())} schedule={schedule.name} "
                    f"firing_error={json.dumps(f'{type(exc).__name__}: {exc}')}"
                )
            finally:
                if attempt is not None:
                    self.executor.release(attempt)  # a skipped firing's sandbox too
                with self._lock:
                    self._cancels.pop(key, None)

        self._spawn(job)

    def next_wake(self) -> datetime | None:
        times = [
            s.cron.next_after(max(filter(None, [self.last.get(s.name), self.clock.now()])))
            for s in self.schedules
        ]
        return min(times) if times else None

    def serve(self, stop: threading.Event, *, grace: float = 0.0) -> None:
        """Run until `stop` is set; then let running firings finish for `grace` seconds,
        cancel the rest (their sandboxes are removed, runs recorded `cancelled`) and return."""
        self.start()
        names = ", ".join(s.name for s in self.schedules) or "none"
        self.log(f"{utc_iso(self.clock.now())} serve started: schedules {names}")
        while not stop.is_set():
            now = self.clock.now()
            if self._tidied is None or (now - self._tidied).total_seconds() >= TIDY_INTERVAL:
                self.tidy()
                self._tidied = now
            self.keep_ready_ahead()
            self.tick()
            wake = self.next_wake()
            wait = self.max_sleep
            if wake is not None:
                until = (wake - self.clock.now()).total_seconds()
                if self.executor.has_pool and until > WARM_AHEAD:
                    until -= WARM_AHEAD  # wake up to start the firing's sandbox
                wait = min(wait, max(0.0, until))
            if self.clock.sleep(wait, stop):
                break
        self.shutdown(grace)
        self.log(f"{utc_iso(self.clock.now())} serve stopped")

    def shutdown(self, grace: float = 0.0) -> None:
        deadline = time.monotonic() + grace
        for thread in list(self._threads):
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._lock:
            for cancel in self._cancels.values():
                cancel.set()
        for thread in list(self._threads):
            thread.join(timeout=60)
