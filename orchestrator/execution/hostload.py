"""How busy this host is, measured: CPU use, the run queue and memory still available.

    host = HostLoad()
    sample = host.sample()  # cpu_busy over the time since the previous sample, run queue, memory

Read from Linux's `/proc/stat` and `/proc/meminfo` (cheap: two small reads, no process
spawned). The CPU's busy share is measured between two samples, so it reacts within a second,
where the load average lags by a minute (too slow for a batch whose runs last a second).
Elsewhere the load average stands in for both CPU figures and memory is unknown (None): the
rules that use them then hold still rather than guess.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
PROC_MEMINFO = Path("/proc/meminfo")
#: A sample this recent is returned again instead of reading /proc twice (many callers).
MIN_INTERVAL = 0.5
#: The CPU's busy share at or above which the host counts as saturated: a sandbox made now
#: would take its CPU from running work.
SATURATED = 0.9


@dataclass(frozen=True)
class HostSample:
    """One measurement. `cpu_busy`: share of all cores busy (0..1) since the previous
    sample; `runnable`: runnable threads now (the kernel's run queue, ourselves included);
    `memory_available_mb`/`memory_total_mb`: None where unknown."""

    at: float
    cores: int
    cpu_busy: float
    runnable: float
    memory_available_mb: int | None
    memory_total_mb: int | None


def cpu_times(text: str) -> tuple[int, int]:
    """(busy, total) jiffies of all cores from /proc/stat's text: idle and iowait are idle."""
    for line in text.splitlines():
        if line.startswith("cpu "):
            values = [int(v) for v in line.split()[1:]]
            idle = values[3] + (values[4] if len(values) > 4 else 0)
            total = sum(values[:8])  # guest times are already counted in user and nice
            return total - idle, total
    raise ValueError("no cpu line in /proc/stat")


def procs_running(text: str) -> int | None:
    for line in text.splitlines():
        if line.startswith("procs_running "):
            return int(line.split()[1])
    return None


def memory_mb(text: str) -> tuple[int | None, int | None]:
    """(available, total) MiB from /proc/meminfo's text."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in ("MemAvailable", "MemTotal"):
            found[name] = int(rest.split()[0]) // 1024
    return found.get("MemAvailable"), found.get("MemTotal")


class HostLoad:
    """Samples of this host's load (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self.cores = os.cpu_count() or 1
        self._lock = threading.Lock()
        self._last: tuple[int, int] | None = None
        self._sample: HostSample | None = None

    def sample(self) -> HostSample:
        """The host now; the CPU's busy share since the previous call (at most MIN_INTERVAL
        old: a more recent sample is returned again)."""
        with self._lock:
            now = time.monotonic()
            if self._sample is not None and now - self._sample.at < MIN_INTERVAL:
                return self._sample
            self._sample = self._measure(now)
            return self._sample

    def saturated(self) -> bool:
        """Whether the CPU is full (busy share >= SATURATED): new work would only queue."""
        return self.sample().cpu_busy >= SATURATED

    def _measure(self, now: float) -> HostSample:
        try:
            stat = PROC_STAT.read_text()
            busy, total = cpu_times(stat)
            runnable: float | None = procs_running(stat)
        except (OSError, ValueError):
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
            return HostSample(now, self.cores, min(1.0, load / self.cores), load, None, None)
        previous, self._last = self._last, (busy, total)
        if previous is None or total <= previous[1]:
            # The first sample has nothing to compare with: the load average stands in.
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
            share = min(1.0, load / self.cores)
        else:
            share = (busy - previous[0]) / (total - previous[1])
        try:
            available, total_mb = memory_mb(PROC_MEMINFO.read_text())
        except (OSError, ValueError):
            available = total_mb = None
        return HostSample(
            now,
            self.cores,
            max(0.0, min(1.0, share)),
            float(runnable if runnable is not None else share * self.cores),
            available,
            total_mb,
        )
