"""Concurrency that fits the host: how many runs at once, chosen from what the host has and
adapted while the work goes on, from what it measures.

    limit = AdaptiveLimit(ceiling=32, memory_mb=2048)   # None ceiling: AUTO_CEILING
    slots = Slots(limit)
    if slots.acquire(stop):          # waits while `limit.limit` runs are going
        try: run()
        finally: slots.release()     # one completion, for the throughput measure

Why: a run of a mock or local model is CPU-bound (`import smolagents` alone is about a second
of CPU), so runs beyond the cores only queue for them, and past a point they cost throughput
(more containers for the engine, more memory, more context switches: 64 tasks on 2 cores ran
at about 123 tasks/min at concurrency 4 and 100 at 32). A run against a hosted model mostly
waits on the network, and the same host then carries many more. No fixed number suits both,
nor a host that other work shares, so the number is measured, not guessed.

The rule (AIMD, steered by the CPU and checked against throughput):

- **Start** from what the host has: min(ceiling, 2 x cores, 75 % of available memory / each
  run's memory limit). Two per core, not one: a run is not all CPU (the engine's calls, the
  container's start and end), and two per core overlap those waits (on 2 cores, 64 mock
  tasks ran at about 123 tasks/min at 4 at once, 110 at 8, 100 at 32).
- **Windows.** The controller decides once per window: at least MIN_WINDOW seconds and as
  many completions as the limit (each slot turned over once; throughput cannot be measured
  faster than a run lasts), or MAX_WINDOW seconds. Over a window it averages the CPU's busy
  share and the run queue (`hostload.py`: /proc/stat, read at each tick) and the demand
  (runs going or waiting for a slot).
- **Increase** (additive; doubling until the first sign of a limit, as TCP's slow start)
  when every slot was in use and the CPU stayed below CPU_LOW: the runs wait on something
  other than this host (a model's API, the network), and more of them at once finish more.
- **Check** each increase on the next window: if throughput (completions per second) fell by
  more than TOLERANCE, go back and hold that limit for HOLD seconds. A model API's rate limit
  or a slow engine then stops the climb, though the CPU is idle.
- **Decrease** (multiplicative, by a quarter) when the CPU was full (>= CPU_HIGH) and the run
  queue over QUEUE_HIGH per core: runs only queue for the CPU. Never below one run per core
  on this rule: at that point a full CPU is the goal, not a fault (and when other work fills
  the host, the batch gives way to it down to there, not further).
- **Memory**: when available memory falls under the reserve (two runs' limits, at least 5 %
  of the host), halve at once (down to 1); an increase needs room for its runs.
- An explicit number is the **ceiling**, never a reason to slow down: the limit moves under
  it (`adapt=False`: exactly that many, for benchmarks and for those who know better).

The load average is not used: it lags by a minute, and a batch's runs last a second.
Every change is kept (`changes`, with its reason) for the batch's summary.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from .hostload import HostLoad, HostSample

#: The most runs at once when none was asked for (each is a sandbox with smolagents loaded).
AUTO_CEILING = 32
MIN_WINDOW = 2.0
MAX_WINDOW = 30.0
#: Below this busy share, with every slot in use, the runs wait on something else: add one.
CPU_LOW = 0.8
#: At or above this busy share, with a run queue over QUEUE_HIGH per core: take a quarter off.
CPU_HIGH = 0.95
QUEUE_HIGH = 3.0
#: Runs at once to start with, per core (then at most the ceiling and what memory allows).
START_PER_CORE = 2
#: An increase whose window's throughput is this much lower than before is undone...
TOLERANCE = 0.1
#: ...and the limit held where it was for this long before trying again.
HOLD = 60.0
#: Share of available memory the runs' limits may take, at the start.
MEMORY_SHARE = 0.75
#: Changes kept for the summary (the first ones and the latest ones).
MAX_CHANGES = 100


class Probe(Protocol):
    """What the controller measures the host with (`hostload.HostLoad`; tests inject one)."""

    def sample(self) -> HostSample: ...


@dataclass(frozen=True)
class Change:
    """The limit became `limit` at `at` seconds into the work, because of `reason`."""

    at: float
    limit: int
    reason: str


class AdaptiveLimit:
    """How many runs at once (`limit`), adapted by the rule of the module docstring.

    `ceiling`: the most ever (None: AUTO_CEILING); `memory_mb`: each run's memory limit (None:
    unknown); `adapt`: False keeps the limit at the ceiling. `probe` and `clock` (monotonic
    seconds) are injected in tests. Thread-safe.
    """

    def __init__(
        self,
        ceiling: int | None = None,
        *,
        memory_mb: int | None = None,
        adapt: bool = True,
        probe: Probe | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.requested = ceiling
        self.ceiling = max(1, ceiling if ceiling is not None else AUTO_CEILING)
        self.adapt = adapt
        self.memory_mb = memory_mb
        self.probe: Probe = probe or HostLoad()
        self.clock = clock
        self._lock = threading.Lock()
        self._began = clock()
        first = self.probe.sample()
        self.cores = first.cores
        self.limit = self.ceiling if not adapt else self._start(first)
        self.changes: list[Change] = [Change(0.0, self.limit, self._start_reason(first))]
        self._completed = 0
        self._slow_start = True
        self._trial: tuple[int, float] | None = None  # (limit before, its throughput)
        self._hold_until = 0.0
        self._reset(self._began)

    # -- what the caller tells it -------------------------------------------------------------

    def completed(self, count: int = 1) -> None:
        """`count` runs ended (whatever their outcome): the throughput measure."""
        with self._lock:
            self._completed += count

    def tick(self, demand: int) -> int:
        """Measure the host (`demand`: runs going plus those waiting for a slot), decide when
        a window is over; the limit. Call it often (each waiting run does, twice a second)."""
        with self._lock:
            if not self.adapt:
                return self.limit
            now = self.clock()
            sample = self.probe.sample()
            self._cpu.append(sample.cpu_busy)
            self._queue.append(sample.runnable)
            self._demand.append(min(demand, self.limit))
            if self._memory_short(sample) and self.limit > 1:
                self._set(now, max(1, self.limit // 2), "memory low")
                self._slow_start = False
                return self.limit
            elapsed = now - self._window_start
            done = self._completed - self._window_done
            if elapsed >= MIN_WINDOW and (done >= self.limit or elapsed >= MAX_WINDOW):
                self._decide(now, sample, done / elapsed)
            return self.limit

    # -- reporting ----------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """For a summary: mode, ceiling, the limit now, its lowest and highest, the changes."""
        with self._lock:
            limits = [c.limit for c in self.changes]
            kept = self.changes
            if len(kept) > MAX_CHANGES:
                kept = kept[: MAX_CHANGES // 2] + kept[-MAX_CHANGES // 2 :]
            return {
                "mode": "auto" if self.adapt else "fixed",
                "requested": self.requested,
                "ceiling": self.ceiling,
                "limit": self.limit,
                "lowest": min(limits),
                "highest": max(limits),
                "changes": [{**asdict(c), "at": round(c.at, 1)} for c in kept],
            }

    # -- the rule -----------------------------------------------------------------------------

    def _start(self, sample: HostSample) -> int:
        start = START_PER_CORE * sample.cores
        return max(1, min(self.ceiling, start, self._memory_fit(sample)))

    def _start_reason(self, sample: HostSample) -> str:
        if not self.adapt:
            return "fixed"
        if self.limit == self.ceiling:
            return "ceiling"
        if self.limit == self._memory_fit(sample) and self.limit < START_PER_CORE * sample.cores:
            return "memory"
        return "cores"

    def _memory_fit(self, sample: HostSample) -> int:
        memory = sample.memory_available_mb
        if not self.memory_mb or memory is None:
            return self.ceiling
        return max(1, int(memory * MEMORY_SHARE) // self.memory_mb)

    def _reserve_mb(self, sample: HostSample) -> int:
        total = sample.memory_total_mb or 0
        return max(2 * (self.memory_mb or 0), total // 20)

    def _memory_short(self, sample: HostSample, more: int = 0) -> bool:
        if sample.memory_available_mb is None:
            return False
        needed = self._reserve_mb(sample) + more * (self.memory_mb or 0)
        return sample.memory_available_mb < needed

    def _decide(self, now: float, sample: HostSample, rate: float) -> None:
        cpu = sum(self._cpu) / len(self._cpu)
        queue = sum(self._queue) / len(self._queue)
        in_use = sum(self._demand) / len(self._demand)
        trial, self._trial = self._trial, None
        if trial is not None and rate < trial[1] * (1 - TOLERANCE):
            self._slow_start = False
            self._hold_until = now + HOLD
            self._set(now, trial[0], f"throughput fell at {self.limit}")
        elif cpu >= CPU_HIGH and queue > QUEUE_HIGH * self.cores and self.limit > self.cores:
            self._slow_start = False
            self._set(now, max(self.cores, min(self.limit - 1, self.limit * 3 // 4)), "cpu full")
        elif (
            cpu < CPU_LOW
            and in_use >= self.limit - 0.5
            and self.limit < self.ceiling
            and now >= self._hold_until
        ):
            step = self.limit if self._slow_start else 1
            target = min(self.ceiling, self.limit + step)
            if not self._memory_short(sample, more=target - self.limit):
                self._trial = (self.limit, rate)
                self._set(now, target, "cpu idle")
        self._reset(now)

    def _set(self, now: float, limit: int, reason: str) -> None:
        if limit != self.limit:
            self.limit = limit
            self.changes.append(Change(now - self._began, limit, reason))
        self._reset(now)

    def _reset(self, now: float) -> None:
        self._window_start = now
        self._window_done = self._completed
        self._cpu: list[float] = []
        self._queue: list[float] = []
        self._demand: list[int] = []


class Slots:
    """At most `control.limit` holders at once, the limit read again as it changes.
    `on_change(limit)` is called (outside the lock) when the limit moved. Thread-safe."""

    #: How often a waiting caller measures again (and so lets the limit move).
    POLL = 0.5

    def __init__(
        self, control: AdaptiveLimit, on_change: Callable[[int], None] | None = None
    ) -> None:
        self.control = control
        self.on_change = on_change
        self.in_use = 0
        self.waiting = 0
        self._cond = threading.Condition()
        self._seen = control.limit
        self._seen_lock = threading.Lock()

    @property
    def limit(self) -> int:
        return self.control.limit

    def acquire(self, stop: threading.Event | None = None) -> bool:
        """Wait for a slot; False (and no slot) when `stop` is set first."""
        with self._cond:
            self.waiting += 1
            try:
                while self.in_use >= self._tick():
                    if stop is not None and stop.is_set():
                        return False
                    self._cond.wait(self.POLL)
                if stop is not None and stop.is_set():
                    return False
            finally:
                self.waiting -= 1
            self.in_use += 1
        self._changed()
        return True

    def release(self) -> None:
        """Give a slot back: one run ended."""
        self.control.completed()
        with self._cond:
            self.in_use -= 1
            self._tick()
            self._cond.notify_all()
        self._changed()

    def tick(self) -> int:
        """Measure now (a caller's loop, between runs' ends); the limit."""
        with self._cond:
            limit = self._tick()
            self._cond.notify_all()
        self._changed()
        return limit

    def _tick(self) -> int:
        return self.control.tick(self.in_use + self.waiting)

    def _changed(self) -> None:
        with self._seen_lock:  # each change told once, in order
            limit = self.control.limit
            if limit == self._seen:
                return
            self._seen = limit
            if self.on_change is not None:
                self.on_change(limit)
