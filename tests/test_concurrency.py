"""The concurrency controller's rule (orchestrator/concurrency.py), with injected time and host
measurements: minutes of a batch simulated in milliseconds, no sleeping, no real load."""

from __future__ import annotations

import threading
from collections.abc import Callable

from orchestrator.concurrency import (
    HOLD,
    MAX_WINDOW,
    MIN_WINDOW,
    AdaptiveLimit,
    Slots,
)
from orchestrator.hostload import HostSample, cpu_times, memory_mb, procs_running


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
    limit: AdaptiveLimit, clock: FakeClock, *, running: int | None = None, done: int | None = None
) -> int:
    """One control window: every slot busy (unless `running`), as many runs ended as the
    limit (unless `done`), MIN_WINDOW seconds in ticks of half a second; the limit after."""
    done = limit.limit if done is None else done
    ticks = int(MIN_WINDOW / 0.5)
    for i in range(ticks):
        clock.t += 0.5
        if i == ticks - 1:
            limit.completed(done)
        limit.tick(limit.limit if running is None else running)
    return limit.limit


def test_it_starts_from_the_cores_the_memory_and_the_ceiling() -> None:
    clock = FakeClock()
    assert AdaptiveLimit(probe=FakeHost(cores=2), clock=clock).limit == 2
    assert AdaptiveLimit(32, probe=FakeHost(cores=8), clock=clock).limit == 8
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


def test_an_idle_cpu_with_every_slot_busy_doubles_then_adds_one() -> None:
    """Runs that wait on a model API: slow start up to the first sign of a limit, then +1."""
    clock, host = FakeClock(), FakeHost(cores=2)
    host.cpu, host.queue = 0.3, 1.0
    limit = AdaptiveLimit(32, probe=host, clock=clock)
    # Throughput grows with the limit (each slot turns over once a window).
    assert [window(limit, clock) for _ in range(4)] == [4, 8, 16, 32]
    assert window(limit, clock) == 32  # the ceiling holds
    reasons = [c.reason for c in limit.changes]
    assert reasons == ["cores", "cpu idle", "cpu idle", "cpu idle", "cpu idle"]


def test_no_increase_while_slots_stand_empty_or_the_cpu_is_busy() -> None:
    clock, host = FakeClock(), FakeHost(cores=2)
    limit = AdaptiveLimit(32, probe=host, clock=clock)
    host.cpu = 0.3
    assert window(limit, clock, running=1) == 2  # the work, not the limit, holds it back
    host.cpu = 0.9
    assert window(limit, clock) == 2  # between the marks: hold still


def test_an_oversubscribed_cpu_takes_a_quarter_off_down_to_the_cores() -> None:
    clock, host = FakeClock(), FakeHost(cores=4)
    host.cpu = 0.3
    limit = AdaptiveLimit(32, probe=host, clock=clock)
    assert [window(limit, clock) for _ in range(3)] == [8, 16, 32]
    host.cpu, host.queue = 1.0, 40.0
    # 32 -> 24 -> 18 -> 13 -> 9 -> 6 -> 4 (the cores) and there it stays
    seen = [window(limit, clock) for _ in range(8)]
    assert seen == [24, 18, 13, 9, 6, 4, 4, 4]
    assert limit.changes[-1].reason == "cpu full"
    # Back to idle: additive now (the slow start ended at the first decrease).
    host.cpu, host.queue = 0.3, 2.0
    assert window(limit, clock) == 5


def test_a_full_cpu_at_one_run_per_core_is_the_goal() -> None:
    clock, host = FakeClock(), FakeHost(cores=2)
    host.cpu, host.queue = 1.0, 10.0
    limit = AdaptiveLimit(32, probe=host, clock=clock)
    assert [window(limit, clock) for _ in range(5)] == [2] * 5


def test_throughput_that_falls_after_an_increase_goes_back() -> None:
    clock, host = FakeClock(), FakeHost(cores=2)
    host.cpu = 0.3
    limit = AdaptiveLimit(32, probe=host, clock=clock)
    assert window(limit, clock, done=4) == 4  # trial: 2 -> 4 at 2/s
    # At 4 the window took MAX_WINDOW for 4 runs: far slower. Back to 2, held.
    for _ in range(int(MAX_WINDOW / 0.5)):
        clock.t += 0.5
        limit.tick(4)
    limit.completed(4)
    clock.t += 0.5
    limit.tick(4)
    assert limit.limit == 2 and limit.changes[-1].reason == "throughput fell at 4"
    held = clock.t + HOLD
    while clock.t < held - MIN_WINDOW:
        assert window(limit, clock, done=4) == 2
    while limit.limit == 2:
        window(limit, clock, done=4)
    assert clock.t >= held and limit.limit == 3  # additive after the fall


def test_low_memory_halves_at_once_and_blocks_increases() -> None:
    clock, host = FakeClock(), FakeHost(cores=8, available_mb=20_000, total_mb=24_000)
    host.cpu = 0.3
    limit = AdaptiveLimit(32, memory_mb=1000, probe=host, clock=clock)
    assert limit.limit == 8
    host.available_mb = 1500  # under the reserve (max(2 x 1000, 24000 / 20))
    clock.t += 0.5
    assert limit.tick(8) == 4
    assert limit.tick(4) == 2 and limit.tick(2) == 1 and limit.tick(1) == 1
    assert limit.changes[-1].reason == "memory low"
    host.available_mb = 2500  # above the reserve, no room for one more run
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
    assert described["ceiling"] == 32 and described["limit"] == 4
    assert described["lowest"] == 2 and described["highest"] == 4
    assert described["changes"][-1] == {"at": 2.0, "limit": 4, "reason": "cpu idle"}


def run_threads(count: int, target: Callable[[], None]) -> list[threading.Thread]:
    threads = [threading.Thread(target=target, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads


def test_slots_hold_holders_to_the_limit_and_follow_it() -> None:
    clock, host = FakeClock(), FakeHost(cores=2)
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
    slots.control.completed(2)
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
