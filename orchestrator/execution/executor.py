"""Where attempts run: the seam between what a batch or a schedule does and where its runs go.

A batch decides what to run, how often to try again and what a result means; a schedule's
firing decides when and whether (its lock). Both hand each attempt to an `AttemptExecutor`,
which decides where it runs.

An attempt is plain data (`Attempt`: the prepared run, whose run id is the attempt's, and
its number), and its outcome a `RunResult`, so that an executor may ship it elsewhere (a
cluster's node) and bring the result back. Executors never retry: an attempt that cannot run
comes back `infra_error`, and the caller's rules decide. Every attempt handed to `run` ends
with a record in the caller's store, whatever happened to it.

The seam is narrow so that a newcomer's executor (or a decorator) has little to get right:
`AttemptExecutor` is what every executor does (open, reserve, run, release, reap_orphans,
close; only `run` has no default). What only some executors have is an interface of its
own, asked for with `isinstance` where it is used: `Capacity` (how many attempts it carries
at once: its cap, its runs per core) and `PoolControl` (sandboxes started ahead of runs:
has_pool, keep_ready, expect). A decorator derives from `DelegatingExecutor`, which forwards
every member of all three, so that none falls back to a default unseen.

How many attempts run at once is the caller's, not the executor's: the batch's session, the
scheduler of `schedule serve` and a cluster node's worker each hold their attempts to one
`concurrency.AdaptiveLimit` behind `concurrency.Slots`, and every one of those limits is made
by `attempt_limit` here, from what the executor says it carries (`Capacity`). An executor only
waits for room where it runs (a cluster's node that is full).

`LocalExecutor` runs attempts on this host, in the caller's threads, through
`runner.execute`, in warm sandboxes from a `pool.Pool` when it has them.
"""

from __future__ import annotations

import threading
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol, runtime_checkable

from ..backends import get_backend
from ..backends.base import Backend, Progress
from ..lifecycle.imagecache import ImageCache
from ..lifecycle.runner import PreparedRun, RunObservers, execute, sandbox_spec
from ..records.store import Store, new_run_id
from ..spec import RunResult
from .claim import Claim
from .concurrency import AUTO_CEILING, AdaptiveLimit
from .hostload import HostLoad
from .pool import MAX_SIZE, Pool, starts_per_core


@dataclass(frozen=True)
class Attempt:
    """One attempt of a run, as plain data: what runs (`prepared`, whose run id is the
    attempt's) and which try of its task it is (1 = the first)."""

    prepared: PreparedRun
    number: int = 1

    @property
    def run_id(self) -> str:
        return self.prepared.run_id


class AttemptExecutor(ABC):
    """Runs attempts somewhere: what every executor does. Thread-safe: callers run attempts
    from several threads.

    The life of an executor in a batch: `open` (get ready), then per attempt `reserve` (its
    run id, before anything of it exists) and `run` (or `release`, if the caller gives up
    before running it), then `close`. A firing may `run` an attempt it did not reserve.
    Only `run` must be written; the others' defaults suit an executor that gets nothing
    ready, holds nothing between calls and leaves nothing behind.
    """

    def open(self, template: PreparedRun, *, attempts: int, concurrency: int) -> None:  # noqa: B027
        """Get ready for `attempts` attempts like `template`, at most `concurrency` at once
        (an image, say). Raises `ImageBuildError` when the image cannot be had. Default:
        nothing to get ready."""

    def reserve(
        self, prepared: PreparedRun, *, number: int = 1, cancel: threading.Event | None = None
    ) -> Attempt:
        """The next attempt of `prepared`, with its own run id, before anything of it exists
        (an executor may have one ready for it; it may wait for that, unless `cancel` is set).
        It must then be `run` or `release`d. Default: a new run id."""
        return Attempt(replace(prepared, run_id=new_run_id()), number)

    @abstractmethod
    def run(self, attempt: Attempt, observers: RunObservers) -> RunResult:
        """Run the attempt to its end and return its result, recorded in `observers.store`
        under `attempt.run_id` whatever happened (cancelled before it started too); releases
        its reservation whatever happens. Raises OrchestratorError when it cannot even start
        (bad input, no engine, no record)."""

    def release(self, attempt: Attempt) -> None:  # noqa: B027
        """Give up a reserved attempt that will not run (what `reserve` held for it goes);
        idempotent. Default: nothing was held."""

    def reap_orphans(self, template: PreparedRun, store: Store) -> int:
        """Remove what dead orchestrators left where runs like `template` go, close their
        runs; how many sandboxes were removed. Default: nothing is ever left."""
        return 0

    def close(self) -> None:  # noqa: B027
        """Release what `open` made; idempotent. Default: nothing was made."""

    def __enter__(self) -> AttemptExecutor:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


@runtime_checkable
class Capacity(Protocol):
    """An executor's word on how many attempts it carries at once, for `attempt_limit`
    (an executor without it: no cap of its own, the limit's default start)."""

    def max_concurrency(self, template: PreparedRun) -> int | None:
        """The most attempts like `template` it can run at once (None: no limit of its own)."""
        ...

    def runs_per_core(self, template: PreparedRun) -> int | None:
        """Attempts like `template` at once per core that keep this host's CPU full, for an
        adaptive limit to start from (None: the limit's own default)."""
        ...


@runtime_checkable
class PoolControl(Protocol):
    """An executor that may keep a pool of warm sandboxes, started ahead of the runs that
    take them (`reserve` then hands one out): the caller says how many to keep ready and how
    many runs are still to come."""

    @property
    def has_pool(self) -> bool:
        """Whether it has a pool now, so that `keep_ready` starts sandboxes ahead of runs (a
        scheduler then wakes early)."""
        ...

    def keep_ready(self, prepared: PreparedRun, count: int) -> None:
        """Keep `count` sandboxes ready for runs like `prepared` (0: make no more)."""
        ...

    def expect(self, prepared: PreparedRun, attempts: int = 1) -> None:
        """`attempts` more attempts like `prepared` will be reserved than `open` said (a
        retry), so that a sandbox may be made for each (never one no attempt takes)."""
        ...


class DelegatingExecutor(AttemptExecutor):
    """The base of a decorator: forwards every member of `AttemptExecutor`, `Capacity` and
    `PoolControl` to `executor`, so a subclass overrides only what it changes and none
    falls back to a default unseen. Those the wrapped executor lacks answer as it would
    without them (no cap, nothing warm)."""

    def __init__(self, executor: AttemptExecutor) -> None:
        self.executor = executor
        # Asked once: a runtime-checked Protocol reads the members it checks for (a property).
        self._capacity = executor if isinstance(executor, Capacity) else None
        self._pool_control = executor if isinstance(executor, PoolControl) else None

    def open(self, template: PreparedRun, *, attempts: int, concurrency: int) -> None:
        self.executor.open(template, attempts=attempts, concurrency=concurrency)

    def reserve(
        self, prepared: PreparedRun, *, number: int = 1, cancel: threading.Event | None = None
    ) -> Attempt:
        return self.executor.reserve(prepared, number=number, cancel=cancel)

    def run(self, attempt: Attempt, observers: RunObservers) -> RunResult:
        return self.executor.run(attempt, observers)

    def release(self, attempt: Attempt) -> None:
        self.executor.release(attempt)

    def reap_orphans(self, template: PreparedRun, store: Store) -> int:
        return self.executor.reap_orphans(template, store)

    def close(self) -> None:
        self.executor.close()

    def max_concurrency(self, template: PreparedRun) -> int | None:
        return self._capacity.max_concurrency(template) if self._capacity is not None else None

    def runs_per_core(self, template: PreparedRun) -> int | None:
        return self._capacity.runs_per_core(template) if self._capacity is not None else None

    @property
    def has_pool(self) -> bool:
        return self._pool_control.has_pool if self._pool_control is not None else False

    def keep_ready(self, prepared: PreparedRun, count: int) -> None:
        if self._pool_control is not None:
            self._pool_control.keep_ready(prepared, count)

    def expect(self, prepared: PreparedRun, attempts: int = 1) -> None:
        if self._pool_control is not None:
            self._pool_control.expect(prepared, attempts)


def deprecated_pool_size(pool_size: int | None, warm: int | None, owner: str) -> int | None:
    """`pool_size`, or the deprecated keyword `warm` it replaced (said once, as a warning):
    "warm" names only the sandboxes now, not how many are kept."""
    if warm is None:
        return pool_size
    warnings.warn(
        f"{owner}(warm=...) is deprecated; pass pool_size=", DeprecationWarning, stacklevel=3
    )
    return warm if pool_size is None else pool_size


def attempt_limit(
    executor: AttemptExecutor,
    template: PreparedRun | None,
    *,
    requested: int | None,
    most: int | None = None,
    memory_mb: int | None = None,
    adapt: bool = True,
    message: Progress | None = None,
) -> AdaptiveLimit:
    """How many attempts like `template` run at once on `executor`: the one place that
    limit is made (a batch's session, `schedule serve`, a cluster node's worker). `requested`
    (None: auto) is lowered to the executor's cap (said through `message` when it was
    asked for) and to `most` (the attempts to run, when known); the limit starts from the
    executor's runs per core. Without a `template` (firings of several schedules) the
    executor is not asked."""
    cap = per_core = None
    if template is not None and isinstance(executor, Capacity):
        cap, per_core = executor.max_concurrency(template), executor.runs_per_core(template)
    if cap is not None and cap < (requested or AUTO_CEILING):
        if requested is not None and message is not None:
            message(f"concurrency {requested} lowered to {cap}, the backend's limit")
        requested = cap
    ceiling = requested if most is None else min(requested or AUTO_CEILING, max(1, most))
    return AdaptiveLimit(ceiling, memory_mb=memory_mb, per_core=per_core, adapt=adapt)


class LocalExecutor(AttemptExecutor, Capacity, PoolControl):
    """Attempts on this host, each in the calling thread, in a sandbox of the run's backend
        (`backend` when given, else found by the run's backend name): a warm one when the pool
        has one for it, else cold.

        `pool`: warm sandboxes to take (its owner closes it). `pool_size`: the size of the pool that
        `open` makes for a batch (None: the concurrency, or the attempts when fewer, for more
        than one attempt; 0: none; `keep_ready` then moves how many are kept, up to it; `warm`:
    its deprecated name).
        Images are prepared once from `open` on (one cache, shared with the pool).
    """

    def __init__(
        self,
        backend: Backend | None = None,
        *,
        pool: Pool | None = None,
        pool_size: int | None = None,
        on_message: Progress | None = None,
        warm: int | None = None,
    ) -> None:
        self.backend = backend
        self.pool = pool
        self.pool_size = deprecated_pool_size(pool_size, warm, "LocalExecutor")
        self.message = on_message or (lambda _text: None)
        self.images: ImageCache | None = pool.images if pool is not None else None
        self._own_pool = False
        self._backends: dict[tuple[str, str | Path | None], Backend] = {}
        self._claims: dict[str, Claim] = {}
        self._lock = threading.Lock()

    @property
    def has_pool(self) -> bool:
        return self.pool is not None

    def backend_for(self, prepared: PreparedRun) -> Backend:
        """The backend of a run: the one given, else one per backend name (and env file)."""
        if self.backend is not None:
            return self.backend
        key = (prepared.backend, prepared.spec.env_file)
        with self._lock:
            if key not in self._backends:
                self._backends[key] = get_backend(prepared.backend, env_file=key[1])
            return self._backends[key]

    def max_concurrency(self, template: PreparedRun) -> int | None:
        cap = self.backend_for(template).max_concurrency
        return cap if isinstance(cap, int) and cap > 0 else None

    def runs_per_core(self, template: PreparedRun) -> int | None:
        """The backend's `starts_per_core` when this executor keeps sandboxes warm on this
        host: its pool's builders then overlap the starts beside the runs, and a warm run is
        mostly CPU (as much as the backend says its sandboxes also wait)."""
        backend = self.backend_for(template)
        pooled = self.pool is not None or self.pool_size != 0
        if not pooled or backend.capabilities.sandboxes_run != "this_host":
            return None
        # The image is not chosen yet: what a start costs does not depend on it.
        return starts_per_core(backend, sandbox_spec(template, image=""))

    def open(self, template: PreparedRun, *, attempts: int, concurrency: int) -> None:
        backend = self.backend_for(template)
        # runsc on an engine without it is bad input for the whole batch, before its image
        backend.check_runtime(template.sandbox_runtime, asked=bool(template.spec.sandbox_runtime))
        self.images = self.images or ImageCache()
        self.images.prepare(backend, template.image_requirements, self.message)
        size = self.pool_size
        if size is None:  # one per slot, while some attempts wait for one (fewer may run)
            size = min(concurrency, attempts) if attempts > 1 else 0
        if self.pool is None and size > 0 and attempts > 0:
            size = max(min(size, attempts, MAX_SIZE), 2)  # no more than attempts to take them
            # A batch's refills wait while the host's CPU is full: its runs come first.
            self.pool = Pool(
                size=size,
                backend=backend,
                on_message=self.message,
                images=self.images,
                defer=HostLoad().saturated,
            )
            self._own_pool = True
        if self.pool is not None:  # its own pool makes no sandbox past the last attempt
            self.pool.keep_ready(template, runs=attempts if self._own_pool else None)

    def expect(self, prepared: PreparedRun, attempts: int = 1) -> None:
        if self.pool is not None and self._own_pool:
            self.pool.expect(prepared, attempts)

    def keep_ready(self, prepared: PreparedRun, count: int) -> None:
        if self.pool is not None:
            self.pool.keep_ready(prepared, count)

    def reserve(
        self, prepared: PreparedRun, *, number: int = 1, cancel: threading.Event | None = None
    ) -> Attempt:
        claim = self.pool.claim(prepared, cancel=cancel) if self.pool is not None else None
        if claim is None:
            return super().reserve(prepared, number=number)
        with self._lock:
            self._claims[claim.run_id] = claim
        return Attempt(replace(prepared, run_id=claim.run_id), number)

    def run(self, attempt: Attempt, observers: RunObservers) -> RunResult:
        prepared = attempt.prepared
        with self._lock:
            claim = self._claims.pop(prepared.run_id, None)
        if claim is not None and self.pool is not None:
            return self.pool.execute_claimed(prepared, claim, observers=observers)
        backend = self.backend_for(prepared)
        return execute(prepared, backend=backend, observers=observers, images=self.images)

    def release(self, attempt: Attempt) -> None:
        with self._lock:
            claim = self._claims.pop(attempt.run_id, None)
        if claim is not None:
            claim.release()

    def reap_orphans(self, template: PreparedRun, store: Store) -> int:
        from ..lifecycle.cleanup import cleanup

        return len(cleanup(self.backend_for(template), store=store).removed)

    def close(self) -> None:
        with self._lock:
            claims, self._claims = list(self._claims.values()), {}
        for claim in claims:
            claim.release()
        if self._own_pool and self.pool is not None:
            self.pool.close()
            self.pool, self._own_pool = None, False
