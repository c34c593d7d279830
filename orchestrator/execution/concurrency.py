"""Concurrency that fits the host: how many runs at once, chosen from what the host has and
adapted while the work goes on, from what it measures.

    limit = AdaptiveLimit(ceiling=32, memory_mb=2048)   # None ceiling: AUTO_CEILING
    slots = Slots(limit)
    if slots.acquire(stop):          # waits while `limit.limit` runs are going
        try: run()
        finally: slots.release()     # one completion, for the throughput measure

Why: a run of a mock or local model is CPU-bound (`import smolagents` alone is a lot of
CPU), so runs beyond the cores only queue for them, and past a point they cost throughput
(more containers for the engine, more memory, more context switches; figures:
benchmarks/results/code_figures.md#concurrency-per-core). A run against a hosted model
mostly waits on the network, and the same host then carries many more. No fixed number suits
both, nor a host that other work shares, so the number is measured, not guessed.

The rule (a hill climb on throughput, the CPU as its fast path; AIMD-like):

- **Start** from what the host has: min(ceiling, per_core x cores, 75 % of available memory /
  each run's memory limit). Two per core for runs that start their own sandboxes: such a
  run is not all CPU (the engine's calls, the container's start and end), and two per core
  overlap those waits. A warm batch whose sandboxes a pool makes on this host needs fewer:
  the pool's builders overlap the starts beside the runs, and a warm run is mostly CPU, so
  its executor says how many per core (`executor.Capacity.runs_per_core`: the backend's
  `starts_per_core`, one under runc, two under gVisor, where a run also waits on its gofer;
  figures for both: benchmarks/results/code_figures.md#concurrency-per-core).
- **Windows.** The controller decides once per window: at least MIN_WINDOW seconds and
  MIN_DONE completions, and as many as the limit (each slot turned over once: throughput
  cannot be measured faster than a run lasts), or MAX_WINDOW seconds. Over a window it
  averages the CPU's busy share (`hostload.py`: /proc/stat, read at each tick) and the demand
  (runs going or waiting for a slot). The window after a change is not judged (runs started
  under the old limit are still ending); the one after it is.
- **CPU idle** (under CPU_LOW) with every slot in use: the runs wait on something other than
  this host (a model's API, the network), so more at once (doubling until the first sign of
  a limit, as TCP's slow start; then one at a time). Undone, and held for HOLD seconds, if
  throughput then fell by more than TOLERANCE (a rate-limited API stops the climb).
- **CPU busy**: more runs help only if the CPU goes to them rather than to other work on
  the host, and only the throughput says which. So probe, alternating: a quarter more (kept
  only if throughput rose by TOLERANCE), then a quarter fewer (kept unless it fell by
  TOLERANCE: fewer runs for the same throughput is less memory and a kinder neighbour).
  A probe that failed is not tried again for HOLD seconds. On a host to itself this settles
  near where the CPU is just full; on one shared with other work, as high as still pays.
  Steps down are judged against the throughput before the first of them since a step up was
  last kept, so that losses each within TOLERANCE cannot add up (nor come back after HOLD).
  Never below the start's runs per core on a probe (memory alone takes it lower): a
  window of a few runs cannot see what the overlap is worth, yet it is worth more than the
  noise (under gVisor, where a run's start also waits on gVisor's gofer and the engine, auto
  stepping down to one run per core ran 64 mock tasks 3-7 % slower than a fixed 4 did).
- **Memory**: when available memory falls under the reserve (two runs' limits, at least 5 %
  of the host), halve at once (down to 1); no increase without room for its runs.
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
MIN_DONE = 4
MAX_WINDOW = 30.0
#: Below this busy share, with every slot in use, the runs wait on something else: add one.
CPU_LOW = 0.8
#: Runs at once to start with, per core (then at most the ceiling and what memory allows),
#: unless the caller says otherwise (a warm batch's executor).
START_PER_CORE = 2
#: A change whose window's throughput is this much worse (a probe up: not this much better)
#: than before is undone...
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
    unknown); `per_core`: runs per core to start with and the least a probe goes to (None:
    START_PER_CORE); `adapt`: False keeps the limit at the ceiling. `probe` and `clock`
    (monotonic seconds) are injected in tests. Thread-safe.
    """

    def __init__(
        self,
        ceiling: int | None = None,
        *,
        memory_mb: int | None = None,
        per_core: int | None = None,
        adapt: bool = True,
        probe: Probe | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.requested = ceiling
        self.ceiling = max(1, ceiling if ceiling is not None else AUTO_CEILING)
        self.adapt = adapt
        self.memory_mb = memory_mb
        self.per_core = max(1, per_core if per_core is not None else START_PER_CORE)
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
        #: The change being judged: (limit before, its throughput, "idle" | "up" | "down").
        self._trial: tuple[int, float, str] | None = None
        self._settling = False  # the window after a change: not judged
        self._probe = "up"  # the next probe's direction
        self._hold = {"up": 0.0, "down": 0.0}  # no probe that way before then
        #: The throughput before the first step down since a step up was last kept.
        self._down_from: float | None = None
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
            self._demand.append(min(demand, self.limit))
            if self._memory_short(sample) and self.limit > 1:
                self._set(now, max(1, self.limit // 2), "memory low")
                self._slow_start, self._trial, self._down_from = False, None, None
                return self.limit
            elapsed = now - self._window_start
            done = self._completed - self._window_done
            enough = done >= max(MIN_DONE, self.limit)
            if elapsed >= MIN_WINDOW and (enough or elapsed >= MAX_WINDOW):
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
        start = self.per_core * sample.cores
        return max(1, min(self.ceiling, start, self._memory_fit(sample)))

    def _start_reason(self, sample: HostSample) -> str:
        if not self.adapt:
            return "fixed"
        if self.limit == self.ceiling:
            return "ceiling"
        if self.limit == self._memory_fit(sample) and self.limit < self.per_core * sample.cores:
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
        full = sum(self._demand) / len(self._demand) >= self.limit - 0.5
        if self._settling:  # runs of the old limit are still ending: judge the next window
            self._settling = False
        elif self._trial is not None:
            self._judge(now, rate)
        elif cpu < CPU_LOW:  # with slots standing empty, the work holds it back: nothing
            step = self.limit if self._slow_start else 1
            if full and now >= self._hold["up"]:
                self._try(now, sample, rate, self.limit + step, "idle", "cpu idle")
        elif self._probe == "up":
            self._probe = "down"
            if full and now >= self._hold["up"]:
                more = max(self.limit + 1, self.limit * 5 // 4)
                self._try(now, sample, rate, more, "up", "probe: more")
        else:
            self._probe = "up"
            fewer = max(self.per_core * self.cores, min(self.limit - 1, self.limit * 3 // 4))
            if now >= self._hold["down"] and fewer < self.limit:
                self._try(now, sample, rate, fewer, "down", "probe: fewer")
        self._reset(now)

    def _try(
        self, now: float, sample: HostSample, rate: float, target: int, kind: str, why: str
    ) -> None:
        """Change to `target` (within the ceiling and memory), to be judged on `rate`."""
        target = min(self.ceiling, target)
        if target == self.limit or (
            target > self.limit and self._memory_short(sample, more=target - self.limit)
        ):
            return
        self._trial = (self.limit, rate, kind)
        self._set(now, target, why)

    def _judge(self, now: float, rate: float) -> None:
        """Keep the change under trial, or undo it and hold that direction for HOLD."""
        assert self._trial is not None
        before, before_rate, kind = self._trial
        self._trial = None
        if kind == "down":
            reference = max(before_rate, self._down_from or 0.0)
            failed, why = rate < reference * (1 - TOLERANCE), "throughput fell"
            self._down_from = reference  # until a step up is kept: a level above it
        else:
            if kind == "up":
                failed, why = rate < before_rate * (1 + TOLERANCE), "no gain"
            else:  # "idle": more runs for an idle CPU, kept unless they cost throughput
                failed, why = rate < before_rate * (1 - TOLERANCE), "throughput fell"
            if not failed:
                self._down_from = None  # a new level: steps down start from it
        if not failed:
            return
        self._slow_start = False
        self._hold["down" if kind == "down" else "up"] = now + HOLD
        self._set(now, before, f"{why} at {self.limit}")

    def _set(self, now: float, limit: int, reason: str) -> None:
        if limit != self.limit:
            self.limit = limit
            self.changes.append(Change(now - self._began, limit, reason))
            self._settling = True
        self._reset(now)

    def _reset(self, now: float) -> None:
        self._window_start = now
        self._window_done = self._completed
        self._cpu: list[float] = []
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
