"""The life of one run, top to bottom.

prepare (manifest, model, secrets, network, limits: fail before anything starts)
  → image (build or reuse)  → sandbox (create, start, ship the request through stdin;
    an `allowlist` run's sandbox comes with its private network and egress proxy)
  → stream (events and logs, masked, written as they come; a lost egress proxy ends the run:
    supervise.py)
  → collect (exit, OOM, timeout, cancel → status; result recovered if the stream broke;
    what the egress proxy refused)
  → clean up (the sandbox, its proxy and network are removed whatever happens)
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from orchestrator_runtime.masking import Masker
from orchestrator_runtime.protocol import PRELOAD_TRACES, RESULT_PATH, model_client_module
from orchestrator_runtime.request import Request

from ..backends import backend_capabilities, backend_name, get_backend
from ..backends.base import Backend, Progress, Sandbox, SandboxSpec, endpoint_on_host
from ..defaults import choose_sandbox_runtime
from ..errors import ConfigError, ManifestError, RecordError, at_field
from ..gateway import (
    GatewaySpec,
    describe_gateway,
    plan_gateway,
    sandbox_network,
    sandbox_secrets,
)
from ..labels import owner_label, run_labels
from ..models import ModelSpec
from ..payloads.manifest import Manifest, load_manifest
from ..payloads.payload import ShippedFile, check_task
from ..payloads.program import choose_model, key_names
from ..payloads.secrets import needed_secrets, run_secrets
from ..policy import describe_allowlist, resolve_policy, sandbox_api_base
from ..records.otlp import TraceTarget, trace_target
from ..records.record import EventHandler, RunRecorder, finish
from ..records.store import Store, new_run_id
from ..records.traces import RunContext, record_trace, trace_request
from ..registry import DEFAULT_BACKEND
from ..spec import PAYLOAD_ERROR, SETTABLE_LIMITS, Limits, NetworkPolicy, RunResult, RunSpec
from .imagecache import ImageCache
from .interrupts import stop_on_interrupt
from .outcome import cancelled_error, decide_status, explain_network
from .supervise import record_egress_blocked, record_gateway, supervise

RUNTIME_COMMAND = ("python", "-m", "orchestrator_runtime")


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
    """A sandbox made before its run (`Backend.create_idle`, by a pool) for the run `run_id`
    only: `execute` takes it (`Sandbox.take`) instead of creating one, and the record says
    `warm` and how long the run `waited` for it. What the backend made beside it (network,
    egress proxy, model gateway) is left to its pool to remove, in the background."""

    run_id: str
    sandbox: Sandbox
    waited: float = 0.0


@dataclass(frozen=True)
class PreparedRun:
    """A run whose inputs are all checked; nothing has been started yet."""

    run_id: str
    spec: RunSpec
    manifest: Manifest
    model: ModelSpec
    task: str
    limits: Limits
    network: NetworkPolicy
    secrets: dict[str, str]
    backend: str = DEFAULT_BACKEND
    #: The names of the secrets the run gets (the payload's and the model's credential).
    secret_names: tuple[str, ...] = ()
    #: The payload folder's files as they will be shipped (read and checked by `prepare`).
    files: dict[str, ShippedFile] = field(default_factory=dict)
    #: The run's model gateway (None: no gateway, and `gateway_off` says why).
    gateway: GatewaySpec | None = None
    gateway_off: str | None = None
    #: The sandbox runtime asked for: the run's, else the payload's, else auto.
    sandbox_runtime: str = "auto"
    trace: TraceTarget | None = None  # where its trace goes (None: tracing is off)
    model_source: str = "run"  # "run": `model` replaces the agents' models; "program": theirs

    @property
    def sandbox_network(self) -> NetworkPolicy:
        """What the sandbox itself may reach (with a gateway, not the model's endpoint)."""
        hosts = (*self.manifest.hosts, *self.spec.allow_hosts)
        return sandbox_network(self.network, self.gateway, hosts)

    @property
    def allowlist(self) -> list[str]:
        """The effective allowlist as the record shows it."""
        items = describe_allowlist(self.sandbox_network)
        return items + ([describe_gateway(self.gateway)] if self.gateway else [])

    @property
    def max_steps_from(self) -> str:
        """Who sets the run's `max_steps` (`RunSpec.max_steps_from`)."""
        return self.spec.max_steps_from(self.manifest.limits_set)

    @property
    def image_requirements(self) -> tuple[str, ...]:
        """What the image must hold beyond the agent image: the payload's requirements and
        the model provider's client (litellm)."""
        return self.manifest.requirements + self.model.extra_requirements


def prepare(
    spec: RunSpec, *, secret_values: bool = True, limits_from: str = "command line"
) -> PreparedRun:
    """Check everything that can be checked before a sandbox exists; raise on any problem.

    Raises ManifestError or ConfigError (nothing has started), with `field` naming the
    RunSpec field at fault. With `secret_values=False` (schedule validation) the secrets'
    values are not read: the result's `secrets` is empty, `secret_names` still complete.
    `limits_from` says where the spec's limits came from, for the error message.
    """
    with at_field("payload"):
        manifest = load_manifest(spec.payload, allowed_requirements=spec.allowed_requirements)
        dangerous = manifest.dangerous_imports()
        if dangerous and not spec.allow_dangerous_imports:
            raise ManifestError(
                f"{manifest.path}: field `python.authorized_imports` lists "
                f"{', '.join(dangerous)}, which would let agent-written code escape the inner "
                "executor's import allowlist.",
                "Remove them, or accept the risk by name with --i-understand-dangerous-imports "
                "(the container stays the boundary).",
            )
        files = manifest.payload_files()  # refuses links out, devices, FIFOs; limits
    with at_field("model"):
        model, own_model = choose_model(spec, manifest)
    task = spec.task if spec.task is not None else manifest.example_task
    if manifest.program is not None:  # a program's own tasks stand unless the run gives one
        task = spec.task or ""
    elif not task:
        error = ConfigError(
            f"No task given, and {manifest.path} has no `payload.example_task`.",
            'Pass the task as an argument (orchestrator run PAYLOAD "your task").',
        )
        error.field = "task"
        raise error
    with at_field("task"):
        check_task(task)
    with at_field("limits"):
        overrides = {k: getattr(spec, k) for k in SETTABLE_LIMITS if getattr(spec, k) is not None}
        limits = replace(manifest.limits, **overrides)
        limits.validate(limits_from)
    with at_field("backend"):
        backend = backend_name(spec.backend, manifest)
        capabilities = backend_capabilities(backend)
    with at_field("model"):  # an endpoint the backend's sandboxes cannot reach: refused here
        host_alias = endpoint_on_host(capabilities, model, backend)
    with at_field("network"):
        network = resolve_policy(spec.network, model=model, hosts=manifest.hosts,
                                 allow_hosts=spec.allow_hosts, host_alias=host_alias)  # fmt: skip
    with at_field("model"):
        gateway, gateway_off = plan_gateway(
            enabled=spec.gateway, model=model, network=network, backend=backend,
            provision=capabilities.model_gateway, limits=limits,
        )  # fmt: skip
    with at_field("sandbox_runtime"):
        sandbox_runtime = choose_sandbox_runtime(spec.sandbox_runtime, manifest.sandbox_runtime)
    with at_field("traces_to"):
        trace = None if spec.check_only else trace_target(spec.traces_to)
    needed = needed_secrets(manifest, own_model or model)
    with at_field("secrets"):
        secrets = run_secrets(
            needed, check_only=spec.check_only, values=secret_values, env_file=spec.env_file,
            placeholders=key_names(manifest.model_uses) if own_model is None or spec.check_only
            else (),
        )  # fmt: skip
    return PreparedRun(
        backend=backend,
        secret_names=tuple(needed),
        files=files,
        run_id=spec.run_id or new_run_id(),
        spec=spec,
        manifest=manifest,
        model=model,
        task=task,
        limits=limits,
        network=network,
        secrets=secrets,
        gateway=gateway,
        gateway_off=gateway_off,
        sandbox_runtime=sandbox_runtime,
        trace=trace,
        model_source="program" if manifest.program is not None and own_model else "run",
    )


class _Stopped(Exception):
    """The run's `cancel` event was set; raised only at safe points of `execute` (and from
    its progress callback, which backends call where stopping leaves nothing half-made), so
    a signal never lands between creating a container and holding on to it."""


def run(
    spec: RunSpec,
    *,
    on_event: EventHandler | None = None,
    on_progress: Callable[[str], None] | None = None,
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
    prepared = prepare(spec)
    backend = backend or get_backend(prepared.backend, env_file=spec.env_file)
    observers = observers_of(on_event, on_progress, cancel, store)
    with stop_on_interrupt(observers.cancel):  # Ctrl-C: stops at a safe point, then raised
        return execute(prepared, backend=backend, observers=observers)


def observers_of(
    on_event: EventHandler | None = None,
    on_progress: Callable[[str], None] | None = None,
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
    warm: WarmSandbox | None = None,
) -> RunResult:
    """Run a prepared run in a sandbox of `backend`, recording it in `observers.store`; the
    sandbox is removed when this returns. `images`: where the image is taken from once
    prepared (else the backend prepares it for this run). `warm`: the run's sandbox, made
    in advance (its id must be the run's; its helpers are left to its pool). Raises
    RecordError when the record cannot be created, ConfigError when the backend cannot give
    the sandbox runtime asked for (nothing was started in either case), ValueError for a
    warm sandbox of another run."""
    if warm is not None and warm.run_id != prepared.run_id:
        raise ValueError(f"run {prepared.run_id} cannot use the sandbox of {warm.run_id}")
    observers = observers or RunObservers()
    store = observers.store or Store()
    cancel = observers.cancel
    user_progress = observers.on_progress

    record: RunRecorder | None = None

    def checkpoint() -> None:
        """A safe point to stop at: nothing is half-made here (see `_Stopped`); the user's
        cancel, or `orchestrator runs stop` for this run."""
        if cancel.is_set() or (record is not None and record.stop_requested()):
            raise _Stopped

    def progress(message: str) -> None:  # long image builds stop at their next line
        checkpoint()
        user_progress(message)

    masker = Masker(prepared.secrets.values())
    run_id = prepared.run_id
    with at_field("sandbox_runtime"):  # nothing has started yet
        backend.check_runtime(prepared.sandbox_runtime, asked=bool(prepared.spec.sandbox_runtime))
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
        record = RunRecorder(record_dir, masker, observers.on_event)
    except (OSError, sqlite3.Error) as exc:
        raise RecordError(
            f"Cannot create the record of run {run_id} under {store.root}: {exc}.",
            "Free space (or fix permissions) in the state directory ($ORCHESTRATOR_HOME); "
            "nothing was started.",
        ) from exc
    result = RunResult(
        run_id=run_id,
        status="infra_error",
        record_dir=str(record_dir),
        payload=prepared.manifest.name,
        model=prepared.model.describe(),
        backend=backend.name,
        network=prepared.network.mode,
        allowlist=prepared.allowlist,
        limits=prepared.limits.recorded(prepared.max_steps_from),
        gateway=prepared.gateway.describe()
        if prepared.gateway
        else {"enabled": False, "reason": prepared.gateway_off},
    )
    timings: dict[str, float] = {"created": time.time()}
    sandbox: Sandbox | None = None
    interrupted: BaseException | None = None
    try:
        checkpoint()
        t0 = time.monotonic()
        needs = prepared.image_requirements
        if images is not None:
            result.image = images.prepare(backend, needs, progress)
        else:
            result.image = backend.prepare_image(needs, progress)
        timings["image_seconds"] = round(time.monotonic() - t0, 3)
        checkpoint()
        store.update_run(run_id, status="starting")
        if warm is None:
            sandbox = backend.create(sandbox_spec(prepared, result.image), progress)
        else:
            warm.sandbox.take(sandbox_spec(prepared, result.image))
            sandbox = warm.sandbox
            result.warm = True
            timings["sandbox_wait"] = warm.waited
        result.sandbox = dict(sandbox.isolation)
        record.host_event(
            "sandbox_created",
            backend=backend.name,
            sandbox_id=sandbox.id,
            warm=result.warm,
            network=prepared.network.mode,
            allowlist=result.allowlist,
            gateway=prepared.gateway is not None,
            isolation=result.sandbox,
        )
        timings["started"] = time.time()
        # The limit counts from here, before the start (which may wait for the egress proxy):
        # the containers' own deadline (created just before) comes a grace period later.
        deadline = time.monotonic() + prepared.limits.timeout_seconds
        checkpoint()
        secrets, model_key = sandbox_secrets(prepared.secrets, prepared.gateway)
        if sandbox.gateway is not None:
            sandbox.gateway.open(model_key)
        elif prepared.gateway is not None:
            raise RuntimeError(f"the {backend.name} backend made no model gateway for the run")
        api_base = sandbox.gateway.api_base if sandbox.gateway is not None else None
        request = build_request(prepared, api_base=api_base)
        sandbox.start(request, secrets)
        store.update_run(run_id, status="running")
        outcome = supervise(sandbox, record, deadline, prepared.limits.timeout_seconds, cancel)
        exit_info = sandbox.wait(timeout=30)
        if record.run_end is None and outcome != "cancelled":
            record.recover(sandbox.recover_stdout())
        result.status, result.error = decide_status(
            outcome, exit_info, record.run_end, record.violations, reason=record.stop_reason,
            cancel=cancel,
        )  # fmt: skip
        result.exit_code = exit_info.exit_code
        result.oom_killed = exit_info.oom_killed
    except (_Stopped, KeyboardInterrupt) as exc:
        if not isinstance(exc, _Stopped):
            interrupted = exc  # the caller's own interrupt: re-raised once all is cleaned up
        if sandbox is not None:
            sandbox.kill()
        result.status = "cancelled"
        result.error = cancelled_error(cancel)
    except ManifestError as exc:  # the payload asks for what cannot be had (a requirement)
        result.status = "failed"
        message = f"{prepared.manifest.path}: {exc.cause} {exc.fix}"
        result.error = {"type": PAYLOAD_ERROR, "message": message, "problems": [message],
                        "field": exc.field}  # fmt: skip
    except Exception as exc:  # engine errors, image build failures, vanished sandboxes
        result.status = "infra_error"
        result.error = {"type": type(exc).__name__, "message": masker(str(exc))}
    finally:
        if sandbox is not None:
            record_egress_blocked(sandbox, record)
            record_gateway(sandbox, record, close=True)
            try:
                if warm is not None:  # its pool removes the helpers in the background
                    sandbox.remove_sandbox_only()
                else:
                    sandbox.remove()
            except Exception as exc:  # never mask the run's own outcome
                record.host_event("cleanup_failed", error=str(exc))
        timings["ended"] = time.time()
        timings["duration"] = round(
            timings["ended"] - timings.get("started", timings["created"]), 3
        )
        result.timings = timings
        if result.status == "infra_error":
            result.error = explain_network(prepared.network, prepared.model, result.error)
        if prepared.manifest.program is not None:
            result.output = record.log_tail()
        if prepared.trace is not None:  # never fails: what was not exported is recorded
            context = RunContext.of(prepared.spec, prepared.task)
            result.traces = record_trace(result, record, context, prepared.trace)
        finish(result, record, store)
    if interrupted is not None:
        raise interrupted
    return result


def sandbox_spec(prepared: PreparedRun, image: str) -> SandboxSpec:
    return SandboxSpec(
        run_id=prepared.run_id,
        image=image,
        command=runtime_command(prepared),
        limits=prepared.limits,
        network=prepared.sandbox_network,
        labels=run_labels(prepared.run_id),
        gateway=prepared.gateway,
        runtime=prepared.sandbox_runtime,
    )


def runtime_command(prepared: PreparedRun) -> tuple[str, ...]:
    """The runtime's command line: it imports the model's client library ahead when there
    is one (a pooled sandbox does so while it idles; pools are keyed by command)."""
    has_api_base = prepared.model.api_base is not None or prepared.gateway is not None
    client = model_client_module(prepared.model.provider, has_api_base=has_api_base)
    preloads = [client] if client else []
    preloads += [PRELOAD_TRACES] if prepared.trace is not None else []
    return (*RUNTIME_COMMAND, *(arg for name in preloads for arg in ("--preload", name)))


def program_argv(prepared: PreparedRun) -> list[str]:
    """A program's arguments; one given a task and no arguments finds the task there too."""
    if prepared.manifest.program is None:
        return []
    return list(prepared.spec.program_args or ((prepared.task,) if prepared.task else ()))


def build_request(prepared: PreparedRun, *, api_base: str | None = None) -> Request:
    """What the runtime is asked to do (docs/PROTOCOL.md), without the secrets: the backend
    adds those its own way (`Sandbox.start`) and ships the request. `api_base`: the run's
    model gateway, which then stands in for the model's endpoint."""
    manifest, model = prepared.manifest, prepared.model
    return Request(
        run_id=prepared.run_id,
        task=prepared.task,
        additional_args=prepared.spec.additional_args,
        payload_name=manifest.name,
        entrypoint=manifest.entrypoint,
        program=manifest.program,
        argv=program_argv(prepared),
        requires_python=manifest.requires_python,
        files=prepared.files,
        authorized_imports=list(manifest.authorized_imports),
        allow_dangerous_imports=prepared.spec.allow_dangerous_imports,
        max_steps=prepared.limits.max_steps,
        max_steps_from=prepared.max_steps_from,
        network=prepared.network.mode,
        provider=model.provider,
        model_id=model.model_id,
        api_base=api_base or sandbox_api_base(model.api_base, prepared.network),
        credential_env=model.credential_env,
        options=dict(model.options),
        model_source=prepared.model_source,
        mock_scripts=manifest.mock_scripts if model.provider == "mock" else {},
        result_path=RESULT_PATH,
        check_only=prepared.spec.check_only,
        trace=trace_request(prepared.run_id, prepared.trace),
    )
