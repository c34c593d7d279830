"""The one small interface every sandbox backend implements.

A *backend* decides where a sandbox runs (Docker, E2B); the runner decides what runs in it.
Policies (limits, network, labels) are plain data; each backend renders them into its own
options.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ..gateway import GatewaySpec
from ..spec import Limits, NetworkPolicy

if TYPE_CHECKING:
    from orchestrator_runtime.request import Request

Progress = Callable[[str], None]
StreamName = Literal["stdout", "stderr"]


@dataclass(frozen=True)
class SandboxSpec:
    """Everything a backend needs to start one sandbox for one run."""

    run_id: str
    image: str
    command: tuple[str, ...]
    limits: Limits
    network: NetworkPolicy
    labels: dict[str, str] = field(default_factory=dict)
    #: The run's model gateway, for backends that run one (Docker); None: no gateway.
    gateway: GatewaySpec | None = None


@dataclass(frozen=True)
class ExitInfo:
    exit_code: int | None
    oom_killed: bool = False
    #: Set when the sandbox disappeared or the engine failed under the run.
    infra_error: str | None = None


@dataclass(frozen=True)
class SandboxInfo:
    """A sandbox found by its labels (for cleanup)."""

    id: str
    name: str
    labels: dict[str, str]
    state: str
    kind: str = "sandbox"
    #: How a sandbox that is no longer running ended, where the backend can tell (from the
    #: engine, never from the sandbox): its exit code, an OOM kill, and when it ran.
    exit_code: int | None = None
    oom_killed: bool = False
    started_at: float | None = None
    finished_at: float | None = None


class Sandbox(ABC):
    """One sandbox of one run. Required: start, stream, wait, recover_stdout, kill, remove.

    Optional parts have defaults here (a backend without an egress proxy keeps them).
    """

    id: str

    @abstractmethod
    def start(
        self, request: Request, secrets: dict[str, str], *, gateway_key: str | None = None
    ) -> None:
        """Start the runtime and hand it the run request and the run's secrets.

        Each backend ships them its own way (Docker: one JSON object on stdin; E2B: the request
        as an uploaded file, the secrets as the command's environment), never through the
        sandbox's configuration or an image. `gateway_key` is the model's real key, for the
        run's gateway only (never the sandbox). Raises the engine's errors if it cannot start.
        """

    @abstractmethod
    def stream(self) -> Iterator[tuple[StreamName, bytes]]:
        """Output chunks as they come, until the runtime's output ends (never raises: a
        broken stream just ends, and `wait` says what happened)."""

    @abstractmethod
    def wait(self, timeout: float) -> ExitInfo:
        """The exit of the runtime (call after the stream ends, or after `kill`); never
        raises: an engine failure comes back as `ExitInfo.infra_error`."""

    @abstractmethod
    def recover_stdout(self) -> bytes:
        """All of stdout again, from the engine, for when the live stream broke (b"" if
        it cannot be had)."""

    @abstractmethod
    def kill(self) -> None:
        """Stop the runtime at once (no grace period); idempotent."""

    @abstractmethod
    def remove(self) -> None:
        """Remove the sandbox and whatever the backend made for it; idempotent."""

    def remove_sandbox_only(self) -> None:
        """Remove the sandbox itself and leave what the backend made beside it (network,
        egress proxy, model gateway) to a later `remove`; idempotent. By default the whole
        `remove`."""
        self.remove()

    def health(self) -> str | None:
        """None while the sandbox can work; else why not (say, its egress proxy is gone)."""
        return None

    def egress_blocked(self) -> list[dict[str, Any]]:
        """Connections the backend's egress control refused (host, port, method, reason)."""
        return []

    @property
    def model_api_base(self) -> str | None:
        """The `api_base` the runtime must use when the run has a gateway (after create)."""
        return None

    def gateway_events(self) -> list[dict[str, Any]]:
        """What the run's gateway reported since the last call (model calls, refusals,
        budget stops); empty without a gateway. Never raises."""
        return []

    def take(self, spec: SandboxSpec) -> None:
        """Hand a pooled sandbox (`Backend.create_idle`) to the run of `spec`, whose run id
        must be the sandbox's own. Raises ValueError otherwise."""
        raise ValueError("not a pooled sandbox")

    def close_gateway(self) -> None:
        """End the gateway's service (its token is refused from now on) and collect its
        last reports, so that `gateway_events` then holds everything; no-op without one."""
        return None  # noqa: B027 - optional part, no gateway by default


class Backend(ABC):
    """Where sandboxes run. Found by name through `orchestrator.backends.get_backend`."""

    name: str
    #: The most sandboxes this backend may have alive at once (None: no cap of its own);
    #: batch lowers its concurrency to it.
    max_concurrency: int | None = None

    @abstractmethod
    def prepare_image(self, extra_requirements: tuple[str, ...], progress: Progress) -> str:
        """Build or reuse the image (template) for a run; returns its reference.

        Raises `ImageBuildError` when it cannot be built, `EngineUnavailable` when the engine
        cannot be reached."""

    @abstractmethod
    def create(self, spec: SandboxSpec, progress: Progress) -> Sandbox:
        """Create (not start) a sandbox with the spec's limits, network and labels."""

    def create_idle(self, spec: SandboxSpec, progress: Progress, ttl: float) -> Sandbox:
        """A pooled sandbox: created as `create` does, then started with nothing in it; its
        runtime waits for a request (`Sandbox.start`) and stops by itself `ttl` seconds from
        now if none comes, even with no orchestrator process left. Raises
        NotImplementedError on backends without pools (they run cold)."""
        raise NotImplementedError(f"the {self.name} backend has no warm sandboxes")

    @abstractmethod
    def list_sandboxes(self, labels: dict[str, str]) -> list[SandboxInfo]:
        """Sandboxes (and helper containers/networks) carrying all of `labels`."""

    @abstractmethod
    def remove_sandbox(self, info: SandboxInfo) -> None:
        """Remove a sandbox found by `list_sandboxes`; gone already is fine."""
