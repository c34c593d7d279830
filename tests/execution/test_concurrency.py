"""The concurrency controller's rule (orchestrator/execution/concurrency.py), with injected
time and host measurements: minutes of a batch simulated in milliseconds,
no sleeping, no real load."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest

from orchestrator.batch import BatchObservers, BatchProgress, BatchSpec, run_batch
from orchestrator.cli.batch_display import progress_line
from orchestrator.errors import ConfigError
from orchestrator.execution.concurrency import (
    HOLD,
    MAX_WINDOW,
    MIN_DONE,
    MIN_WINDOW,
    AdaptiveLimit,
    Slots,
)
from orchestrator.execution.executor import (
    Attempt,
    AttemptExecutor,
    Capacity,
    LocalExecutor,
    PoolControl,
)
from orchestrator.execution.hostload import (
    HostLoad,
    HostSample,
    cpu_times,
    memory_mb,
    procs_running,
)
from orchestrator.lifecycle.runner import PreparedRun, RunObservers
from orchestrator.schedules import Scheduler, ScheduleStore, load_schedules
from orchestrator.spec import RunResult, RunSpec
from tests.batch.test_session import MATH, StandInExecutor, math_rows, write_jsonl
from tests.conftest import wait_for
from tests.schedules.test_schedules import FakeClock as WallClock
from tests.schedules.test_schedules import at, unique, write_schedules


class FakeClock:
    """Monotonic seconds that move only when told."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FakeHost:
    """A host whose CPU, run queue and memory the test sets (or derives from the runs)."""

    def __init__(self, cores: int = 2, available_mb: int = 20_000, total_mb: int = 24_000) -> None:
        self.cores = cores
        self.cpu = 0.5
        self.queue = 1.0
        self.available_mb: int | None = available_mb
        self.total_mb: int | None = total_mb

    def sample(self) -> HostSample:
        return HostSample(0.0, self.cores, self.cpu, self.queue, self.available_mb, self.total_mb)


def window(
    limit: AdaptiveLimit,
    clock: FakeClock,
    *,
    rate: float | None = None,
    running: int | None = None,
    tick: float = 0.5,
) -> int:
    """One control window: every slot busy (unless `running`), max(MIN_DONE, limit) runs
    ending at `rate` a second (default: in MIN_WINDOW seconds), in ticks of `tick` seconds
    (a waiting run's); the limit after it."""
    done = max(MIN_DONE, limit.limit)
    seconds = max(MIN_WINDOW, done / rate) if rate else MIN_WINDOW
    ticks = math.ceil(seconds / tick - 1e-9)
    for i in range(ticks):
        clock.t += tick
        if i == ticks - 1:
            limit.completed(done)
        limit.tick(limit.limit if running is None else running)
    return limit.limit


def climb(
    limit: AdaptiveLimit,
    clock: FakeClock,
    windows: int,
    rate: Callable[[int], float],
    tick: float = 0.5,
) -> list[int]:
    """`windows` windows, throughput a function of the limit; the limit after each."""
    return [window(limit, clock, rate=rate(limit.limit), tick=tick) for _ in range(windows)]


def test_it_starts_from_the_cores_the_memory_and_the_ceiling() -> None:
    clock = FakeClock()
    assert AdaptiveLimit(probe=FakeHost(cores=2), clock=clock).limit == 4  # two per core
    assert AdaptiveLimit(32, probe=FakeHost(cores=8), clock=clock).limit == 16
    assert AdaptiveLimit(3, probe=FakeHost(cores=8), clock=clock).limit == 3
    # 75 % of 4000 MB available, 1000 MB a run: 3, though there are 8 cores
    small = AdaptiveLimit(memory_mb=1000, probe=FakeHost(8, available_mb=4000), clock=clock)
    assert small.limit == 3 and small.changes[0].reason == "memory"
    fixed = AdaptiveLimit(32, adapt=False, probe=FakeHost(cores=2), clock=clock)
    assert fixed.limit == 32


def test_a_fixed_limit_never_moves() -> None:
    clock, host = FakeClock(), FakeHost()
    limit = AdaptiveLimit(8, adapt=False, probe=host, clock=clock)
    host.cpu, host.queue, host.available_mb = 1.0, 40.0, 10
    for _ in range(10):
        assert window(limit, clock) == 8
    assert limit.describe()["mode"] == "fixed" and len(limit.changes) == 1


def test_an_idle_cpu_with_every_slot_busy_doubles() -> None:
    """Runs that wait on a model API: slow start, each step judged a window later."""
    clock, host = FakeClock(), FakeHost(cores=2)
    host.cpu = 0.3
    limit = AdaptiveLimit(32, probe=host, clock=clock)
    # change, a window to settle, a window judged (kept: throughput grew), change...
    assert climb(limit, clock, 8, rate=float) == [8, 8, 8, 16, 16, 16, 32, 32]
    reasons = [c.reason for c in limit.changes]
    assert reasons == ["cores", "cpu idle", "cpu idle", "cpu idle"]


def test_no_increase_while_slots_stand_empty() -> None:
    clock, host = FakeClock(), FakeHost(cores=2)
    limit = AdaptiveLimit(32, probe=host, clock=clock)
    host.cpu = 0.3
    for _ in range(5):
        assert window(limit, clock, running=1) == 4  # the work, not the limit, holds it back


def test_a_host_shared_with_other_work_climbs_while_more_runs_pay() -> None:
    """The CPU is full of other work: each run more takes a bigger share of it, throughput
    grows with the limit. Probes up are kept, probes down undone and held off."""
    clock, host = FakeClock(), FakeHost(cores=2)
    host.cpu = 1.0
    limit = AdaptiveLimit(32, probe=host, clock=clock)
    seen = climb(limit, clock, 40, rate=lambda n: n / 2)
    assert seen[:6] == [5, 5, 5, 4, 4, 5], seen  # more: kept; fewer: fell, back
    assert limit.changes[3].reason == "throughput fell at 4"
    assert min(seen[6:]) >= 5 and seen[-1] >= 12, seen


def test_a_host_saturated_by_the_runs_themselves_settles_at_two_runs_per_core() -> None:
    """Throughput the same at any limit (the CPU is the bottleneck): more does not pay and
    is undone; fewer costs nothing and is kept, down to the start's two runs per core."""
    clock, host = FakeClock(), FakeHost(cores=2)
    host.cpu = 1.0
    limit = AdaptiveLimit(32, probe=host, clock=clock)
    seen = climb(limit, clock, 30, rate=lambda n: 2.0)
    assert max(seen) == 5 and min(seen) == 4 and seen[-1] == 4, seen
    assert [c.reason for c in limit.changes[:3]] == ["cores", "probe: more", "no gain at 5"]
    # from 8 (a climb that paid, then stopped paying) down in quarters to 4, no lower
    clock, host = FakeClock(), FakeHost(cores=2)
    host.cpu = 1.0
    limit = AdaptiveLimit(32, probe=host, clock=clock)
    seen = climb(limit, clock, 60, rate=lambda n: min(n, 8) / 4)
    assert max(seen) >= 8 and seen[-1] >= 4 and min(seen) >= 4, seen


def test_a_warm_batch_starts_and_settles_at_its_executors_runs_per_core() -> None:
    """Warm sandboxes made beside the runs (`per_core=1`, runc's): one run per core to
    start with, and a probe down goes no lower; more is probed and undone as from two."""
    clock, host = FakeClock(), FakeHost(cores=2)
    host.cpu = 1.0
    limit = AdaptiveLimit(32, per_core=1, probe=host, clock=clock)
    assert limit.limit == 2 and limit.changes[0].reason == "cores"
    seen = climb(limit, clock, 30, rate=lambda n: 2.0)
    assert max(seen) == 3 and min(seen) == 2 and seen[-1] == 2, seen
    # from 8 (a climb that paid, then stopped paying) down in quarters to 2, no lower
    clock, host = FakeClock(), FakeHost(cores=2)
    host.cpu = 1.0
    limit = AdaptiveLimit(32, per_core=1, probe=host, clock=clock)
    seen = climb(limit, clock, 40, rate=lambda n: min(n, 8) / 4)
    assert max(seen) >= 8, seen
    seen = climb(limit, clock, 100, rate=lambda n: 2.0)  # then more stopped paying
    assert min(seen) == 2 and seen[-1] <= 3, seen
    # memory still takes it lower, and the default stays two per core
    small = AdaptiveLimit(per_core=1, memory_mb=1000, probe=FakeHost(8, available_mb=4000))
    assert small.limit == 3 and small.changes[0].reason == "memory"
    assert AdaptiveLimit(per_core=None, probe=FakeHost(cores=2), clock=clock).limit == 4


def test_small_losses_in_a_row_cannot_add_up() -> None:
    """Below 16, each quarter fewer costs 6 % (within TOLERANCE): the first step down is
    kept, the next is judged against the throughput before the first (12 % lost) and
    undone, each time it is tried again."""
    clock, host = FakeClock(), FakeHost(cores=2)
    host.cpu = 0.3
    limit = AdaptiveLimit(16, probe=host, clock=clock)
    while limit.limit < 16:  # runs waiting on a model's API: up to the ceiling
        window(limit, clock, rate=float(limit.limit))
    assert climb(limit, clock, 2, rate=float) == [16, 16]  # settled, then judged: kept
    host.cpu = 1.0  # now the CPU is full, and fewer runs cost a little each step

    def losing(n: int) -> float:
        return 4.0 if n >= 16 else 4.0 * 0.94 if n >= 12 else 4.0 * 0.94**2

    seen = climb(limit, clock, 60, rate=losing, tick=0.01)  # a few HOLDs: probes again
    assert min(seen) == 9 and seen[-1] >= 12, seen
    changes = [c for c in limit.changes if c.at > 10]
    to_nine = [i for i, c in enumerate(changes) if c.limit == 9]
    assert len(to_nine) >= 2, changes
    assert all(changes[i + 1].reason == "throughput fell at 9" for i in to_nine), changes


def test_throughput_that_falls_after_an_increase_goes_back() -> None:
    clock, host = FakeClock(), FakeHost(cores=2)
    host.cpu = 0.3
    limit = AdaptiveLimit(32, probe=host, clock=clock)
    assert window(limit, clock) == 8  # idle CPU, every slot busy: 4 -> 8, at 2 a second
    assert window(limit, clock) == 8  # settling
    # At 8 the next window took MAX_WINDOW and no run ended: far slower. Back to 4, held.
    for _ in range(int(MAX_WINDOW / 0.5)):
        clock.t += 0.5
        limit.tick(8)
    assert limit.limit == 4 and limit.changes[-1].reason == "throughput fell at 8"
    held = clock.t + HOLD
    while clock.t < held - MIN_WINDOW:
        assert window(limit, clock) == 4
    while limit.limit == 4:
        window(limit, clock)
    assert clock.t >= held and limit.limit == 5  # one at a time after the fall


def test_low_memory_halves_at_once_and_blocks_increases() -> None:
    clock, host = FakeClock(), FakeHost(cores=8, available_mb=20_000, total_mb=24_000)
    host.cpu = 0.3
    limit = AdaptiveLimit(32, memory_mb=1000, probe=host, clock=clock)
    assert limit.limit == 15  # 75 % of 20000 MB / 1000 MB, under 2 x 8 cores
    host.available_mb = 1500  # under the reserve (max(2 x 1000, 24000 / 20))
    clock.t += 0.5
    assert limit.tick(15) == 7
    assert limit.tick(7) == 3 and limit.tick(3) == 1 and limit.tick(1) == 1
    assert limit.changes[-1].reason == "memory low"
    host.available_mb = 2500  # above the reserve, no room for one more run
    assert window(limit, clock) == 1  # (settling after the change)
    assert window(limit, clock) == 1
    host.available_mb = None  # unknown: the memory rule holds still
    assert window(limit, clock) == 2


def test_describe_says_mode_ceiling_and_each_change() -> None:
    clock, host = FakeClock(), FakeHost(cores=2)
    host.cpu = 0.3
    limit = AdaptiveLimit(None, probe=host, clock=clock)
    window(limit, clock)
    described = limit.describe()
    assert described["mode"] == "auto" and described["requested"] is None
    assert described["ceiling"] == 32 and described["limit"] == 8
    assert described["lowest"] == 4 and described["highest"] == 8
    assert described["changes"][-1] == {"at": 2.0, "limit": 8, "reason": "cpu idle"}


def run_threads(count: int, target: Callable[[], None]) -> list[threading.Thread]:
    threads = [threading.Thread(target=target, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads


def test_slots_hold_holders_to_the_limit_and_follow_it() -> None:
    clock, host = FakeClock(), FakeHost(cores=1)
    host.cpu = 0.3
    changes: list[int] = []
    slots = Slots(AdaptiveLimit(32, probe=host, clock=clock), on_change=changes.append)
    assert slots.acquire() and slots.acquire()
    entered = threading.Event()

    def third() -> None:
        if slots.acquire():
            entered.set()

    threads = run_threads(1, third)
    assert not entered.wait(0.3)  # the limit is 2 (no time passed: no window ended)
    clock.t += MIN_WINDOW  # idle CPU, every slot busy and one waiting: the limit goes up
    slots.control.completed(MIN_DONE)
    assert entered.wait(10), "the raised limit did not let the waiting caller in"
    assert slots.in_use == 3 and changes == [4]
    threads[0].join(5)
    stop = threading.Event()
    stop.set()
    assert slots.acquire(stop) is False
    for _ in range(3):
        slots.release()
    assert slots.in_use == 0


def test_proc_text_parsing() -> None:
    stat = "cpu  100 5 50 800 20 0 5 10 0 0\ncpu0 1 2 3 4\nprocs_running 3\n"
    assert cpu_times(stat) == (170, 990)
    assert procs_running(stat) == 3
    meminfo = "MemTotal:       24683656 kB\nMemFree: 1 kB\nMemAvailable:   23552408 kB\n"
    assert memory_mb(meminfo) == (23000, 24105)


class Gated(AttemptExecutor):
    """Runs that end when `gate` opens; counts how many ran at once."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.lock = threading.Lock()
        self.running = self.most = self.ran = 0

    def run(self, attempt: Attempt, observers: RunObservers) -> RunResult:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        self.gate.wait(60)
        with self.lock:
            self.running -= 1
            self.ran += 1
        return RunResult(run_id=attempt.run_id, status="succeeded")


def test_overlapping_firings_of_serve_wait_for_a_slot(tmp_path: Path) -> None:
    """Two schedules due at the same minute, a limit of one: the second run waits for the
    first to end (said in the log), then runs; both are recorded."""
    names = [unique("a"), unique("b")]
    sf = load_schedules(
        write_schedules(tmp_path, *({"name": n, "cron": "* * * * *"} for n in names))
    )
    t0 = at("2026-01-05T10:00:30+00:00")
    clock, runs, log = WallClock(t0), Gated(), list[str]()
    store = ScheduleStore()
    scheduler = Scheduler(
        sf.schedules,
        store=store,
        clock=clock,
        executor=runs,
        log=log.append,
        concurrency=AdaptiveLimit(1, adapt=False),
    )
    scheduler.start()
    clock.t = t0 + timedelta(seconds=31)  # 10:01:01: both are due
    scheduler.tick()
    wait_for(lambda: any("waiting for a slot (1 running)" in line for line in log))
    assert runs.running == 1
    runs.gate.set()
    scheduler.shutdown(grace=60)
    assert runs.ran == 2 and runs.most == 1
    assert [r["outcome"] for n in names for r in store.history(n)] == ["succeeded"] * 2


class Counting(StandInExecutor, PoolControl):
    """The batch tests' stand-in executor (no sandbox), counting runs at once; with `meet`,
    each run waits (up to a minute) until that many run together. It says it keeps
    sandboxes warm, to note how many the batch asks for (`warm`)."""

    def __init__(self, meet: int = 0) -> None:
        super().__init__(set())
        self.meet = meet
        self.now = self.most = 0
        self.together = threading.Condition()
        self.kept_ready: list[int] = []

    @property
    def has_pool(self) -> bool:
        return True

    def keep_ready(self, prepared: PreparedRun, count: int) -> None:
        self.kept_ready.append(count)

    def expect(self, prepared: PreparedRun, attempts: int = 1) -> None:
        pass

    def run(self, attempt: Attempt, observers: RunObservers) -> RunResult:
        if attempt.prepared.spec.check_only:
            return super().run(attempt, observers)
        with self.together:
            self.now += 1
            self.most = max(self.most, self.now)
            self.together.notify_all()
            self.together.wait_for(lambda: self.most >= self.meet, timeout=60)
        try:
            return super().run(attempt, observers)
        finally:
            with self.together:
                self.now -= 1


def test_a_fixed_concurrency_runs_exactly_that_many_at_once(tmp_path: Path) -> None:
    tasks = write_jsonl(tmp_path / "tasks.jsonl", math_rows(9))
    runs = Counting(meet=3)
    spec = BatchSpec(
        tasks=tasks, output=tmp_path / "out", run=RunSpec(payload=MATH), concurrency=3, adapt=False
    )
    progress: list[BatchProgress] = []
    summary = run_batch(spec, executor=runs, observers=BatchObservers(monitor=progress.append))
    assert summary.counts["succeeded"] == 9 and runs.most == 3
    assert summary.concurrency["mode"] == "fixed" and summary.concurrency["limit"] == 3
    assert summary.session["concurrency"] == 3 and runs.kept_ready == [3]
    assert progress[-1].concurrency == 3 and "concurrency 3 (fixed)" in progress_line(progress[-1])
    written = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert written["concurrency"]["changes"] == [{"at": 0.0, "limit": 3, "reason": "fixed"}]


def test_auto_runs_no_more_than_its_limit_and_says_how_it_moved(tmp_path: Path) -> None:
    tasks = write_jsonl(tmp_path / "tasks.jsonl", math_rows(12))
    runs = Counting()
    spec = BatchSpec(tasks=tasks, output=tmp_path / "out", run=RunSpec(payload=MATH), concurrency=8)
    summary = run_batch(spec, executor=runs)
    pace = summary.concurrency
    assert summary.counts["succeeded"] == 12
    assert pace["mode"] == "auto" and pace["requested"] == 8 and pace["ceiling"] == 8
    assert runs.opened == [(12, 8)]  # the executor is opened for the ceiling...
    assert runs.kept_ready[0] == pace["changes"][0]["limit"] <= 8  # ...and keeps that many ready
    assert 1 <= runs.most <= pace["highest"] <= 8
    assert [c["limit"] for c in pace["changes"]][-1] == pace["limit"]


class WarmCounting(Counting, Capacity):
    """As `Counting`, for an executor whose warm sandboxes want `per_core` runs per core."""

    def __init__(self, per_core: int) -> None:
        super().__init__()
        self.per_core = per_core

    def max_concurrency(self, template: PreparedRun) -> int | None:
        return None

    def runs_per_core(self, template: PreparedRun) -> int | None:
        return self.per_core


def test_auto_starts_from_the_executors_runs_per_core(tmp_path: Path) -> None:
    tasks = write_jsonl(tmp_path / "tasks.jsonl", math_rows(6))
    cores = HostLoad().sample().cores
    for per_core in (1, 2):
        runs = WarmCounting(per_core)
        spec = BatchSpec(tasks=tasks, output=tmp_path / f"out{per_core}", run=RunSpec(payload=MATH))
        summary = run_batch(spec, executor=runs)
        first = summary.concurrency["changes"][0]
        start = per_core * cores
        reason = "cores" if start < 6 else "ceiling"  # the ceiling: one per task
        assert summary.counts["succeeded"] == 6
        assert first == {"at": 0.0, "limit": min(6, start), "reason": reason}, first


def test_fixed_concurrency_needs_a_number(tmp_path: Path) -> None:
    tasks = write_jsonl(tmp_path / "tasks.jsonl", math_rows(2))
    spec = BatchSpec(tasks=tasks, output=tmp_path / "out", run=RunSpec(payload=MATH), adapt=False)
    with pytest.raises(ConfigError, match="--fixed-concurrency needs"):
        run_batch(spec, executor=Counting())


def test_the_deprecated_warm_keyword_still_sizes_a_local_executors_pool() -> None:
    """`LocalExecutor(warm=N)` was the pool size's old name: it still works, and says so."""
    with pytest.deprecated_call(match="pool_size"):
        assert LocalExecutor(warm=3).pool_size == 3
    assert LocalExecutor(pool_size=0).pool_size == 0
