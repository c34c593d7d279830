"""Warm sandboxes: a bounded pool of pre-started sandboxes, each serving one run, never reused.

    with Pool(size=2) as pool:
        result = pool.run(RunSpec(payload="agent_payloads/research_team"))

A pooled sandbox is created by the backend exactly as a cold one (same hardening, labels,
network policy, egress proxy and model gateway), for a run id chosen in advance; its runtime
has imported smolagents and waits on its stdin. Nothing of a run (request, payload, secrets,
the gateway's key and token) is in it until a run takes it; the run then goes through
`runner.execute` like any other and the sandbox is removed after it, whatever happened.

Sandboxes are pooled per key: image, command, limits, network policy and gateway endpoint
(a run's token and key are its own, so they are no part of the key). The pool holds at most
`size` sandboxes, idle or being made; a background builder refills a slot when a run takes
its sandbox. When its owner says how many runs are still to come (`keep_ready(..., runs=N)`, a
batch's attempts; `expect` for a retry), the pool never makes a sandbox that no run will
take: every run handed out (`claim`, warm or cold) counts down, and the builder stops once
each run still to come has a sandbox idle or being made, so the last ones made are taken
and none is idle when the batch ends. Each idle sandbox has a time-to-live that its own
deadline keeper enforces, with or without this process: the pool replaces one shortly
before it expires, and `close` removes the idle ones. If this process dies, the
sandboxes' stdin ends and their runtimes exit; `orchestrator cleanup` removes the stopped
containers of dead owners.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..backends import get_backend
from ..backends.base import Backend, Progress, Sandbox, SandboxSpec, WarmSandboxes
from ..errors import ConfigError
from ..labels import owner_label, pool_marker, run_labels
from ..lifecycle.imagecache import ImageCache
from ..lifecycle.prepared import PreparedRun
from ..lifecycle.request import sandbox_spec
from ..lifecycle.runner import RunObservers, execute, observers_of, run_spec
from ..records.record import EventHandler
from ..records.store import Store, new_run_id
from ..spec import RunResult, RunSpec
from .claim import Claim, remove_later, wait_removals

#: Idle sandboxes at most (idle or being made), unless told otherwise.
DEFAULT_SIZE = 2
#: The most sandboxes a pool may hold: each idle one is a Python process with smolagents
#: loaded (and, for a hosted model, its network and gateway).
MAX_SIZE = 32
#: How long an idle sandbox waits for a run before its keeper stops it, and the longest
#: it may be told to wait.
DEFAULT_TTL = 120.0
MAX_TTL = 3600.0
#: An idle sandbox this close to its time-to-live is replaced, not handed out: the run
#: must have read its request (which moves the keeper's deadline) before the keeper stops it.
EXPIRY_MARGIN = 10.0
#: Sandboxes made at once: as many per core as the backend says (`starts_per_core`, at most
#: the second), at least the first (two overlap one's engine calls with another's imports).
#: On a full CPU runs wait for them (`Pool._queue`): they must keep the CPU full themselves.
MIN_BUILDERS, MAX_STARTS_PER_CORE = 2, 2
#: A refill starts this long after a run took its sandbox, so that the run's own start (the
#: latency that matters) does not share the CPU with the next sandbox's start; only while
#: the key has another sandbox ready (else the next run would wait for this one: see
#: benchmarks/results/code_figures.md#refill-delay).
REFILL_DELAY = 0.3
#: After a failed creation, how long the builder leaves that key alone (runs go cold).
FAILURE_BACKOFF = 30.0
#: Sandboxes being made at once, the builders' and runs' gone cold together, per core (at
#: least the builders'): a batch's run with none ready for it starts cold only below this
#: (where the backend's sandboxes run on this host: `Capabilities.sandboxes_run`).
#: The CPU's busy share shows a burst of starts only once they are under way: at a batch's
#: start at a high fixed concurrency, most runs went cold at once beside the builders
#: (benchmarks/results/code_figures.md#sandbox-makings-per-core).
MAKINGS_PER_CORE = 2
#: How long a run gone cold counts as a making, until the pool has timed its own makings
#: (it does not see a cold start end; its own, the same work, stand in).
MAKING_GUESS = 2.0

Key = tuple[Any, ...]


def starts_per_core(backend: Backend, spec: SandboxSpec) -> int:
    """Sandboxes like `spec`'s made at once per core: as many as the backend asks, at most
    MAX_STARTS_PER_CORE (also where a warm batch's adaptive limit starts: `LocalExecutor`);
    one for a backend without warm sandboxes."""
    if not isinstance(backend, WarmSandboxes):
        return 1
    return min(MAX_STARTS_PER_CORE, backend.starts_per_core(spec))


def pool_key(spec: SandboxSpec) -> Key:
    """What makes two runs' sandboxes interchangeable before either has its request."""
    gateway = spec.gateway
    gateway_key = (gateway.upstream, gateway.on_this_host) if gateway is not None else None
    return (spec.image, spec.command, spec.limits, spec.network, gateway_key, spec.runtime)


@dataclass
class _Idle:
    run_id: str
    sandbox: Sandbox
    idle_until: float


@dataclass
class _Slot:
    """The sandboxes of one key: ready ones, how many are being made, how many are wanted."""

    spec: SandboxSpec  # the key's sandbox spec (its run id and labels are replaced per sandbox)
    wanted: int
    starts: int  # the most being made at once (of every key) to make one of this key
    #: Runs still to be handed out (claimed) for this key; None: unknown (no end in sight).
    remaining: int | None = None
    ready: deque[_Idle] = field(default_factory=deque)
    making: int = 0
    #: Runs waiting for a sandbox being made (no more than are being made, unless the host
    #: has no room for another start: `Pool._queue`; the others start cold).
    waiting: int = 0
    failed_until: float = 0.0
    error: str | None = None
    #: When a run last took a sandbox of this key (monotonic).
    claimed_at: float = 0.0


class Pool:
    """Pre-started sandboxes for runs (see the module docstring). Thread-safe.

    `size`: the most sandboxes idle or being made at once; `ttl`: seconds an idle sandbox
    waits for a run; `builders`: sandboxes made at once (None: as the backend asks per
    core); `images`: the image cache to share (a batch's; else the pool's own); `defer`:
    while it returns True (the host's CPU is full, say), a key gets a sandbox only while it
    has none idle (no stock built ahead on a CPU that running work needs now), and a run
    with no sandbox ready waits for the builders rather than start cold beside them.
    Raises ConfigError for a size outside 1..MAX_SIZE or a time-to-live outside
    EXPIRY_MARGIN + 5 s..MAX_TTL."""

    def __init__(
        self,
        size: int = DEFAULT_SIZE,
        ttl: float = DEFAULT_TTL,
        *,
        backend: Backend | None = None,
        store: Store | None = None,
        builders: int | None = None,
        on_message: Progress | None = None,
        images: ImageCache | None = None,
        defer: Callable[[], bool] | None = None,
    ) -> None:
        if not 1 <= size <= MAX_SIZE:
            raise ConfigError(
                f"A pool of {size} sandboxes is out of range.",
                f"Use a size from 1 to {MAX_SIZE} (each idle sandbox holds a loaded runtime).",
            )
        if not EXPIRY_MARGIN + 5 <= ttl <= MAX_TTL:
            raise ConfigError(
                f"A time-to-live of {ttl:g} s is out of range for a pooled sandbox.",
                f"Use from {EXPIRY_MARGIN + 5:g} to {MAX_TTL:g} seconds.",
            )
        self.size = size
        self.ttl = ttl
        self.backend = backend
        self.store = store
        self.message = on_message or (lambda _text: None)
        self.defer = defer
        self._slots: dict[Key, _Slot] = {}
        self.images = images or ImageCache()
        self._lock = threading.Condition()
        self._closed = False
        self._marker: Path | None = None
        self._cores = os.cpu_count() or 1
        self._fixed_builders = builders
        self._colds: deque[float] = deque()  # when runs went cold (monotonic), for a while
        self._making_seconds = MAKING_GUESS  # how long a making takes, smoothed
        threads = builders or max(MIN_BUILDERS, MAX_STARTS_PER_CORE * self._cores)
        self._builders = [
            threading.Thread(target=self._build_loop, name=f"pool-builder-{n}", daemon=True)
            for n in range(max(1, threads))
        ]
        for thread in self._builders:
            thread.start()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- running ------------------------------------------------------------------------------

    def run(
        self,
        spec: RunSpec,
        *,
        on_event: EventHandler | None = None,
        on_progress: Progress | None = None,
        cancel: threading.Event | None = None,
    ) -> RunResult:
        """`runner.run`, in a warm sandbox when one is ready or on its way (else cold).

        Raises OrchestratorError for bad input before anything starts, as `runner.run`."""
        self.store = self.store or Store()
        observers = observers_of(on_event, on_progress, cancel, self.store)
        return run_spec(spec, observers, executes=self._execute)

    def _execute(self, prepared: PreparedRun, observers: RunObservers) -> RunResult:
        """`execute` as `runner.run_spec` calls it."""
        return self.execute(prepared, observers=observers)

    def execute(
        self,
        prepared: PreparedRun,
        *,
        backend: Backend | None = None,
        observers: RunObservers | None = None,
    ) -> RunResult:
        """`runner.execute` of `prepared` in a sandbox of this pool when it can have one
        (the run's id is then the sandbox's), else cold (in a sandbox of `backend`, by
        default the pool's)."""
        observers = observers or RunObservers()
        claim = self.claim(prepared, cancel=observers.cancel)
        if claim is None:
            backend = backend or self._backend_for(prepared)
            return execute(prepared, backend=backend, observers=observers, images=self.images)
        return self.execute_claimed(  # which releases the claim, whatever happens
            replace(prepared, run_id=claim.run_id), claim, observers=observers
        )

    def execute_claimed(
        self, prepared: PreparedRun, claim: Claim, *, observers: RunObservers | None = None
    ) -> RunResult:
        """`runner.execute` in the claimed sandbox; `prepared.run_id` must be the claim's
        (else ValueError). The sandbox is removed after the run, as any; its network, proxy
        and gateway in the background (the claim's release), so that the result does not
        wait for them."""
        try:
            return execute(
                prepared,
                backend=self._backend_for(prepared),
                observers=observers,
                images=self.images,
                warm_sandbox=claim,
            )
        finally:
            claim.release()

    def image(self, prepared: PreparedRun, backend: Backend) -> str:
        """The image of a run, prepared once per image cache (its inputs cannot change
        meanwhile)."""
        return self.images.prepare(backend, prepared.image_requirements, self.message)

    def keep_ready(
        self, prepared: PreparedRun, count: int | None = None, *, runs: int | None = None
    ) -> None:
        """Keep `count` (default: the pool's size) sandboxes ready for runs like `prepared`;
        `runs`: how many such runs are still to be handed out (None: leave it as it was,
        unknown at first): the pool then never makes more sandboxes than that. The backend
        must be the one given to the pool. Prepares the image first (so it may raise
        `ImageBuildError`)."""
        wanted = self.size if count is None else max(0, min(count, self.size))
        self._update(prepared, wanted=wanted, runs=runs)

    warm = keep_ready  # its deprecated name ("warm" names only the sandboxes now)

    def expect(self, prepared: PreparedRun, more: int = 1) -> None:
        """`more` runs like `prepared` will be handed out than `keep_ready(..., runs=N)` said (a
        retry): the pool may make a sandbox for each. Nothing when the count is unknown."""
        self._update(prepared, more=more)

    def _update(
        self,
        prepared: PreparedRun,
        *,
        wanted: int | None = None,
        runs: int | None = None,
        more: int = 0,
    ) -> None:
        backend = self._backend_for(prepared)
        if prepared.backend != backend.name or not isinstance(backend, WarmSandboxes):
            return
        spec = self._key_spec(prepared, backend)
        starts = self._starts(spec, backend)  # asked before the lock: it may ask the engine
        with self._lock:
            slot = self._slot(spec, starts)
            if wanted is not None:
                slot.wanted = wanted
            if runs is not None:
                slot.remaining = max(0, runs)
            if more and slot.remaining is not None:
                slot.remaining += more
            self._lock.notify_all()

    def claim(
        self, prepared: PreparedRun, *, cancel: threading.Event | None = None
    ) -> Claim | None:
        """A ready sandbox for `prepared`, waiting while one is being made for it; None when
        there is none to have (the run then goes cold). The claim says how long the run
        waited for it."""
        backend = self._backend_for(prepared)
        warm = isinstance(backend, WarmSandboxes)
        if self._closed or prepared.backend != backend.name or not warm:
            return None
        started = time.monotonic()
        spec = self._key_spec(prepared, backend)
        starts = self._starts(spec, backend)
        with self._lock:
            slot = self._slot(spec, starts)
            if not slot.ready and slot.waiting >= slot.making and not self._queue(slot):
                self._cold(slot)  # none coming for this run, and room for its start
                return None
            slot.waiting += 1
            try:
                while not self._closed and not (cancel is not None and cancel.is_set()):
                    while slot.ready:
                        idle = slot.ready.popleft()
                        if idle.idle_until - time.time() > EXPIRY_MARGIN:
                            self._handed_out(slot)  # a slot is free: the builder refills it
                            slot.claimed_at = time.monotonic()
                            waited = round(time.monotonic() - started, 3)
                            return Claim(idle.run_id, idle.sandbox, waited)
                        remove_later(idle.sandbox)
                        self._lock.notify_all()  # replace it
                    if slot.making < slot.waiting and not self._queue(slot):
                        break
                    self._lock.wait(timeout=0.5)
            finally:
                slot.waiting -= 1
            self._cold(slot)
        return None

    def _starts(self, spec: SandboxSpec, backend: Backend) -> int:  # the slot's `starts`
        per_core = starts_per_core(backend, spec)
        return self._fixed_builders or max(MIN_BUILDERS, per_core * self._cores)

    def _slot(self, spec: SandboxSpec, starts: int) -> _Slot:
        """The slot of `spec`'s key, new if need be (lock held)."""
        if (slot := self._slots.get(key := pool_key(spec))) is None:
            slot = self._slots[key] = _Slot(spec=spec, wanted=self.size, starts=starts)
            self._lock.notify_all()
        return slot

    def _queue(self, slot: _Slot) -> bool:
        """Whether a run with no sandbox ready or coming for it waits for the builders' next
        one rather than start cold (lock held): for a pool that defers to the host (`defer`:
        a batch's), open, whose builds of the key are not backing off after a failure, while
        the host is saturated or (for sandboxes made on this host) MAKINGS_PER_CORE
        sandboxes are being made already. A cold start would only add a making to a full CPU,
        beside the builders' (while runs did, a warm batch ran slower than a cold one:
        benchmarks/results/code_figures.md#sandbox-makings-per-core)."""
        if self.defer is None or self._closed or time.monotonic() < slot.failed_until:
            return False
        here = self.backend is not None and self.backend.capabilities.sandboxes_run == "this_host"
        most = max(MAKINGS_PER_CORE * self._cores, slot.starts)
        return (here and self._makings() >= most) or self.defer()

    def _makings(self) -> int:
        """Sandboxes being made now (lock held): the builders', and the runs gone cold no
        longer ago than a making of the pool's takes."""
        now = time.monotonic()
        while self._colds and now - self._colds[0] > self._making_seconds:
            self._colds.popleft()
        return sum(s.making for s in self._slots.values()) + len(self._colds)

    def _cold(self, slot: _Slot) -> None:
        """A run of `slot` goes cold (lock held): handed out, and its start under way."""
        self._colds.append(time.monotonic())
        self._handed_out(slot)

    def _handed_out(self, slot: _Slot) -> None:
        """A run of `slot` was handed out, with a sandbox or cold: one fewer to come (lock
        held). Wakes the builder."""
        if slot.remaining is not None:
            slot.remaining = max(0, slot.remaining - 1)
        self._lock.notify_all()

    def close(self) -> None:
        """Stop refilling and remove every idle sandbox (the ones being made too, once made).
        Idempotent. The idle ones go first: a builder may be waiting for a slot under the
        backend's cap (E2B) that only their removal frees."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            idle = [i for slot in self._slots.values() for i in slot.ready]
            for slot in self._slots.values():
                slot.ready.clear()
        workers = [threading.Thread(target=i.sandbox.remove) for i in idle]
        for worker in workers:
            worker.start()
        for thread in workers + self._builders:
            thread.join(timeout=60)
        wait_removals()
        if self._marker is not None:
            with contextlib.suppress(OSError):
                self._marker.unlink()

    def runs_waiting(self) -> int:
        """Runs waiting for a sandbox being made, over every key."""
        with self._lock:
            return sum(s.waiting for s in self._slots.values())

    def stats(self) -> dict[str, int]:
        """Idle and being-made sandboxes, over every key."""
        with self._lock:
            return {
                "idle": sum(len(s.ready) for s in self._slots.values()),
                "making": sum(s.making for s in self._slots.values()),
            }

    # -- the builder --------------------------------------------------------------------------

    def _can_make(self, slot: _Slot) -> bool:
        """Whether the builder would make a sandbox of `slot` now (lock held)."""
        total = sum(len(s.ready) + s.making for s in self._slots.values())
        making = sum(s.making for s in self._slots.values())
        wanted = slot.wanted if slot.remaining is None else min(slot.wanted, slot.remaining)
        return (
            total < self.size
            and making < slot.starts
            and len(slot.ready) + slot.making < wanted
            and time.monotonic() >= slot.failed_until
        )

    def _next(self) -> tuple[_Slot, str] | None:
        """The slot to make a sandbox for, and its run id (lock held); marks it as making."""
        now = time.time()
        for slot in self._slots.values():  # first, replace sandboxes about to expire
            while slot.ready and slot.ready[0].idle_until - now <= EXPIRY_MARGIN:
                remove_later(slot.ready.popleft().sandbox)
        candidates = [s for s in self._slots.values() if self._can_make(s)]
        if candidates and self.defer is not None and self.defer():  # no stock, then
            candidates = [s for s in candidates if not s.ready]
        if not candidates:
            return None
        slot = max(candidates, key=lambda s: s.wanted - len(s.ready) - s.making)
        slot.making += 1
        return slot, new_run_id()

    def _build_loop(self) -> None:
        while True:
            with self._lock:
                job = None
                while not self._closed and (job := self._next()) is None:
                    self._lock.wait(timeout=1.0)
                if self._closed or job is None:
                    return
                slot, run_id = job
                # A run that comes now has a sandbox ready: this one may wait its turn.
                pause = slot.claimed_at + REFILL_DELAY - time.monotonic() if slot.ready else 0
            if pause > 0:
                time.sleep(pause)
            started = time.monotonic()
            idle = self._make(slot, run_id)
            with self._lock:
                slot.making -= 1
                if idle is not None:  # a moving average of the last few makings' time
                    self._making_seconds += (time.monotonic() - started - self._making_seconds) / 4
                if idle is not None and self._closed:
                    remove_later(idle.sandbox)
                elif idle is not None:
                    slot.ready.append(idle)
                self._lock.notify_all()

    def _mark(self) -> None:
        """Leave this process's marker in the state directory before the first sandbox, so
        that if it dies the next command removes what it left (`cleanup.reap_dead_pools`)."""
        if self._marker is None:
            marker = pool_marker((self.store or Store()).root)
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(owner_label() + "\n")
            self._marker = marker

    def _make(self, slot: _Slot, run_id: str) -> _Idle | None:
        assert isinstance(self.backend, WarmSandboxes)  # only such a backend gets slots
        spec = replace(slot.spec, run_id=run_id, labels=run_labels(run_id))
        try:
            self._mark()
            idle_until = time.time() + self.ttl
            sandbox = self.backend.create_idle(spec, lambda _m: None, self.ttl)
        except Exception as exc:  # the runs go cold meanwhile; said once per failure
            with self._lock:
                slot.failed_until = time.monotonic() + FAILURE_BACKOFF
                slot.error = str(exc)
            self.message(f"could not start a warm sandbox ({exc}); runs start cold meanwhile")
            return None
        return _Idle(run_id, sandbox, idle_until)

    # -- helpers ------------------------------------------------------------------------------

    def _backend_for(self, prepared: PreparedRun) -> Backend:
        if self.backend is None:
            self.backend = get_backend(prepared.backend, env_file=prepared.spec.env_file)
        return self.backend

    def _key_spec(self, prepared: PreparedRun, backend: Backend) -> SandboxSpec:
        return sandbox_spec(prepared, self.image(prepared, backend))
