"""The life of one run, top to bottom.

prepare (manifest, model, secrets, network, limits: fail before anything starts)
  → image (build or reuse)  → sandbox (create, start, ship the request through stdin;
    an `allowlist` run's sandbox comes with its private network and egress proxy)
  → stream (events and logs, masked, written as they come; a lost egress proxy ends the run)
  → collect (exit, OOM, timeout, cancel → status; result recovered if the stream broke;
    what the egress proxy refused)
  → clean up (the sandbox, its proxy and network are removed whatever happens)
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from .backends.base import Backend, ExitInfo, NetworkPolicy, Sandbox, SandboxSpec
from .config import LABEL_OWNER, LABEL_RUN_ID, LABEL_STORE, LABEL_VERSION, VERSION
from .egress import describe_allowlist, resolve_policy, sandbox_api_base
from .errors import ConfigError, ManifestError
from .manifest import BACKENDS, Limits, Manifest, load_manifest
from .models import ModelSpec, parse_model
from .secrets import Redactor, resolve_secrets
from .store import Store, new_run_id

RUNTIME_COMMAND = ("python", "-m", "orchestrator_runtime")
RESULT_PATH = "/tmp/orchestrator-result.json"
#: Collected logs are capped; the rest is dropped with a note (nothing is unbounded).
MAX_LOG_BYTES = 20 * 1024 * 1024
#: How often the host checks that a running sandbox still has its egress proxy.
HEALTH_INTERVAL = 1.0

STATUSES = ("succeeded", "failed", "timed_out", "oom_killed", "infra_error", "cancelled")
#: Exit codes the CLI returns per status, for cron jobs and shell scripts to branch on.
EXIT_CODES = {
    "succeeded": 0, "failed": 1, "timed_out": 3, "oom_killed": 4, "infra_error": 5,
    "cancelled": 130,
}  # fmt: skip

EventHandler = Callable[[dict[str, Any]], None]


@dataclass
class RunSpec:
    """What to run: a payload, a task, a model and a policy. Unset limits come from the
    payload's manifest, then from the defaults in `Limits`."""

    payload: str | Path
    task: str | None = None
    model: str = "mock"
    api_base: str | None = None
    model_key_env: str | None = None
    model_options: dict[str, Any] = field(default_factory=dict)
    additional_args: dict[str, Any] | None = None
    #: `docker` or `e2b`; None: the manifest's `payload.backend`, else docker.
    backend: str | None = None
    network: str | None = None
    allow_hosts: tuple[str, ...] = ()
    max_steps: int | None = None
    timeout_seconds: float | None = None
    memory_mb: int | None = None
    cpus: float | None = None
    pids: int | None = None
    env_file: str | Path | None = None
    allow_dangerous_imports: bool = False
    schedule: str | None = None
    batch: str | None = None
    run_id: str | None = None


@dataclass
class RunResult:
    run_id: str
    status: str
    answer: Any = None
    error: dict[str, Any] | None = None
    exit_code: int | None = None
    oom_killed: bool = False
    token_usage: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    record_dir: str = ""
    payload: str = ""
    model: str = ""
    backend: str = ""
    network: str = ""
    #: The effective allowlist of an `allowlist` run (hosts, host:port endpoints).
    allowlist: list[str] = field(default_factory=list)
    #: Connections refused by the egress proxy or seen blocked in the sandbox.
    egress_blocked: int = 0
    image: str = ""

    @property
    def cli_exit_code(self) -> int:
        return EXIT_CODES.get(self.status, 5)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
    backend: str = "docker"


class RunCancelled(Exception):
    """Raised by the CLI's SIGTERM handler so a run is torn down like on Ctrl-C."""


def prepare(spec: RunSpec) -> PreparedRun:
    """Check everything that can be checked before a sandbox exists; raise on any problem."""
    manifest = load_manifest(spec.payload)
    dangerous = manifest.dangerous_imports()
    if dangerous and not spec.allow_dangerous_imports:
        raise ManifestError(
            f"{manifest.path}: field `python.authorized_imports` lists {', '.join(dangerous)}, "
            "which would let agent-written code escape the inner executor's import allowlist.",
            "Remove them, or accept the risk by name with --i-understand-dangerous-imports "
            "(the container stays the boundary).",
        )
    model = parse_model(
        spec.model,
        api_base=spec.api_base,
        credential_env=spec.model_key_env,
        options=spec.model_options,
    )
    task = spec.task if spec.task is not None else manifest.example_task
    if not task:
        raise ConfigError(
            f"No task given, and {manifest.path} has no `payload.example_task`.",
            'Pass the task as an argument (orchestrator run PAYLOAD "your task").',
        )
    overrides = {
        k: getattr(spec, k)
        for k in ("max_steps", "timeout_seconds", "memory_mb", "cpus", "pids")
        if getattr(spec, k) is not None
    }
    limits = replace(manifest.limits, **overrides)
    limits.validate("command line")
    network = resolve_network(spec, manifest, model)
    needed = list(manifest.secrets)
    if model.credential_env:
        needed.append(model.credential_env)
    secrets = resolve_secrets(needed, env_file=spec.env_file)
    return PreparedRun(
        backend=backend_name(spec.backend, manifest),
        run_id=spec.run_id or new_run_id(),
        spec=spec,
        manifest=manifest,
        model=model,
        task=task,
        limits=limits,
        network=network,
        secrets=secrets,
    )


def resolve_network(spec: RunSpec, manifest: Manifest, model: ModelSpec) -> NetworkPolicy:
    """`none` unless the run needs network; then `allowlist` (the model's host, the payload's
    hosts, --allow-host); `open` only when asked for by name."""
    from .manifest import _HOST_RE

    for host in spec.allow_hosts:
        if not _HOST_RE.match(host.lower()):
            raise ConfigError(
                f"--allow-host {host!r} is not a host name.",
                "Use an exact name (api.example.com) or one leading wildcard (*.example.com).",
            )
    return resolve_policy(spec.network, model=model, hosts=(*manifest.hosts, *spec.allow_hosts))


def backend_name(requested: str | None, manifest: Manifest | None = None) -> str:
    """The backend of a run: the one asked for, else the payload's, else docker."""
    name = requested or (manifest.backend if manifest else None) or "docker"
    if name not in BACKENDS:
        raise ConfigError(f"Unknown backend {name!r}.", f"Use one of {', '.join(BACKENDS)}.")
    return name


def get_backend(name: str, *, env_file: str | Path | None = None) -> Backend:
    """A backend by name; fails (before anything starts) if it cannot be used here."""
    if name == "docker":
        from .backends.docker import DockerBackend

        return DockerBackend()
    if name == "e2b":
        from .backends.e2b import E2BBackend, E2BSettings

        return E2BBackend(E2BSettings.from_env(env_file))
    raise ConfigError(f"Unknown backend {name!r}.", f"Use one of {', '.join(BACKENDS)}.")


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
    every outcome (including Ctrl-C, re-raised after cleanup) is recorded with a status.
    """
    prepared = prepare(spec)
    backend = backend or get_backend(prepared.backend, env_file=spec.env_file)
    return execute(
        prepared,
        backend=backend,
        store=store or Store(),
        on_event=on_event,
        on_progress=on_progress,
        cancel=cancel,
    )


def execute(
    prepared: PreparedRun,
    *,
    backend: Backend,
    store: Store,
    on_event: EventHandler | None = None,
    on_progress: Callable[[str], None] | None = None,
    cancel: threading.Event | None = None,
) -> RunResult:
    progress = on_progress or (lambda _message: None)
    cancel = cancel or threading.Event()
    redactor = Redactor(prepared.secrets.values())
    run_id = prepared.run_id
    record_dir = store.create_run(
        run_id,
        status="preparing",
        payload=prepared.manifest.name,
        model=prepared.model.describe(),
        backend=backend.name,
        network=prepared.network.mode,
        task=redactor.text(prepared.task),
        schedule=prepared.spec.schedule,
        batch=prepared.spec.batch,
        owner=owner_label(),
    )
    record = RunRecorder(record_dir, redactor, on_event)
    result = RunResult(
        run_id=run_id,
        status="infra_error",
        record_dir=str(record_dir),
        payload=prepared.manifest.name,
        model=prepared.model.describe(),
        backend=backend.name,
        network=prepared.network.mode,
        allowlist=describe_allowlist(prepared.network),
    )
    timings: dict[str, float] = {"created": time.time()}
    sandbox: Sandbox | None = None
    interrupted: BaseException | None = None
    try:
        t0 = time.monotonic()
        extra = prepared.manifest.requirements + _provider_requirements(prepared.model)
        result.image = backend.prepare_image(extra, progress)
        timings["image_seconds"] = round(time.monotonic() - t0, 3)
        store.update_run(run_id, status="starting")
        sandbox = backend.create(sandbox_spec(prepared, result.image), progress)
        record.host_event(
            "sandbox_created",
            backend=backend.name,
            sandbox_id=sandbox.id,
            network=prepared.network.mode,
            allowlist=result.allowlist,
        )
        timings["started"] = time.time()
        sandbox.start(build_request(prepared), prepared.secrets)
        store.update_run(run_id, status="running")
        outcome = supervise(sandbox, record, prepared.limits.timeout_seconds, cancel)
        exit_info = sandbox.wait(timeout=30)
        if record.run_end is None and outcome != "cancelled":
            record.recover(sandbox.recover_stdout())
        result.status, result.error = decide_status(outcome, exit_info, record.run_end)
        result.exit_code = exit_info.exit_code
        result.oom_killed = exit_info.oom_killed
    except (KeyboardInterrupt, RunCancelled) as exc:
        interrupted = exc
        if sandbox is not None:
            sandbox.kill()
        result.status = "cancelled"
        result.error = {"type": type(exc).__name__, "message": "cancelled by the user"}
    except Exception as exc:  # engine errors, image build failures, vanished sandboxes
        result.status = "infra_error"
        result.error = {"type": type(exc).__name__, "message": redactor.text(str(exc))}
    finally:
        if sandbox is not None:
            record_egress_blocked(sandbox, record)
            try:
                sandbox.remove()
            except Exception as exc:  # never mask the run's own outcome
                record.host_event("cleanup_failed", error=str(exc))
        timings["ended"] = time.time()
        timings["duration"] = round(
            timings["ended"] - timings.get("started", timings["created"]), 3
        )
        result.timings = timings
        if result.status == "infra_error":
            result.error = explain_network(prepared, result.error)
        finish(result, record, store)
    if interrupted is not None:
        raise interrupted
    return result


def supervise(
    sandbox: Sandbox, record: RunRecorder, timeout: float, cancel: threading.Event
) -> str:
    """Pump the sandbox's output until it ends, the time limit passes, or the run is
    cancelled, or it loses its network (egress proxy gone); returns `finished`, `timed_out`,
    `cancelled` or `network_lost`. The host enforces the time limit by killing the sandbox;
    nothing in the sandbox is trusted to stop itself."""
    done = threading.Event()

    def pump() -> None:
        try:
            for name, chunk in sandbox.stream():
                record.feed(name, chunk)
        finally:
            record.flush()
            done.set()

    reader = threading.Thread(target=pump, name="sandbox-stream", daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    outcome = "finished"
    lost: str | None = None
    next_check = time.monotonic()
    while not done.wait(timeout=0.05):
        if time.monotonic() >= next_check:
            lost, next_check = sandbox_health(sandbox), time.monotonic() + HEALTH_INTERVAL
        if cancel.is_set():
            outcome = "cancelled"
        elif time.monotonic() >= deadline:
            outcome = "timed_out"
        elif lost:
            outcome = "network_lost"
        else:
            continue
        sandbox.kill()
        record.host_event(outcome, **({"reason": lost} if lost else {"limit_seconds": timeout}))
        break
    reader.join(timeout=10)
    failed = (record.run_end or {}).get("state") != "success"
    if outcome == "finished" and failed and (lost := sandbox_health(sandbox)):
        # The runtime ended first (say, on a model connection error): name the real cause.
        outcome = "network_lost"
        record.host_event(outcome, reason=lost)
    return outcome


def sandbox_health(sandbox: Sandbox) -> str | None:
    """Why a running sandbox can no longer work (its egress proxy is gone), or None."""
    health = getattr(sandbox, "health", None)  # optional for backends without egress
    return health() if health else None


def record_egress_blocked(sandbox: Sandbox, record: RunRecorder) -> None:
    """Record what the sandbox's egress proxy refused, as `egress_blocked` events."""
    blocked = getattr(sandbox, "egress_blocked", None)
    try:
        attempts = blocked() if blocked else []
    except Exception as exc:  # the run's outcome matters more than its egress log
        record.host_event("egress_log_unavailable", error=str(exc))
        return
    for attempt in attempts:
        record.event({"type": "egress_blocked", "source": "egress", **attempt})


def explain_network(prepared: PreparedRun, error: dict[str, Any] | None) -> dict[str, Any] | None:
    """Add the likely network cause when the model could not be reached."""
    if not error or error.get("kind") != "model_unavailable":
        return error
    if prepared.network.mode == "none" and prepared.model.needs_network:
        hint = (
            "this run has no network (--network none), so the sandbox cannot reach the model "
            f"at {prepared.model.api_base}"
        )
    elif prepared.network.host_endpoints:
        hint = (
            f"the model server at {prepared.model.api_base} is reached from containers through "
            "the Docker bridge: it must listen on 0.0.0.0 or the docker0 address, not only "
            "on 127.0.0.1"
        )
    else:
        return error
    return {**error, "message": f"{error.get('message') or ''} ({hint})".strip()}


def decide_status(
    outcome: str, exit_info: ExitInfo, run_end: dict[str, Any] | None
) -> tuple[str, dict[str, Any] | None]:
    """Map what happened to one terminal status and an error (None on success)."""
    if outcome in ("timed_out", "cancelled"):
        message = "time limit reached" if outcome == "timed_out" else "cancelled by the user"
        return outcome, {"type": outcome, "message": message}
    if outcome == "network_lost":
        message = (
            "the egress proxy stopped during the run, which cut the sandbox off from the "
            "network (fail closed); the sandbox was stopped"
        )
        return "infra_error", {"type": "network_lost", "message": message}
    if exit_info.oom_killed:
        return "oom_killed", {"type": "oom_killed", "message": "the sandbox ran out of memory"}
    if run_end is not None:
        if run_end.get("state") == "success":
            return "succeeded", None
        error = run_end.get("error") or {"type": run_end.get("state"), "message": ""}
        if error.get("kind") == "model_unavailable":
            return "infra_error", error
        return "failed", error
    if exit_info.infra_error:
        return "infra_error", {"type": "sandbox_lost", "message": exit_info.infra_error}
    return "infra_error", {
        "type": "no_result",
        "message": f"the runtime exited with code {exit_info.exit_code} without a result",
    }


class RunRecorder:
    """Writes a run's events and logs to its record directory as they arrive, masked."""

    def __init__(self, directory: Path, redactor: Redactor, on_event: EventHandler | None):
        self.directory = directory
        self.redactor = redactor
        self.on_event = on_event
        self.events: list[dict[str, Any]] = []
        self.run_end: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._partial = {"stdout": b"", "stderr": b""}
        self._files: dict[str, TextIO] = {
            name: open(directory / filename, "a", encoding="utf-8")  # noqa: SIM115
            for name, filename in (
                ("events", "events.jsonl"), ("stdout", "stdout.log"), ("stderr", "stderr.log")
            )
        }  # fmt: skip
        self._written = {"stdout": 0, "stderr": 0}
        self._closed = False

    def feed(self, stream: str, chunk: bytes) -> None:
        data = self._partial[stream] + chunk
        *lines, self._partial[stream] = data.split(b"\n")
        for line in lines:
            self._line(stream, line.decode("utf-8", errors="replace"))

    def flush(self) -> None:
        for stream, rest in self._partial.items():
            if rest:
                self._line(stream, rest.decode("utf-8", errors="replace"))
            self._partial[stream] = b""

    def _line(self, stream: str, line: str) -> None:
        if stream == "stdout":
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if isinstance(event, dict) and "type" in event:
                self.event(event)
                return
        self._log(stream, line)

    def _log(self, stream: str, line: str) -> None:
        line = self.redactor.text(line) + "\n"
        with self._lock:
            if self._closed or self._written[stream] > MAX_LOG_BYTES:
                return
            self._written[stream] += len(line)
            if self._written[stream] > MAX_LOG_BYTES:
                line = f"[orchestrator: {stream} log capped at {MAX_LOG_BYTES} bytes]\n"
            self._files[stream].write(line)
            self._files[stream].flush()

    def event(self, event: dict[str, Any]) -> None:
        event = self.redactor.data(event)
        with self._lock:
            if self._closed:
                return
            if event.get("type") == "run_end":
                if self.run_end is not None:
                    return  # recovered twice: keep the first
                self.run_end = event
            self.events.append(event)
            self._files["events"].write(json.dumps(event, default=str) + "\n")
            self._files["events"].flush()
        if self.on_event:
            self.on_event(event)

    def host_event(self, type_: str, **fields: Any) -> None:
        self.event({"type": type_, "source": "host", "ts": time.time(), **fields})

    def recover(self, stdout: bytes) -> None:
        """Find the run_end in the engine's copy of stdout after a broken live stream."""
        for line in reversed(stdout.decode("utf-8", errors="replace").splitlines()):
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("type") == "run_end":
                self.host_event("stream_recovered")
                self.event(event)
                return

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for file in self._files.values():
                file.close()


def finish(result: RunResult, record: RunRecorder, store: Store) -> None:
    """Fill the result from the run_end event, write result.json and the index row."""
    end = record.run_end or {}
    if result.status == "succeeded":
        result.answer = end.get("answer")
    result.token_usage = end.get("token_usage") or {}
    result.steps = int(end.get("steps") or sum(1 for e in record.events if e["type"] == "step"))
    result.egress_blocked = sum(1 for e in record.events if e["type"] == "egress_blocked")
    result.answer = record.redactor.data(result.answer)
    result.error = record.redactor.data(result.error)
    record.host_event("run_finished", status=result.status)
    record.close()
    path = Path(result.record_dir) / "result.json"
    path.write_text(json.dumps(result.to_dict(), indent=2, default=str) + "\n")
    store.update_run(
        result.run_id,
        status=result.status,
        ended_at=result.timings.get("ended"),
        duration=result.timings.get("duration"),
        answer=None if result.answer is None else json.dumps(result.answer, default=str),
        error=None
        if result.error is None
        else result.error.get("message") or result.error.get("type"),
        exit_code=result.exit_code,
        input_tokens=result.token_usage.get("input_tokens"),
        output_tokens=result.token_usage.get("output_tokens"),
    )


def sandbox_spec(prepared: PreparedRun, image: str) -> SandboxSpec:
    return SandboxSpec(
        run_id=prepared.run_id,
        image=image,
        command=RUNTIME_COMMAND,
        limits=prepared.limits,
        network=prepared.network,
        labels=run_labels(prepared.run_id),
    )


def run_labels(run_id: str) -> dict[str, str]:
    from .config import home_dir

    return {
        LABEL_RUN_ID: run_id,
        LABEL_VERSION: VERSION,
        LABEL_STORE: store_id(home_dir()),
        LABEL_OWNER: owner_label(),
    }


def build_request(prepared: PreparedRun) -> dict[str, Any]:
    """What the runtime is asked to do (docs/PROTOCOL.md), without the secrets: the backend
    ships those separately (`Sandbox.start`)."""
    manifest = prepared.manifest
    request = {
        "protocol": 1,
        "run_id": prepared.run_id,
        "task": prepared.task,
        "additional_args": prepared.spec.additional_args,
        "payload": {
            "name": manifest.name,
            "entrypoint": manifest.entrypoint,
            "files": manifest.payload_files(),
        },
        "authorized_imports": list(manifest.authorized_imports),
        "allow_dangerous_imports": prepared.spec.allow_dangerous_imports,
        "max_steps": prepared.limits.max_steps,
        "model": {
            **prepared.model.to_request(),
            "api_base": sandbox_api_base(prepared.model.api_base, prepared.network),
        },
        "mock_scripts": manifest.mock_scripts if prepared.model.provider == "mock" else {},
        "result_path": RESULT_PATH,
    }
    return request


def _provider_requirements(model: ModelSpec) -> tuple[str, ...]:
    from .models import PROVIDERS

    return PROVIDERS[model.provider].extra_requirements


def store_id(root: Path) -> str:
    import hashlib

    return hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]


def owner_label() -> str:
    """`host:pid:start` of this process, so cleanup can tell a live owner from a dead one."""
    return f"{socket.gethostname()}:{os.getpid()}:{process_start_time(os.getpid())}"


def process_start_time(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "?"
    return stat.rsplit(")", 1)[1].split()[19]  # field 22: start time in clock ticks
