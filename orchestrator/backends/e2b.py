"""E2B backend: one E2B sandbox (a Firecracker microVM) per run, from a content-addressed
template made of the same image definition as the Docker image.

- Template: `images/agent/install.sh` and `harden.sh` run on the same wheels and runtime
  files as the Docker image, in one stage (E2B's builder has no multi-stage builds), on
  `$ORCHESTRATOR_E2B_BASE_IMAGE` (default `python:3.12-slim`). Its name carries a hash of
  everything that goes in, so unchanged inputs reuse it and a run never pip-installs.
- Run: the sandbox is created with the run's labels as metadata and a lifetime a little above
  the run's time limit; the request goes in as one uploaded file (no secrets in it), the
  runtime starts with the secrets as that one command's environment (never the sandbox's),
  and its output streams back live. The host enforces the time limit by killing the sandbox.
- Network: `none` -> no internet access; `allowlist` -> deny all out, allow the listed hosts;
  `open` -> E2B's default (internet access).
- Faults: create and API calls are retried on 429, 5xx and transport errors (tenacity,
  exponential backoff with jitter, on top of the SDK's own retries, which honour
  Retry-After); at most `max_concurrency` sandboxes of this process are alive at once.
- `E2B_API_KEY` is the orchestrator's own credential: it is used on the host only.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from filelock import FileLock
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from ..config import LABEL_KIND, LABEL_RUN_ID, VERSION, home_dir
from ..errors import ConfigError, EngineUnavailable, ImageBuildError
from ..secrets import resolve_secrets
from .base import ExitInfo, NetworkPolicy, Progress, SandboxInfo, SandboxSpec, StreamName

if TYPE_CHECKING:
    import e2b

    from ..images import PythonTarget

T = TypeVar("T")

API_KEY_ENV = "E2B_API_KEY"
BASE_IMAGE_ENV = "ORCHESTRATOR_E2B_BASE_IMAGE"
PYTHON_ENV = "ORCHESTRATOR_E2B_PYTHON"
MAX_SANDBOXES_ENV = "ORCHESTRATOR_E2B_MAX_SANDBOXES"
CPUS_ENV = "ORCHESTRATOR_E2B_CPUS"
MEMORY_ENV = "ORCHESTRATOR_E2B_MEMORY_MB"
ATTEMPTS_ENV = "ORCHESTRATOR_E2B_ATTEMPTS"

DEFAULT_BASE = "python:3.12-slim"
#: E2B's Hobby plan allows 20 concurrent sandboxes (Pro: 100 and more).
DEFAULT_MAX_SANDBOXES = 20
#: Sandbox size, fixed per template on E2B.
DEFAULT_CPUS = 2
DEFAULT_MEMORY_MB = 1024
#: Tries for each API call (create, kill, list, upload), the first included.
DEFAULT_ATTEMPTS = 4
#: A sandbox lives this much longer than its run's time limit, in case the host goes away.
LIFETIME_MARGIN_SECONDS = 60
TEMPLATE_PREFIX = "orchestrator-agent"

#: The unprivileged user made by images/agent/harden.sh, and the runtime inside the template.
SANDBOX_USER = "agent"
PYTHON = "/opt/venv/bin/python"
#: The environment of the runtime besides the secrets (as the Docker image's ENV).
RUNTIME_ENV = {
    "PATH": "/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "VIRTUAL_ENV": "/opt/venv",
    "HOME": "/tmp",
    "PYTHONUNBUFFERED": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
}


def _sdk() -> Any:
    """The `e2b` SDK, or a clear error saying how to install it."""
    try:
        import e2b
    except ImportError as exc:
        raise ConfigError(
            "The E2B backend needs the `e2b` package, which is not installed.",
            "Install the extra: pip install 'orchestrator[e2b]'.",
        ) from exc
    return e2b


# ---- settings --------------------------------------------------------------------------------


@dataclass(frozen=True)
class E2BSettings:
    """How this host uses E2B; from the environment (and `.env` for the API key)."""

    api_key: str
    base_image: str = DEFAULT_BASE
    max_sandboxes: int = DEFAULT_MAX_SANDBOXES
    cpus: int = DEFAULT_CPUS
    memory_mb: int = DEFAULT_MEMORY_MB
    attempts: int = DEFAULT_ATTEMPTS
    python: str | None = None

    @classmethod
    def from_env(cls, env_file: str | Path | None = None) -> E2BSettings:
        try:
            api_key = resolve_secrets([API_KEY_ENV], env_file=env_file)[API_KEY_ENV]
        except ConfigError as exc:
            raise ConfigError(
                f"The E2B backend needs an API key, and {API_KEY_ENV} is not set.",
                f"Get one at https://e2b.dev/dashboard and export {API_KEY_ENV}=e2b_... (or add "
                "it to .env); it is used on this host only and never enters a sandbox. "
                "Nothing was started.",
            ) from exc
        return cls(
            api_key=api_key,
            base_image=os.environ.get(BASE_IMAGE_ENV) or DEFAULT_BASE,
            max_sandboxes=_int_env(MAX_SANDBOXES_ENV, DEFAULT_MAX_SANDBOXES, 1, 10_000),
            cpus=_int_env(CPUS_ENV, DEFAULT_CPUS, 1, 64),
            memory_mb=_int_env(MEMORY_ENV, DEFAULT_MEMORY_MB, 128, 65536),
            attempts=_int_env(ATTEMPTS_ENV, DEFAULT_ATTEMPTS, 1, 20),
            python=os.environ.get(PYTHON_ENV) or None,
        )


def _int_env(name: str, default: int, low: int, high: int) -> int:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise ConfigError(f"{name}={raw!r} is not a whole number from {low} to {high}.", "Fix it.")
    return value


# ---- retries ---------------------------------------------------------------------------------


def is_transient(exc: BaseException) -> bool:
    """Worth another try: rate limits, server errors, a busy service, a dropped connection."""
    import httpx

    e2b = _sdk()
    if isinstance(exc, e2b.RateLimitException | e2b.ServiceBusyException | httpx.TransportError):
        return True
    status = getattr(exc, "status_code", None)
    return isinstance(exc, e2b.SandboxException) and isinstance(status, int) and status >= 500


def with_retries(attempts: int, call: Callable[[], T], *, what: str, progress: Progress) -> T:
    """`call()`, retried on transient faults with exponential backoff and jitter."""

    def before_sleep(state: Any) -> None:
        exc = state.outcome.exception() if state.outcome else None
        progress(f"e2b: {what} failed ({type(exc).__name__}: {exc}); retrying")

    retrying = Retrying(
        stop=stop_after_attempt(attempts),
        wait=wait_random_exponential(multiplier=0.5, max=30),
        retry=retry_if_exception(is_transient),
        before_sleep=before_sleep,
        reraise=True,
    )
    return retrying(call)


# ---- templates -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TemplatePlan:
    """What an agent template is made of, and its content-addressed name."""

    name: str
    content_hash: str
    base: str
    target: PythonTarget
    requirements: str
    wheels: dict[str, Path]  # file name -> path in a host wheelhouse
    scripts: dict[str, bytes]  # install.sh, harden.sh
    runtime_files: dict[str, bytes]


def python_target(settings: E2BSettings, progress: Progress) -> PythonTarget:
    """The interpreter of the template's base, which the wheels must fit.

    Asked of the image itself when the local Docker engine has it (or can pull it); else
    read from `$ORCHESTRATOR_E2B_PYTHON` or from an official `python:3.N` tag (glibc 2.28,
    the floor of current Debian-based images, x86_64 like E2B's hosts).
    """
    from ..images import PythonTarget
    from ..images import python_target as probe

    explicit = settings.python
    if explicit is None:
        with contextlib.suppress(Exception):  # no engine, or no such image here: fall through
            import docker

            client = docker.from_env(timeout=30)
            client.api.inspect_image(settings.base_image)
            return probe(client, settings.base_image)
        match = re.match(r"^(?:docker\.io/)?(?:library/)?python:(3\.\d+)", settings.base_image)
        explicit = match.group(1) if match else None
    if explicit is None or not re.match(r"^3\.\d+(\.\d+)?$", explicit):
        raise ConfigError(
            f"Cannot tell which Python the E2B base image {settings.base_image} has "
            "(it is not on the local Docker engine, and its tag does not say).",
            f"Set {PYTHON_ENV} to its version (e.g. 3.12), or use an official python:3.N image.",
        )
    progress(f"e2b: building for Python {explicit} (from {settings.base_image})")
    return PythonTarget(version=explicit, glibc="2.28", machine="x86_64")


def plan_template(
    settings: E2BSettings, extra_requirements: tuple[str, ...], progress: Progress
) -> TemplatePlan:
    """The template for a run: the agent environment plus the payload's extra requirements
    (one template per set; E2B has no cheap derived layers to share)."""
    from ..images import (
        AGENT_IMAGE_DIR,
        RUNTIME_DIR,
        _digest,
        _sha256,
        agent_image_definition,
        ensure_wheelhouse,
        normalize_requirements,
        runtime_files_of,
    )

    target = python_target(settings, progress)
    requirements = (AGENT_IMAGE_DIR / "requirements.txt").read_text()
    agent = ensure_wheelhouse(requirements, target, progress=progress)
    wheels = {name: agent.path / name for name in agent.wheels}
    digests = dict(agent.wheels)
    extra = normalize_requirements(extra_requirements)
    if extra:
        extra_text = "\n".join(extra) + "\n"
        more = ensure_wheelhouse(extra_text, target, constraints=agent.pins(), progress=progress)
        wheels |= {name: more.path / name for name in more.wheels}
        digests |= more.wheels
        requirements = requirements.rstrip("\n") + "\n" + extra_text
    definition = agent_image_definition()
    scripts = {name: definition[name] for name in ("install.sh", "harden.sh")}
    runtime = runtime_files_of(RUNTIME_DIR)
    content_hash = _digest(
        {
            "version": VERSION,
            "definition": {name: _sha256(data) for name, data in definition.items()},
            "requirements": requirements,
            "base": settings.base_image,
            "python": target.version,
            "wheels": digests,
            "runtime": {name: _sha256(data) for name, data in runtime.items()},
            "size": [settings.cpus, settings.memory_mb],
        }
    )
    return TemplatePlan(
        name=f"{TEMPLATE_PREFIX}-{content_hash[:12]}",
        content_hash=content_hash,
        base=settings.base_image,
        target=target,
        requirements=requirements,
        wheels=wheels,
        scripts=scripts,
        runtime_files=runtime,
    )


def _write_context(plan: TemplatePlan, root: Path) -> None:
    """The files the template copies in, laid out as the Docker build context is."""
    (root / "requirements.txt").write_text(plan.requirements)
    for name, data in plan.scripts.items():
        (root / name).write_bytes(data)
    (root / "wheels").mkdir()
    for name, path in plan.wheels.items():
        shutil.copyfile(path, root / "wheels" / name)
    for name, data in plan.runtime_files.items():
        target = root / "orchestrator_runtime" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def template_definition(plan: TemplatePlan, context: Path) -> Any:
    """The E2B template: the Docker image's two stages in one, same scripts, same files."""
    e2b = _sdk()
    return (
        e2b.Template(file_context_path=str(context))
        .from_image(plan.base)
        .copy("requirements.txt", "/wheels/")
        .copy("wheels/", "/wheels/")
        .copy("orchestrator_runtime/", "/opt/orchestrator/orchestrator_runtime/")
        .copy("install.sh", "/install.sh")
        .copy("harden.sh", "/harden.sh")
        .run_cmd("sh /install.sh && sh /harden.sh", user="root")
        .set_envs(RUNTIME_ENV)
        .set_workdir("/tmp")
        .set_user(SANDBOX_USER)
    )


def ensure_template(
    settings: E2BSettings,
    extra_requirements: tuple[str, ...] = (),
    progress: Progress = lambda _m: None,
) -> str:
    """The name of a template to run: built only if E2B does not have it yet."""
    e2b = _sdk()
    plan = plan_template(settings, extra_requirements, progress)

    def exists() -> bool:
        return bool(
            with_retries(
                settings.attempts,
                lambda: e2b.Template.exists(plan.name, api_key=settings.api_key),
                what="template lookup",
                progress=progress,
            )
        )

    try:
        if exists():
            return plan.name
        locks = home_dir() / "images"
        locks.mkdir(parents=True, exist_ok=True)
        with FileLock(str(locks / f".e2b-{plan.content_hash[:16]}.lock")):
            if exists():
                return plan.name
            _build_template(plan, settings, progress)
    except e2b.AuthenticationException as exc:
        raise EngineUnavailable(
            f"E2B refused the API key ({exc}).", f"Check {API_KEY_ENV}; nothing was started."
        ) from exc
    return plan.name


def _build_template(plan: TemplatePlan, settings: E2BSettings, progress: Progress) -> None:
    e2b = _sdk()
    progress(f"e2b: building template {plan.name} on {plan.base} ({plan.target.describe()})")
    started = time.monotonic()
    tail: list[str] = []

    def on_log(entry: Any) -> None:
        message = str(getattr(entry, "message", entry)).rstrip()
        if message:
            tail[:] = [*tail[-24:], message]
            progress(f"e2b build: {message}")

    with tempfile.TemporaryDirectory(prefix="orchestrator-e2b-") as context:
        _write_context(plan, Path(context))
        template = template_definition(plan, Path(context))
        try:
            e2b.Template.build(
                template,
                plan.name,
                cpu_count=settings.cpus,
                memory_mb=settings.memory_mb,
                on_build_logs=on_log,
                api_key=settings.api_key,
            )
        except e2b.AuthenticationException:
            raise
        except Exception as exc:
            raise ImageBuildError(
                f"Building the E2B template {plan.name} failed: {exc}\nLast build output:\n"
                + "\n".join(tail),
                f"Read the build output above for the failing step; check that E2B can pull "
                f"the base image {plan.base} ({BASE_IMAGE_ENV}).",
            ) from exc
    progress(f"e2b: built template {plan.name} in {time.monotonic() - started:.1f} s")


# ---- sandboxes -------------------------------------------------------------------------------


def network_options(policy: NetworkPolicy) -> dict[str, Any]:
    """The run's network policy as `Sandbox.create` options."""
    if policy.host_endpoints:
        endpoints = ", ".join(f"{host}:{port}" for host, port in policy.host_endpoints)
        raise ConfigError(
            f"The model endpoint {endpoints} is on this host, which E2B's cloud cannot reach.",
            "Use a model endpoint reachable from the internet with --backend e2b, or run on "
            "this host with --backend docker.",
        )
    if policy.mode == "none":
        return {"allow_internet_access": False}
    if policy.mode == "open":
        return {"allow_internet_access": True}
    allowed = sorted({*policy.hosts, *(host for host, _port in policy.endpoints)})
    return {"network": {"deny_out": ["0.0.0.0/0"], "allow_out": allowed}}


class E2BSandbox:
    """One run's E2B sandbox; the stream is the runtime command's stdout and stderr."""

    def __init__(self, backend: E2BBackend, sandbox: e2b.Sandbox, spec: SandboxSpec) -> None:
        self.backend = backend
        self.sandbox = sandbox
        self.spec = spec
        self.id: str = sandbox.sandbox_id
        self._handle: Any = None
        self._killed = False
        self._removed = False
        self._lost: str | None = None

    def start(self, request: dict[str, Any], secrets: dict[str, str]) -> None:
        """Upload the request (one request, no secrets in it), then start the runtime with the
        secrets in its own environment only."""
        path = f"/tmp/orchestrator-request-{self.spec.run_id}.json"
        limits = {"nproc": self.spec.limits.pids, "nofile": 1024, "core": 0}
        body = json.dumps({**request, "secret_env": sorted(secrets), "rlimits": limits})
        self._call(lambda: self.sandbox.files.write(path, body, user=SANDBOX_USER), "upload")
        command = f"exec {PYTHON} -m orchestrator_runtime --request {path}"
        self._handle = self._call(
            lambda: self.sandbox.commands.run(
                command,
                background=True,
                envs={**RUNTIME_ENV, **self.spec.env, **secrets},
                user=SANDBOX_USER,
                cwd="/tmp",
                timeout=0,  # no limit on the connection: the host enforces the run's limit
            ),
            "start",
        )

    def stream(self) -> Iterator[tuple[StreamName, bytes]]:
        try:
            for stdout, stderr, _pty in self._handle:
                if stdout:
                    yield "stdout", stdout.encode()
                elif stderr:
                    yield "stderr", stderr.encode()
        except Exception as exc:  # the sandbox went away, or we killed it
            if not self._killed:
                self._lost = f"{type(exc).__name__}: {exc}"

    def wait(self, timeout: float) -> ExitInfo:
        e2b = _sdk()
        if self._lost:
            return ExitInfo(None, infra_error=f"the E2B sandbox was lost: {self._lost}")
        if self._killed:
            return ExitInfo(None)
        try:
            result = self._handle.wait()
        except e2b.CommandExitException as exc:
            return ExitInfo(exc.exit_code)
        except Exception as exc:
            return ExitInfo(None, infra_error=f"the runtime's end was not seen: {exc}")
        return ExitInfo(result.exit_code)

    def recover_stdout(self) -> bytes:
        """The run_end the runtime also wrote to its result file (see RESULT_PATH)."""
        from ..runner import RESULT_PATH

        try:
            return bytes(self.sandbox.files.read(RESULT_PATH, format="bytes", user=SANDBOX_USER))
        except Exception:
            return b""

    def kill(self) -> None:
        self._killed = True
        self._kill_sandbox()

    def remove(self) -> None:
        if self._removed:
            return
        self._removed = True
        try:
            if not self._killed:
                self._killed = True
                self._kill_sandbox()
        finally:
            self.backend.release()

    def _kill_sandbox(self) -> None:
        with contextlib.suppress(Exception):  # gone already, or unreachable: its lifetime ends it
            self._call(self.sandbox.kill, "kill")

    def _call(self, call: Callable[[], T], what: str) -> T:
        attempts = self.backend.settings.attempts
        return with_retries(attempts, call, what=what, progress=lambda _m: None)


class E2BBackend:
    """Runs sandboxes on E2B; the `e2b` SDK reads E2B_API_URL/E2B_DOMAIN as usual."""

    name = "e2b"

    def __init__(self, settings: E2BSettings | None = None) -> None:
        _sdk()
        self.settings = settings or E2BSettings.from_env()
        #: The cap a batch respects (E2B plans cap concurrent sandboxes).
        self.max_concurrency = self.settings.max_sandboxes
        self._slots = threading.BoundedSemaphore(self.max_concurrency)

    def release(self) -> None:
        with contextlib.suppress(ValueError):
            self._slots.release()

    def prepare_image(self, extra_requirements: tuple[str, ...], progress: Progress) -> str:
        return ensure_template(self.settings, tuple(extra_requirements), progress)

    def create(self, spec: SandboxSpec, progress: Progress) -> E2BSandbox:
        e2b = _sdk()
        options = network_options(spec.network)
        lifetime = int(math.ceil(spec.limits.timeout_seconds)) + LIFETIME_MARGIN_SECONDS
        metadata = {**spec.labels, LABEL_KIND: "sandbox"}
        self._slots.acquire()
        try:
            sandbox = with_retries(
                self.settings.attempts,
                lambda: e2b.Sandbox.create(
                    template=spec.image,
                    timeout=lifetime,
                    metadata=metadata,
                    api_key=self.settings.api_key,
                    **options,
                ),
                what="sandbox create",
                progress=progress,
            )
        except BaseException:
            self.release()
            raise
        return E2BSandbox(self, sandbox, spec)

    def list_sandboxes(self, labels: dict[str, str]) -> list[SandboxInfo]:
        """Running sandboxes whose metadata has all of `labels` (all of ours without)."""
        e2b = _sdk()
        query = e2b.SandboxQuery(metadata=labels) if labels else None
        paginator = e2b.Sandbox.list(query=query, api_key=self.settings.api_key)
        found: list[SandboxInfo] = []
        while paginator.has_next:
            for item in paginator.next_items():
                metadata = dict(item.metadata or {})
                if LABEL_RUN_ID not in metadata:
                    continue
                state = getattr(item.state, "value", str(item.state))
                kind = metadata.get(LABEL_KIND, "sandbox")
                found.append(SandboxInfo(item.sandbox_id, item.sandbox_id, metadata, state, kind))
        return found

    def remove_sandbox(self, info: SandboxInfo) -> None:
        e2b = _sdk()
        with_retries(
            self.settings.attempts,
            lambda: e2b.Sandbox.kill(info.id, api_key=self.settings.api_key),
            what="sandbox kill",
            progress=lambda _m: None,
        )
