"""`RayExecutor`: a batch's or a schedule's attempts on the nodes of a Ray cluster.

The driver (the machine that started the batch) keeps the batch: tasks, results, retries,
scoring, the run index and every record. Each node that declares the custom resource
`orchestrator_sandboxes` gets one long-lived worker (`node.NodeWorker`, a Ray actor pinned
to it, holding that many units of the resource) that runs attempts with the node's own
engine, image and warm pool, as many at once as the node says it carries now (its own
adaptive limit under what it declares: `node.NodeWorker`). An attempt is one Ray call with
Ray's retries and restarts off: a node, worker or result object that is lost ends the
attempt `infra_error` (type `node_lost`, naming the node) in the driver's store, and the
batch's rules decide whether it runs again, on whichever node has room. An attempt is
finished only once the node's record of it is in the driver's store
(`transfer.import_record`).

Secrets: a run's secret values travel to its node as an argument of the call that runs it
(small arguments are inlined in Ray's call, not put in its object store), live in the
worker's memory, and are never written on the node; the model gateway runs beside the
sandbox on the node. Ray's transport is plain gRPC unless the cluster runs with Ray's TLS
(docs/guides/ray.md).
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from ..errors import ConfigError, EngineUnavailable
from ..execution.executor import Attempt, AttemptExecutor, Capacity, deprecated_pool_size
from ..images.imagedef import Progress
from ..lifecycle.runner import PreparedRun, RunObservers
from ..records.store import Store, new_run_id
from ..spec import RunResult, host_error
from .connect import RESOURCE, NodeInfo, connect, import_ray, sandbox_nodes
from .node import NodeWorker
from .transfer import driver_record, import_record, lost_record

#: Seconds a node's worker has to start and reach its engine before the node is left out.
READY_TIMEOUT = 120.0
#: Seconds past a run's own time limit after which a node that has not answered counts as
#: lost (its sandbox stops at its own deadline, time limit + 10 s, whatever happens).
ANSWER_GRACE = 120.0
#: Seconds between looks for nodes that joined the cluster (or lost their worker).
REFRESH = 30.0
#: Seconds after a worker's loss before looking for its node again.
REVIVE_DELAY = 5.0
#: How often the driver checks a running attempt for a cancel.
POLL = 0.25


@dataclass
class _Node:
    info: NodeInfo
    actor: Any
    busy: int = 0
    alive: bool = True
    #: Attempts its pool was told to expect and that have not been reserved there yet.
    promised: int = 0
    #: How many the node says it runs at once now (None: as many as it declares).
    limit: int | None = None

    @property
    def capacity(self) -> int:
        return self.info.capacity

    @property
    def slots(self) -> int:
        """How many attempts the driver sends it at once: its own limit, under what it
        declares."""
        return self.capacity if self.limit is None else min(self.capacity, self.limit)


class RayExecutor(AttemptExecutor, Capacity):
    """Attempts on the nodes of the Ray cluster at `address` (None: $RAY_ADDRESS, else a
    cluster started on this machine). `pool_size`: each node's pool size for a batch (as
    `LocalExecutor`'s: None = that node's share of the concurrency when there are more
    attempts than that; 0: none; `warm`: its deprecated name); `adapt`: each node runs as
    many at once as its host carries, under what it declares (False: what it declares).
    Raises ConfigError (exit 2) at once when Ray is not installed; joins the cluster on
    first use."""

    def __init__(
        self,
        address: str | None = None,
        *,
        pool_size: int | None = None,
        adapt: bool = True,
        on_message: Progress | None = None,
        warm: int | None = None,
    ) -> None:
        import_ray()  # refused before anything starts when the extra is missing
        self.address = address
        self.pool_size = deprecated_pool_size(pool_size, warm, "RayExecutor")
        self.adapt = adapt
        self.message = on_message or (lambda _text: None)
        self._nodes: list[_Node] = []
        self._bound: dict[str, _Node] = {}
        self._cond = threading.Condition()
        self._started = False
        self._template: PreparedRun | None = None
        self._refreshing = False
        self._refreshed = 0.0
        #: Set by `close`: a refresh still waiting gives up rather than call Ray after the
        #: process has let go of it (Ray ends a process that does so with exit status 1).
        self._closing = threading.Event()
        self._refresher: threading.Thread | None = None

    # -- the cluster ------------------------------------------------------------------------

    def _ensure(self, template: PreparedRun) -> None:
        """One worker on each node that declares `orchestrator_sandboxes`, started once."""
        with self._cond:
            if self._started:
                return
            self._closing.clear()
            ray = connect(self.address)
            self._template = template
            ready, problems = self._start_workers(ray, _declaring(ray), template)
            for problem in problems:
                self.message(f"warning: left out {problem}")
            if not ready:
                raise EngineUnavailable(
                    "No node of the Ray cluster can run sandboxes: " + "; ".join(problems),
                    "Check that Docker answers on those nodes (`docker info` there) and that "
                    "orchestrator is installed there, then run again.",
                )
            self._nodes.extend(ready)
            self._started = True
            self._refreshed = time.monotonic()
        total = sum(n.capacity for n in ready)
        self.message(
            f"Ray cluster: {len(ready)} node(s) with {RESOURCE}, {total} sandbox(es) at once"
        )

    def _start_workers(
        self, ray: Any, infos: list[NodeInfo], template: PreparedRun
    ) -> tuple[list[_Node], list[str]]:
        """A worker on each of `infos` (pinned to it, holding its `orchestrator_sandboxes`,
        Ray's restarts and retries off); those whose worker reached its engine in time, and
        what went wrong on the others (their workers are killed)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        worker = ray.remote(NodeWorker)
        started = []
        for info in infos:
            actor = worker.options(
                num_cpus=0,
                resources={RESOURCE: info.capacity},
                scheduling_strategy=NodeAffinitySchedulingStrategy(info.node_id, soft=False),
                max_restarts=0,  # a dead worker's attempts are the batch's to retry
                max_task_retries=0,
                max_concurrency=2 * info.capacity + 8,
            ).remote(info.describe(), template.backend, self.pool_size)
            started.append(_Node(info, actor))
        hellos = {node.actor.hello.remote(): node for node in started}
        done, _ = ray.wait(list(hellos), num_returns=len(hellos), timeout=READY_TIMEOUT)
        ready, problems = [], []
        for ref, node in hellos.items():
            try:
                if ref not in done:
                    raise TimeoutError(
                        f"its worker did not start within {READY_TIMEOUT:g}s (does another "
                        f"batch hold its {RESOURCE}? each batch's worker holds them all)"
                    )
                ray.get(ref)
            except Exception as exc:  # no engine there, say: the node is left out
                problems.append(f"node {node.info.short()}: {_reason(exc)}")
                ray.kill(node.actor, no_restart=True)
                continue
            ready.append(node)
        return ready, problems

    def _refresh_soon(self, delay: float = 0.0) -> None:
        """In the background: a worker for each node that declares `orchestrator_sandboxes`
        and has none (a node that joined, or one whose worker died while the node lives on:
        Ray's restarts are off, this is ours). The new worker first removes what the dead
        one left there."""
        with self._cond:
            if self._refreshing or not self._started:
                return
            self._refreshing = True
            self._refreshed = time.monotonic()

        def refresh() -> None:
            try:
                if self._closing.wait(delay):  # a node just killed is listed alive a moment
                    return
                ray = import_ray()
                with self._cond:
                    have = {n.info.node_id for n in self._live()}
                    template = self._template
                missing = [i for i in sandbox_nodes(ray) if i.node_id not in have]
                if not missing or template is None:
                    return
                ready, _ = self._start_workers(ray, missing, template)
                for node in ready:
                    ray.get(node.actor.reap_orphans.remote(), timeout=READY_TIMEOUT)
                with self._cond:
                    if not self._started:  # closed meanwhile
                        for node in ready:
                            ray.kill(node.actor, no_restart=True)
                        return
                    self._nodes.extend(ready)
                    self._cond.notify_all()
                for node in ready:
                    self.message(f"node {node.info.short()}: a new worker takes attempts")
            except Exception as exc:  # the batch goes on with the nodes it has
                self.message(f"warning: looking for more nodes failed: {_reason(exc)}")
            finally:
                with self._cond:
                    self._refreshing = False
                    self._cond.notify_all()

        self._refresher = threading.Thread(target=refresh, name="ray-refresh", daemon=True)
        self._refresher.start()

    def _live(self) -> list[_Node]:
        return [n for n in self._nodes if n.alive]

    def _lose(self, node: _Node, reason: str) -> None:
        with self._cond:
            if not node.alive:
                return
            node.alive = False
            self._cond.notify_all()
        self.message(
            f"node {node.info.short()} lost ({reason}); its attempts end infra_error and the "
            "batch's rules retry them on the nodes left"
        )
        try:
            import_ray().kill(node.actor, no_restart=True)
        except Exception:  # gone already
            pass
        self._refresh_soon(delay=REVIVE_DELAY)  # its node may live on: a new worker there

    def _take_slot(self, cancel: threading.Event | None) -> _Node | None:
        """A node with room for one more attempt (waiting for one, and for a lost worker's
        replacement when no node is left); None when no node is left and none is coming, or
        `cancel` is set while waiting."""
        if time.monotonic() - self._refreshed > REFRESH:
            self._refresh_soon()  # nodes that joined since
        with self._cond:
            while True:
                live = self._live()
                free = [n for n in live if n.busy < n.slots]
                if free:
                    node = max(free, key=lambda n: n.slots - n.busy)
                    node.busy += 1
                    return node
                if cancel is not None and cancel.is_set():
                    return None
                if not live and not self._refreshing:  # none left, and none coming
                    return None
                self._cond.wait(POLL)

    def _free(self, node: _Node) -> None:
        with self._cond:
            node.busy -= 1
            self._cond.notify_all()

    def _limit(self, node: _Node, said: Any) -> None:
        """What the node says it runs at once now (`NodeWorker.open` and `run`); anything
        but a number from 1 to what it declares is ignored (the node's, not ours to trust)."""
        if isinstance(said, int) and not isinstance(said, bool) and 1 <= said <= node.capacity:
            with self._cond:
                node.limit = said
                self._cond.notify_all()

    def capacity(self) -> int:
        """How many sandboxes the cluster's nodes declare they run at once (joins it).
        Raises ConfigError (exit 2) when no cluster answers or no node declares any."""
        return sum(node.capacity for node in _declaring(connect(self.address)))

    # -- the seam ---------------------------------------------------------------------------

    def max_concurrency(self, template: PreparedRun) -> int | None:
        self._ensure(template)
        return sum(n.capacity for n in self._live()) or None

    def runs_per_core(self, template: PreparedRun) -> int | None:
        """None: the driver's cores are not where the runs are (each node starts its own
        limit from its own)."""
        return None

    def reap_orphans(self, template: PreparedRun, store: Store) -> int:
        self._ensure(template)
        ray = import_ray()
        refs = [n.actor.reap_orphans.remote() for n in self._live()]
        return sum(_get_all(ray, refs, default=0))

    def open(self, template: PreparedRun, *, attempts: int, concurrency: int) -> None:
        self._ensure(template)
        ray = import_ray()
        live = self._live()
        total = sum(n.capacity for n in live) or 1  # none left: `run` says so per attempt
        calls = {}
        for node in live:
            share = min(attempts, math.ceil(attempts * node.capacity / total))
            node.promised = share
            most, bare = min(node.capacity, concurrency), _without_secrets(template)
            calls[node.actor.open.remote(bare, share, most, self.adapt)] = node
        problems = []
        for ref, node in calls.items():
            try:
                self._limit(node, ray.get(ref))
            except Exception as exc:  # an image that cannot be had there, a dead node
                problems.append(f"node {node.info.short()}: {_reason(exc)}")
                self._lose(node, _reason(exc))
        for node in self._live():
            if node.slots < min(node.capacity, concurrency):  # its host's doing, not the cap's
                self.message(
                    f"node {node.info.short()}: {node.slots} at once to start with, of the "
                    f"{node.capacity} it declares (it adapts to its host as the batch runs)"
                )
        if not self._live():
            raise EngineUnavailable(
                "No node of the Ray cluster could get ready: " + "; ".join(problems),
                "Fix what the nodes report above, then run the same command again.",
            )

    def reserve(
        self, prepared: PreparedRun, *, number: int = 1, cancel: threading.Event | None = None
    ) -> Attempt:
        self._ensure(prepared)
        node = self._take_slot(cancel)
        if node is None:  # no node left (or stopping): `run` says so
            return super().reserve(prepared, number=number)
        ray = import_ray()
        bare = _without_secrets(prepared)
        with self._cond:
            more = node.promised <= 0
            node.promised = max(0, node.promised - 1)
        try:
            if more:  # past its share: its pool may make one more sandbox for it
                node.actor.expect.remote(bare, 1)
            run_id = ray.get(node.actor.reserve.remote(bare, number), timeout=READY_TIMEOUT)
        except Exception as exc:  # the node went away: the run says so, naming it
            if _is_node_loss(ray, exc):
                self._lose(node, _reason(exc))
            run_id = new_run_id()
        with self._cond:
            self._bound[run_id] = node
        return Attempt(replace(prepared, run_id=run_id), number)

    def release(self, attempt: Attempt) -> None:
        with self._cond:
            node = self._bound.pop(attempt.run_id, None)
        if node is None:
            return
        self._free(node)
        if node.alive:
            node.actor.release.remote(attempt.run_id)  # a no-op once it ran

    def run(self, attempt: Attempt, observers: RunObservers) -> RunResult:
        prepared = attempt.prepared
        self._ensure(prepared)
        store = observers.store or Store()
        started = time.time()
        with self._cond:
            node = self._bound.get(attempt.run_id)
        own = node is None
        if node is None:  # a firing's run, or no node was free at `reserve`
            node = self._take_slot(observers.cancel)
        if node is None:
            if observers.cancel.is_set():  # recorded like any attempt, with no node to name
                error = host_error("cancelled", "cancelled before a node took it")
                return driver_record(store, prepared, {}, error, started)
            message = f"no node of the Ray cluster with {RESOURCE} is left"
            return lost_record(store, prepared, {}, message, started)
        try:
            return self._run_on(node, attempt, observers, store, started)
        finally:
            if own:
                self._free(node)

    def _run_on(
        self,
        node: _Node,
        attempt: Attempt,
        observers: RunObservers,
        store: Store,
        started: float,
    ) -> RunResult:
        ray = import_ray()
        prepared = attempt.prepared
        where = node.info.describe()
        if not node.alive:
            return lost_record(
                store, prepared, where, f"node {node.info.short()} was lost", started
            )
        ref = node.actor.run.remote(_without_secrets(prepared), prepared.secrets, attempt.number)
        give_up = time.monotonic() + prepared.limits.timeout_seconds + ANSWER_GRACE
        cancelled = False
        while not ray.wait([ref], timeout=POLL)[0]:
            if observers.cancel.is_set() and not cancelled:
                node.actor.cancel.remote(prepared.run_id)
                cancelled = True
            if time.monotonic() > give_up:
                reason = "no answer within the run's time limit"
                self._lose(node, reason)
                return lost_record(
                    store, prepared, where, f"node {node.info.short()}: {reason}", started
                )
        try:
            packed = ray.get(ref)
        except Exception as exc:  # the node, its worker or the result object was lost
            reason = _reason(exc)
            if _is_node_loss(ray, exc):
                self._lose(node, reason)
            return lost_record(
                store, prepared, where, f"node {node.info.short()}: {reason}", started
            )
        result = import_record(store, packed, where)
        self._limit(node, packed.get("node_limit"))
        node.actor.forget.remote(prepared.run_id)
        _replay(packed, observers)
        return result

    def close(self) -> None:
        """End the nodes' workers; no thread of this executor calls Ray after it returns
        (a refresh under way is waited for, bounded)."""
        ray = import_ray()
        self._closing.set()
        with self._cond:
            nodes, self._nodes, self._started = self._nodes, [], False
            self._bound.clear()
            refresher = self._refresher
        if refresher is not None:
            refresher.join(timeout=READY_TIMEOUT)
        live = [n for n in nodes if n.alive]
        _get_all(ray, [n.actor.close.remote() for n in live], default=None)
        for node in live:
            try:
                ray.kill(node.actor, no_restart=True)
            except Exception:  # gone already
                pass


def _declaring(ray: Any) -> list[NodeInfo]:
    nodes = sandbox_nodes(ray)
    if not nodes:
        raise ConfigError(
            f"No node of the Ray cluster declares the resource {RESOURCE!r}.",
            "Start the nodes that run sandboxes with "
            f"`ray start ... --resources '{{\"{RESOURCE}\": 4}}'` (4 sandboxes at once there; "
            "each needs Docker and orchestrator installed).",
        )
    return nodes


def _without_secrets(prepared: PreparedRun) -> PreparedRun:
    """What may be pickled into Ray's object store: the run without its secret values."""
    return replace(prepared, secrets={})


def _replay(packed: dict[str, Any], observers: RunObservers) -> None:
    """The run's events, as recorded on its node, handed to the caller's watcher once the
    record is in (a remote run's events are not streamed live)."""
    if observers.on_event is None:
        return
    for line in packed["files"].get("events.jsonl", b"").splitlines():
        try:
            observers.on_event(json.loads(line))
        except ValueError:
            continue


def _get_all(ray: Any, refs: list[Any], *, default: Any) -> list[Any]:
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=READY_TIMEOUT))
        except Exception:  # a node gone: the rest still count
            out.append(default)
    return out


def _is_node_loss(ray: Any, exc: BaseException) -> bool:
    """The worker (or its node) is gone, as opposed to an error raised by our own code."""
    lost = (
        ray.exceptions.RayActorError,
        ray.exceptions.WorkerCrashedError,
        ray.exceptions.ObjectLostError,
        ray.exceptions.GetTimeoutError,
    )
    return isinstance(exc, lost) and not isinstance(exc, ray.exceptions.RayTaskError)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
