"""The life of one run, top to bottom.

prepare (manifest, model, secrets, network, limits: fail before anything starts; prepared.py)
  → image (build or reuse)  → sandbox (create or take a warm one, start, ship the request
    through stdin: request.py; an `allowlist` run's sandbox comes with its private network
    and egress proxy)
  → supervise (events and logs, masked, written as they come; a lost egress proxy ends the
    run: supervise.py)
  → decide (exit, OOM, timeout, cancel → status; result recovered if the stream broke;
    outcome.py)
  → clean up (the sandbox, its proxy and network are removed whatever happens)
  → finish (what the egress proxy refused, the trace, result.json and the index row)
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from orchestrator_runtime.masking import Masker

from ..backends import get_backend
from ..backends.base import Backend, ExitInfo, Progress, Sandbox
from ..errors import ManifestError, RecordError, at_field
from ..gateway import sandbox_secrets
from ..labels import owner_label
from ..payloads.binding import BoundSecret, bind_secrets
from ..records.record import EventHandler, RunRecorder
from ..records.store import Store
from ..records.traces import RunContext, record_trace
from ..spec import RunResult, RunSpec
from . import outcome
from .imagecache import ImageCache
from .interrupts import stop_on_interrupt
from .outcome import Outcome
from .prepared import PreparedRun, prepare
from .request import RUNTIME_COMMAND, build_request, program_argv, runtime_command, sandbox_spec
from .supervise import record_egress_blocked, record_gateway, record_injections, supervise

#: What callers import from here; a run's checks and its request live in prepared.py and
#: request.py, re-exported so `runner` stays the one door to a run's life.
__all__ = [
    "RUNTIME_COMMAND",
    "PreparedRun",
    "Executes",
    "RunObservers",
    "WarmSandbox",
    "build_request",
    "execute",
    "observers_of",
    "prepare",
    "program_argv",
    "run",
    "run_spec",
    "runtime_command",
    "sandbox_spec",
]


def _quiet(_message: str) -> None:
    """No progress wanted."""


@dataclass(frozen=True)
class RunObservers:
    """Who watches a run and who may stop it, passed whole from the caller (the CLI, a
    batch, a firing) through pools and executors to `execute`.

    `store`: where the run is recorded (None: the default store); `on_event`: each event as
    it is recorded (masked); `on_progress`: what the host is doing before the run starts
    (image build, sandbox start); `cancel`: set it to stop the run (it is recorded
    `cancelled`, its sandbox removed).
    """

    store: Store | None = None
    on_event: EventHandler | None = None
    on_progress: Progress = _quiet
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class WarmSandbox:
    """A sandbox made before its run (`WarmSandboxes.create_idle`, by a pool) for the run `run_id`
    only: `execute` takes it (`Sandbox.take`) instead of creating one, and the record says
    `warm` and how long the run `waited` for it. What the backend made beside it (network,
    egress proxy, model gateway) is left to its pool to remove, in the background."""

    run_id: str
    sandbox: Sandbox
    waited: float = 0.0


class _Stopped(Exception):
    """The run's `cancel` event was set; raised only at safe points of `execute` (and from
    its progress callback, which backends call where stopping leaves nothing half-made), so
    a signal never lands between creating a container and holding on to it."""


def run(
    spec: RunSpec,
    *,
    on_event: EventHandler | None = None,
    on_progress: Progress | None = None,
    cancel: threading.Event | None = None,
    store: Store | None = None,
    backend: Backend | None = None,
) -> RunResult:
    """Run one payload in one fresh sandbox and return its record.

    Raises `OrchestratorError` for bad input before anything starts. Once the run exists,
    every outcome is recorded with a status; Ctrl-C (SIGINT, in the main thread) sets
    `cancel`, so the run stops at a safe point and is recorded `cancelled`, and then raises
    KeyboardInterrupt (`interrupts.py`).
    """
    observers = observers_of(on_event, on_progress, cancel, store)
    return run_spec(spec, observers, backend=backend)


#: Where a prepared run is run: `execute` in a sandbox of a backend (`run_spec`'s default),
#: or a pool's `execute` (a warm sandbox when it has one).
Executes = Callable[[PreparedRun, RunObservers], RunResult]


def run_spec(
    spec: RunSpec,
    observers: RunObservers,
    *,
    backend: Backend | None = None,
    executes: Executes | None = None,
    on_prepared: Callable[[PreparedRun], None] | None = None,
) -> RunResult:
    """The one way to run one spec, for `run`, `Pool.run` and `orchestrator run`: prepared
    (raises `OrchestratorError` for bad input before anything starts; `on_prepared` then
    sees it), then run by `executes` (default: `execute` in a sandbox of `backend`, else of
    the backend the run names). Ctrl-C under Python's default handler sets
    `observers.cancel` and is raised once the run is recorded (`interrupts.py`); a handler of
    the caller's own (the CLI's) is left alone."""
    prepared = prepare(spec)
    if on_prepared is not None:
        on_prepared(prepared)
    if executes is None:
        chosen = backend or get_backend(prepared.backend, env_file=spec.env_file)

        def executes(prepared: PreparedRun, observers: RunObservers) -> RunResult:
            return execute(prepared, backend=chosen, observers=observers)

    with stop_on_interrupt(observers.cancel):  # Ctrl-C: stops at a safe point, then raised
        return executes(prepared, observers)


def observers_of(
    on_event: EventHandler | None = None,
    on_progress: Progress | None = None,
    cancel: threading.Event | None = None,
    store: Store | None = None,
) -> RunObservers:
    """`RunObservers` from the keyword arguments of the public API (`run`, `Pool.run`)."""
    return RunObservers(
        store=store,
        on_event=on_event,
        on_progress=on_progress or _quiet,
        cancel=cancel or threading.Event(),
    )


def execute(
    prepared: PreparedRun,
    *,
    backend: Backend,
    observers: RunObservers | None = None,
    images: ImageCache | None = None,
    warm_sandbox: WarmSandbox | None = None,
) -> RunResult:
    """Run a prepared run in a sandbox of `backend`, recording it in `observers.store`; the
    sandbox is removed when this returns. `images`: where the image is taken from once
    prepared (else the backend prepares it for this run). `warm_sandbox`: the run's sandbox, made
    in advance (its id must be the run's; its helpers are left to its pool). Raises
    RecordError when the record cannot be created, ConfigError when the backend cannot give
    the sandbox runtime asked for (nothing was started in either case), ValueError for a
    warm sandbox of another run."""
    if warm_sandbox is not None and warm_sandbox.run_id != prepared.run_id:
        raise ValueError(f"run {prepared.run_id} cannot use the sandbox of {warm_sandbox.run_id}")
    observers = observers or RunObservers()
    store = observers.store or Store()
    masker = Masker(prepared.secrets.values())
    with at_field("sandbox_runtime"):  # nothing has started yet
        backend.check_runtime(prepared.sandbox_runtime, asked=bool(prepared.spec.sandbox_runtime))
    record = open_record(prepared, backend, store, masker, observers.on_event)
    return _Execution(prepared, backend, observers, store, record, images, warm_sandbox).run()


def open_record(
    prepared: PreparedRun,
    backend: Backend,
    store: Store,
    masker: Masker,
    on_event: EventHandler | None,
) -> RunRecorder:
    """The run's record and index row (status `preparing`), before anything is started.
    Raises RecordError when the state directory cannot hold it."""
    run_id = prepared.run_id
    try:
        record_dir = store.create_run(
            run_id,
            status="preparing",
            payload=prepared.manifest.name,
            model=prepared.model.describe(),
            backend=backend.name,
            network=prepared.network.mode,
            task=masker(prepared.task),
            schedule=prepared.spec.schedule,
            batch=prepared.spec.batch,
            owner=owner_label(),
            kind="check" if prepared.spec.check_only else "run",
        )
        return RunRecorder(record_dir, masker, on_event)
    except (OSError, sqlite3.Error) as exc:
        raise RecordError(
            f"Cannot create the record of run {run_id} under {store.root}: {exc}.",
            "Free space (or fix permissions) in the state directory ($ORCHESTRATOR_HOME); "
            "nothing was started.",
        ) from exc


class _Execution:
    """One recorded run, phase by phase (`run` tells them in order): what the phases share
    is the record, the result being decided, the sandbox once made and the timings."""

    def __init__(
        self,
        prepared: PreparedRun,
        backend: Backend,
        observers: RunObservers,
        store: Store,
        record: RunRecorder,
        images: ImageCache | None,
        warm_sandbox: WarmSandbox | None,
    ) -> None:
        self.prepared = prepared
        self.backend = backend
        self.observers = observers
        self.cancel = observers.cancel
        self.store = store
        self.record = record
        self.images = images
        self.warm_sandbox = warm_sandbox
        self.masker = record.masker
        self.result = outcome.undecided(prepared, backend.name, record.directory)
        self.timings: dict[str, float] = {"created": time.time()}
        self.sandbox: Sandbox | None = None

    def run(self) -> RunResult:
        """The phases in order; every outcome recorded, the sandbox removed whatever happened,
        and the caller's own interrupt (KeyboardInterrupt) raised once all is cleaned up."""
        interrupted: BaseException | None = None
        try:
            self.prepare_image()
            sandbox = self.make_sandbox()
            deadline = self.start(sandbox)
            self.decide(*self.watch(sandbox, deadline))
        except (_Stopped, KeyboardInterrupt) as exc:
            if not isinstance(exc, _Stopped):
                interrupted = exc  # the caller's own interrupt: re-raised once all is cleaned up
            self.stopped()
        except ManifestError as exc:  # the payload asks for what cannot be had (a requirement)
            message = f"{self.prepared.manifest.path}: {exc.cause} {exc.fix}"
            outcome.failed_on_host(self.result, exc, message)
        except Exception as exc:  # engine errors, image build failures, vanished sandboxes
            outcome.failed_on_host(self.result, exc, self.masker(str(exc)))
        finally:
            self.clean_up()
            self.finish()
        if interrupted is not None:
            raise interrupted
        return self.result

    def checkpoint(self) -> None:
        """A safe point to stop at: nothing is half-made here (see `_Stopped`); the user's
        cancel, or `orchestrator runs stop` for this run. Raises _Stopped."""
        if self.cancel.is_set() or self.record.stop_requested():
            raise _Stopped

    def progress(self, message: str) -> None:
        """The backend's progress to the caller; long image builds stop at their next line."""
        self.checkpoint()
        self.observers.on_progress(message)

    def prepare_image(self) -> None:
        """The run's image: from the caller's cache, else prepared by the backend."""
        self.checkpoint()
        t0 = time.monotonic()
        needs = self.prepared.image_requirements
        if self.images is not None:
            self.result.image = self.images.prepare(self.backend, needs, self.progress)
        else:
            self.result.image = self.backend.prepare_image(needs, self.progress)
        self.timings["image_seconds"] = round(time.monotonic() - t0, 3)

    def make_sandbox(self) -> Sandbox:
        """The run's sandbox, created or (warm) taken, recorded as `sandbox_created`."""
        self.checkpoint()
        prepared, result = self.prepared, self.result
        self.store.update_run(prepared.run_id, status="starting")
        if self.warm_sandbox is None:
            spec = sandbox_spec(prepared, result.image)
            self.sandbox = sandbox = self.backend.create(spec, self.progress)
        else:
            self.warm_sandbox.sandbox.take(sandbox_spec(prepared, result.image))
            self.sandbox = sandbox = self.warm_sandbox.sandbox
            result.warm = True
            self.timings["sandbox_wait"] = self.warm_sandbox.waited
        result.sandbox = dict(sandbox.isolation)
        self.record.host_event(
            "sandbox_created",
            backend=self.backend.name,
            sandbox_id=sandbox.id,
            warm=result.warm,
            network=prepared.network.mode,
            allowlist=result.allowlist,
            gateway=prepared.gateway is not None,
            isolation=result.sandbox,
            secrets_inside=list(prepared.secrets_inside),
            secrets_bound=[b.describe() for b in prepared.bindings],
            passthrough=list(prepared.manifest.passthrough),
        )
        return sandbox

    def start(self, sandbox: Sandbox) -> float:
        """Start the runtime with its request and secrets (the model's key goes to the
        gateway only, a bound secret's value to the interceptor only: the sandbox holds its
        placeholder and trusts the interceptor's CA); returns the run's deadline. Raises
        RuntimeError when the backend made no gateway or interceptor for a run that has one."""
        prepared = self.prepared
        self.timings["started"] = time.time()
        # The limit counts from here, before the start (which may wait for the egress proxy):
        # the containers' own deadline (created just before) comes a grace period later.
        deadline = time.monotonic() + prepared.limits.timeout_seconds
        self.checkpoint()
        secrets, model_key = sandbox_secrets(prepared.secrets, prepared.gateway)
        bound: tuple[BoundSecret, ...] = ()
        if not prepared.spec.check_only:  # a check's secrets are placeholders already
            secrets, bound = bind_secrets(secrets, prepared.manifest.bindings)
        if sandbox.gateway is not None:
            sandbox.gateway.open(model_key)
        elif prepared.gateway is not None:
            raise RuntimeError(f"the {self.backend.name} backend made no model gateway for the run")
        trust_ca = ""
        if prepared.bindings:  # the values to the interceptor, its CA to the sandbox
            if sandbox.secrets_proxy is None:
                raise RuntimeError(
                    f"the {self.backend.name} backend made no secret interceptor for the run"
                )
            trust_ca = sandbox.secrets_proxy.open(bound, prepared.manifest.passthrough)
        api_base = sandbox.gateway.api_base if sandbox.gateway is not None else None
        request = build_request(prepared, api_base=api_base, trust_ca=trust_ca)
        sandbox.start(request, secrets)
        self.store.update_run(prepared.run_id, status="running")
        return deadline

    def watch(self, sandbox: Sandbox, deadline: float) -> tuple[Outcome, ExitInfo]:
        """Watch the run to its end (supervise.py), then wait for the sandbox's exit and
        recover the result from its stdout when the event stream broke."""
        timeout = self.prepared.limits.timeout_seconds
        ended = supervise(sandbox, self.record, deadline, timeout, self.cancel)
        exit_info = sandbox.wait(timeout=30)
        if self.record.run_end is None and ended.kind != "cancelled":
            self.record.recover(sandbox.recover_stdout())
        return ended, exit_info

    def decide(self, ended: Outcome, exit_info: ExitInfo) -> None:
        """The run's status and error from what the host saw (outcome.py), and its exit."""
        outcome.decide(self.result, ended, exit_info, self.record, self.cancel)

    def stopped(self) -> None:
        """Cancelled (the caller's cancel, a stop request, Ctrl-C): the sandbox is killed."""
        if self.sandbox is not None:
            self.sandbox.kill()
        outcome.stopped(self.result, self.cancel)

    def clean_up(self) -> None:
        """What the egress proxy and the secret interceptor refused, the gateway's last
        reports and where bound secrets were injected recorded, then the sandbox removed (a
        warm one's helpers by its pool); a failed removal is only noted."""
        sandbox = self.sandbox
        if sandbox is None:
            return
        record_egress_blocked(sandbox, self.record)
        record_gateway(sandbox, self.record, close=True)
        record_injections(sandbox, self.record)
        try:
            if self.warm_sandbox is not None:  # its pool removes the helpers in the background
                sandbox.remove_sandbox_only()
            else:
                sandbox.remove()
        except Exception as exc:  # never mask the run's own outcome
            self.record.host_event("cleanup_failed", error=str(exc))

    def finish(self) -> None:
        """The timings, a program's output and the trace into the result, the rest of it from
        the record (outcome.py), then result.json and the index row written (record.py)."""
        prepared, result, timings, record = self.prepared, self.result, self.timings, self.record
        timings["ended"] = time.time()
        timings["duration"] = round(
            timings["ended"] - timings.get("started", timings["created"]), 3
        )
        result.timings = timings
        outcome.explain(result, prepared.network, prepared.model)
        if prepared.manifest.program is not None:
            result.output = record.log_tail()
        if prepared.trace is not None:  # never fails: what was not exported is recorded
            context = RunContext.of(prepared.spec, prepared.task)
            result.traces = record_trace(result, record, context, prepared.trace)
        outcome.settle(result, record, self.store)
