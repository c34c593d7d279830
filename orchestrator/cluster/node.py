"""The worker on one node of a Ray cluster: a long-lived actor that runs attempts through the
single-run API with this node's own Docker engine, image and warm pool (`LocalExecutor`).

How many attempts it runs at once is the node's own (`concurrency.AdaptiveLimit` on this
host, made by `executor.attempt_limit` as every such limit is, under the
`orchestrator_sandboxes` it declares): a batch's `open` starts the measure, and every
finished attempt tells the driver the node's limit now, which the driver holds to (a node
whose runs are CPU-bound settles under what it declares; one whose runs wait on a hosted
model climbs to it: benchmarks/results/code_figures.md#concurrency-per-core). Without a
batch (a schedule's firings) the node runs as many as it declares.

It records each run in the node's own state directory (`$ORCHESTRATOR_HOME/ray-node`, a
store apart from any driver's on the same machine) and hands the record back packed; the
driver writes it into its store and then asks the node to `forget` its copy. A run's secret
values arrive inside the call that runs it, live in this process's memory only, and are
never written here (the record is masked, as on one machine).

A plain class: `executor.RayExecutor` makes it an actor (`ray.remote`) with Ray's retries
and restarts off, so that importing this module needs no Ray.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from dataclasses import replace
from typing import Any

from ..backends import get_backend
from ..backends.base import Backend
from ..execution.concurrency import AdaptiveLimit
from ..execution.executor import Attempt, LocalExecutor, attempt_limit
from ..lifecycle.cleanup import cleanup
from ..lifecycle.runner import PreparedRun, RunObservers
from ..paths import home_dir
from ..records.store import Store
from .transfer import pack_record

#: The node's own record store, under its state directory.
NODE_STORE = "ray-node"
#: Seconds between the node's measures of its host while it has a batch (the limit's
#: windows are seconds long: a run lasts one or more).
PACE_TICK = 0.5


class NodeWorker:
    """Runs the attempts a driver sends to this node, each in a sandbox of this node's
    engine; thread-safe (the actor runs its calls on several threads)."""

    def __init__(self, node: dict[str, Any], backend: str, pool_size: int | None = None) -> None:
        self.node = dict(node)
        self.backend_name = backend
        self.pool_size = pool_size
        self.store = Store(home_dir() / NODE_STORE)
        self._backend: Backend | None = None
        self._executor: LocalExecutor | None = None
        self._cancels: dict[str, threading.Event] = {}
        self._attempts: dict[str, Attempt] = {}
        self._lock = threading.Lock()
        #: This node's limit, from a batch's `open` on (None: as many as it declares).
        self._pace: AdaptiveLimit | None = None
        self._running = 0
        self._closed = threading.Event()

    # -- life of the worker ----------------------------------------------------------------

    def hello(self) -> dict[str, Any]:
        """Who and where this worker is, once its engine answers (raises if it does not):
        what the driver checks before sending any attempt here."""
        self._local()
        return {
            **self.node,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "state_dir": str(self.store.root),
        }

    def _local(self) -> LocalExecutor:
        with self._lock:
            if self._executor is None:
                self._backend = get_backend(self.backend_name)
                self._executor = LocalExecutor(self._backend, pool_size=self.pool_size)
            return self._executor

    def reap_orphans(self) -> int:
        """What dead workers of this node (a killed node, a killed driver's actors) left:
        their sandboxes removed and their runs closed in the node's store."""
        self._local()
        assert self._backend is not None
        return len(cleanup(self._backend, store=self.store).removed)

    def open(
        self, template: PreparedRun, attempts: int, concurrency: int, adapt: bool = True
    ) -> int:
        """The image checked or built here once, this node's limit measured from now on (at
        most `concurrency`, what it declares; `adapt` False: exactly that) and warm
        sandboxes for `attempts` (at most that many at once). Returns the limit: how many
        attempts the driver may send at once."""
        local = self._local()
        with self._lock:
            if self._pace is None:
                memory = template.limits.memory_mb
                self._pace = attempt_limit(
                    local, template, requested=concurrency, memory_mb=memory, adapt=adapt
                )
                threading.Thread(target=self._measure, name="node-pace", daemon=True).start()
            pace = self._pace
        local.open(template, attempts=attempts, concurrency=min(concurrency, pace.limit))
        return pace.limit

    def _measure(self) -> None:
        """The limit's measures (the host's CPU and memory, the attempts going), until
        `close`."""
        while not self._closed.wait(PACE_TICK):
            with self._lock:
                pace, running = self._pace, self._running
            if pace is not None:
                pace.tick(running)

    def expect(self, prepared: PreparedRun, attempts: int) -> None:
        self._local().expect(prepared, attempts)

    def close(self) -> None:
        """Warm sandboxes removed; and what dead workers left since `reap_orphans` (a
        driver killed meanwhile: its worker here died with it)."""
        self._closed.set()
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.close()
        if self._backend is not None:
            with contextlib.suppress(Exception):  # best effort; the next worker tries again
                cleanup(self._backend, store=self.store)

    # -- attempts ---------------------------------------------------------------------------

    def reserve(self, prepared: PreparedRun, number: int) -> str:
        """An attempt's run id: a warm sandbox's here, or a new one."""
        attempt = self._local().reserve(prepared, number=number)
        with self._lock:
            self._attempts[attempt.run_id] = attempt
        return attempt.run_id

    def release(self, run_id: str) -> None:
        with self._lock:
            attempt = self._attempts.pop(run_id, None)
        if attempt is not None:
            self._local().release(attempt)

    def run(self, prepared: PreparedRun, secrets: dict[str, str], number: int) -> dict[str, Any]:
        """Run one attempt (its secrets given apart, never stored) to its end; its packed
        record (`transfer.pack_record`), with the node's limit now (`node_limit`; None
        without a batch's `open`)."""
        run_id = prepared.run_id
        cancel = threading.Event()
        with self._lock:
            self._cancels[run_id] = cancel
            self._attempts.pop(run_id, None)  # its warm sandbox's claim goes with the run id
            self._running += 1
        attempt = Attempt(replace(prepared, secrets=dict(secrets)), number)
        try:
            self._local().run(attempt, RunObservers(store=self.store, cancel=cancel))
        finally:
            with self._lock:
                self._cancels.pop(run_id, None)
                self._running -= 1
                pace, running = self._pace, self._running
            if pace is not None:
                pace.completed()
        limit = pace.tick(running) if pace is not None else None
        return {**pack_record(self.store, run_id), "node_limit": limit}

    def cancel(self, run_id: str) -> None:
        """Stop a running attempt (recorded `cancelled`, its sandbox removed)."""
        with self._lock:
            event = self._cancels.get(run_id)
        if event is not None:
            event.set()

    def forget(self, run_id: str) -> None:
        """The driver holds the record now: the node's copy goes."""
        self.store.delete_run(run_id)
