"""The one small interface every sandbox backend implements.

A *backend* decides where a sandbox runs (Docker, E2B); the runner decides what runs in it.
Policies (limits, network, labels) are plain data here; each backend renders them into its
own options.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from ..manifest import Limits

Progress = Callable[[str], None]
StreamName = Literal["stdout", "stderr"]


@dataclass(frozen=True)
class NetworkPolicy:
    """Where a sandbox may connect. `mode` is `none`, `allowlist` or `open`."""

    mode: Literal["none", "allowlist", "open"] = "none"
    #: Allowed host names (`api.example.com`, `*.example.com`) on ports 80 and 443.
    hosts: tuple[str, ...] = ()
    #: A model endpoint on the Docker host itself (`host:port`), reachable only if named.
    host_endpoints: tuple[tuple[str, int], ...] = ()
    #: Further exact `(host, port)` pairs, e.g. a model server on a port other than 80/443.
    endpoints: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class SandboxSpec:
    """Everything a backend needs to start one sandbox for one run."""

    run_id: str
    image: str
    command: tuple[str, ...]
    limits: Limits
    network: NetworkPolicy
    labels: dict[str, str] = field(default_factory=dict)
    #: Non-secret environment only: secrets travel through stdin, never here.
    env: dict[str, str] = field(default_factory=dict)


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


class Sandbox(Protocol):
    id: str

    def start(self, request: dict[str, Any], secrets: dict[str, str]) -> None:
        """Start the runtime and hand it the run request and the run's secrets.

        Each backend ships them its own way (Docker: one JSON object on stdin; E2B: the request
        as an uploaded file, the secrets as the command's environment), never through the
        sandbox's configuration or an image.
        """

    def stream(self) -> Iterator[tuple[StreamName, bytes]]:
        """Output chunks as they come, until the runtime's output ends."""

    def wait(self, timeout: float) -> ExitInfo:
        """The exit of the runtime (call after the stream ends, or after `kill`)."""

    def recover_stdout(self) -> bytes:
        """All of stdout again, from the engine, for when the live stream broke."""

    def kill(self) -> None:
        """Stop the runtime at once (no grace period)."""

    def remove(self) -> None:
        """Remove the sandbox and whatever the backend made for it; idempotent."""


class Backend(Protocol):
    name: str

    def prepare_image(self, extra_requirements: tuple[str, ...], progress: Progress) -> str:
        """Build or reuse the image (template) for a run; returns its reference."""

    def create(self, spec: SandboxSpec, progress: Progress) -> Sandbox:
        """Create (not start) a sandbox with the spec's limits, network and labels."""

    def list_sandboxes(self, labels: dict[str, str]) -> list[SandboxInfo]:
        """Sandboxes (and helper containers/networks) carrying all of `labels`."""

    def remove_sandbox(self, info: SandboxInfo) -> None:
        """Remove a sandbox found by `list_sandboxes`."""
