"""E2B backend: one E2B sandbox per run, with a lifetime E2B enforces."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator_runtime.request import Request

from ...errors import ConfigError
from ...labels import LABEL_KIND, LABEL_RUN_ID, LABEL_WARM
from ...registry import DEFAULT_BACKEND
from ...spec import NetworkPolicy
from ..base import (
    Capabilities,
    ExitInfo,
    Progress,
    Sandbox,
    SandboxInfo,
    SandboxSpec,
    StreamName,
    WarmSandboxes,
)
from .gateway import E2BGateway
from .idle import IdleRuntime
from .settings import ALLOW_LOCAL_ENDPOINTS_ENV, E2BSettings, T, sdk, with_retries
from .slots import sandbox_slots
from .templates import PYTHON, RUNTIME_ENV, SANDBOX_USER, ensure_template

if TYPE_CHECKING:
    import e2b

#: A sandbox lives this much longer than its run's time limit, in case the host goes away.
LIFETIME_MARGIN_SECONDS = 60


def network_options(policy: NetworkPolicy, gateway_host: str | None = None) -> dict[str, Any]:
    """The run's network policy as `Sandbox.create` options; `gateway_host`: the run's model
    gateway, which an allowlist lets through too."""
    if policy.host_endpoints:
        endpoints = ", ".join(f"{host}:{port}" for host, port in policy.host_endpoints)
        raise ConfigError(
            f"The model endpoint {endpoints} is on this host, which E2B's cloud cannot reach.",
            "Use a model endpoint reachable from the internet with --backend e2b, or run on "
            f"this host with --backend {DEFAULT_BACKEND}.",
        )
    if policy.mode == "none":
        return {"allow_internet_access": False}
    if policy.mode == "open":
        return {"allow_internet_access": True}
    allowed = sorted({*policy.hosts, *(host for host, _port in policy.endpoints)})
    allowed += [gateway_host] if gateway_host else []
    return {"network": {"deny_out": ["0.0.0.0/0"], "allow_out": allowed}}


def lifetime(spec: SandboxSpec) -> int:
    """A run's sandbox's E2B timeout: its time limit and a margin, in whole seconds."""
    return int(math.ceil(spec.limits.timeout_seconds)) + LIFETIME_MARGIN_SECONDS


class E2BSandbox(Sandbox):
    """One run's E2B sandbox; the stream is the runtime command's stdout and stderr."""

    def __init__(
        self,
        backend: E2BBackend,
        sandbox: e2b.Sandbox,
        spec: SandboxSpec,
        gateway: E2BGateway | None = None,
    ) -> None:
        self.backend = backend
        self.gateway: E2BGateway | None = gateway
        self.sandbox = sandbox
        self.spec = spec
        self.id: str = sandbox.sandbox_id
        self._handle: Any = None
        self._killed = False
        self._removed = False
        self._lost: str | None = None
        #: A pooled sandbox's runtime, started idle (`E2BBackend.create_idle`); else None.
        self.idle: IdleRuntime | None = None

    def start(self, request: Request, secrets: dict[str, str]) -> None:
        """Upload the request (one request, no secrets in it), then start the runtime with the
        secrets in its own environment only; a pooled sandbox's waiting runtime gets both on
        its stdin instead (`IdleRuntime.send`)."""
        path = f"/tmp/orchestrator-request-{self.spec.run_id}.json"
        limits = {"nproc": self.spec.limits.pids, "nofile": 1024, "core": 0}
        if self.idle is not None:
            pooled = replace(request, secrets=secrets, rlimits=limits)
            self._handle = self.idle.send(pooled.to_json())
            return
        body = replace(request, secrets={}, secret_env=sorted(secrets), rlimits=limits).to_json()
        self._call(lambda: self.sandbox.files.write(path, body, user=SANDBOX_USER), "upload")
        command = f"exec {PYTHON} -m orchestrator_runtime --request {path}"
        self._handle = self._call(
            lambda: self.sandbox.commands.run(
                command,
                background=True,
                envs={**RUNTIME_ENV, **secrets},
                user=SANDBOX_USER,
                cwd="/tmp",
                timeout=0,  # no limit on the connection: the host enforces the run's limit
            ),
            "start",
        )

    def take(self, spec: SandboxSpec) -> None:
        """Hand a pooled sandbox to the run of `spec` (its run id was the sandbox's from the
        start): its E2B lifetime becomes the run's, from now."""
        if self.idle is None or self.idle.sent or spec.run_id != self.spec.run_id:
            raise ValueError(f"pooled sandbox {self.id} is not for run {spec.run_id}")
        self._call(lambda: self.sandbox.set_timeout(lifetime(spec)), "set timeout")
        if self.gateway is not None:  # the gateway's sandbox lives the run's lifetime too
            gateway = self.gateway
            self._call(lambda: gateway.sandbox.set_timeout(lifetime(spec)), "set timeout")
            if spec.gateway is not None:  # its token is the run's own
                gateway.spec = spec.gateway
        self.spec = spec

    def stream(self) -> Iterator[tuple[StreamName, bytes]]:
        if self.idle is not None:
            yield from self.idle.output()
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
        e2b = sdk()
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
        from orchestrator_runtime.protocol import RESULT_PATH

        try:
            return bytes(self.sandbox.files.read(RESULT_PATH, format="bytes", user=SANDBOX_USER))
        except Exception:
            return b""

    def health(self) -> str | None:
        """Why the sandbox can no longer work: its model gateway's sandbox is gone."""
        return self.gateway.alive() if self.gateway is not None else None

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
            if self.gateway is not None:
                self.gateway.remove()
                self.backend.release()
            self.backend.release()

    def _kill_sandbox(self) -> None:
        with contextlib.suppress(Exception):  # gone already, or unreachable: its lifetime ends it
            self._call(self.sandbox.kill, "kill")

    def _call(self, call: Callable[[], T], what: str) -> T:
        attempts = self.backend.settings.attempts
        return with_retries(attempts, call, what=what, progress=lambda _m: None)


class E2BBackend(WarmSandboxes):
    """Runs sandboxes on E2B; the `e2b` SDK reads E2B_API_URL/E2B_DOMAIN as usual."""

    name = "e2b"
    #: A model gateway in a sandbox of its own (`gateway.py`), pooled sandboxes
    #: (`create_idle`), sizes per template (not per run); its sandboxes run elsewhere (an
    #: endpoint on this host is refused unless ORCHESTRATOR_E2B_ALLOW_LOCAL_ENDPOINTS=1), end
    #: with their E2B lifetime, and removing them early takes the API (`orchestrator cleanup
    #: --backend e2b`). The cap on concurrent sandboxes is the plan's, from the settings
    #: (`max_concurrency`).
    capabilities = Capabilities(
        model_gateway="sandbox",
        orphans_end="its E2B sandbox ends with its E2B lifetime",
        sandboxes_run="elsewhere",
        local_endpoints_env=ALLOW_LOCAL_ENDPOINTS_ENV,
        sandbox_runtimes=(),  # microVMs: E2B's own isolation, no choice (`auto` only)
    )

    def __init__(self, settings: E2BSettings | None = None) -> None:
        sdk()
        self.settings = settings or E2BSettings.from_env()
        self._slots = sandbox_slots(self.settings.api_key, self.settings.max_sandboxes)

    @classmethod
    def create_backend(cls, env_file: str | Path | None = None) -> E2BBackend:
        """A backend on E2B; ConfigError without an API key (or without the `e2b` SDK)."""
        return cls(E2BSettings.from_env(env_file))

    @property
    def max_concurrency(self) -> int | None:
        """The cap a batch respects: E2B plans cap concurrent sandboxes (the settings')."""
        return self.settings.max_sandboxes

    def build_image(
        self, base: str | None, extra_requirements: tuple[str, ...], progress: Progress
    ) -> str:
        """The template on `base` (default: $ORCHESTRATOR_E2B_BASE_IMAGE, else the built-in
        one) with `extra_requirements`."""
        settings = replace(self.settings, base_image=base) if base else self.settings
        return ensure_template(settings, tuple(extra_requirements), progress)

    def release(self) -> None:
        self._slots.release()

    def _create_sandbox(self, progress: Progress, **options: Any) -> e2b.Sandbox:
        e2b = sdk()
        return with_retries(
            self.settings.attempts,
            lambda: e2b.Sandbox.create(api_key=self.settings.api_key, **options),
            what="sandbox create",
            progress=progress,
        )

    def prepare_image(self, extra_requirements: tuple[str, ...], progress: Progress) -> str:
        return ensure_template(self.settings, tuple(extra_requirements), progress)

    def create(self, spec: SandboxSpec, progress: Progress) -> E2BSandbox:
        """The run's sandbox; with a gateway (`spec.gateway`), the gateway's sandbox first
        (`gateway.E2BGateway`), whose host the run's sandbox may then reach."""
        metadata = {**spec.labels, LABEL_KIND: "sandbox"}
        slots = 2 if spec.gateway is not None else 1
        self._slots.take(slots)
        gateway = None
        try:
            if spec.gateway is not None:
                gateway = E2BGateway.start(
                    lambda **o: self._create_sandbox(progress, **o),
                    lambda call, what: with_retries(
                        self.settings.attempts, call, what=what, progress=progress
                    ),
                    template=spec.image,
                    spec=spec.gateway,
                    labels=spec.labels,
                    lifetime=lifetime(spec),
                    progress=progress,
                )
            options = network_options(spec.network, gateway.host if gateway else None)
            sandbox = self._create_sandbox(
                progress, template=spec.image, timeout=lifetime(spec), metadata=metadata, **options
            )
        except BaseException:
            if gateway is not None:
                gateway.remove()
            for _ in range(slots):
                self.release()
            raise
        return E2BSandbox(self, sandbox, spec, gateway)

    def create_idle(self, spec: SandboxSpec, progress: Progress, ttl: float) -> E2BSandbox:
        """A pooled sandbox: created as `create` does (a slot under the cap included), with
        `LABEL_WARM`; it lives `ttl` seconds by E2B's own timeout unless a run takes it
        (`E2BSandbox.take`), and its runtime waits on stdin with nothing of any run in it
        (`idle.py`). Raises the SDK's errors, RuntimeError when the runtime is not ready."""
        sandbox = self.create(replace(spec, labels={**spec.labels, LABEL_WARM: "true"}), progress)
        try:
            if sandbox.gateway is not None:  # its gateway idles as long, by E2B's timeout too
                gateway = sandbox.gateway
                sandbox._call(
                    lambda: gateway.sandbox.set_timeout(max(1, math.ceil(ttl))), "set timeout"
                )
            sandbox.idle = IdleRuntime.start(
                sandbox.sandbox, spec.command, ttl, self.settings.attempts
            )
            sandbox.idle.wait_ready()
        except BaseException:
            sandbox.remove()
            raise
        return sandbox

    def list_sandboxes(self, labels: dict[str, str]) -> list[SandboxInfo]:
        """Running sandboxes whose metadata has all of `labels` (all of ours without)."""
        e2b = sdk()
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
        e2b = sdk()
        with_retries(
            self.settings.attempts,
            lambda: e2b.Sandbox.kill(info.id, api_key=self.settings.api_key),
            what="sandbox kill",
            progress=lambda _m: None,
        )
