"""The one small interface every sandbox backend implements, and what a backend can do.

A *backend* decides where a sandbox runs (Docker, E2B, or one a package registers); the runner
decides what runs in it. Policies (limits, network, labels) are plain data; each backend
renders them into its own options. No code outside `backends/` asks which backend it has by
name; it asks in one of two ways:

- `Capabilities`, data on the backend's *class* (never replaced per instance), so that they
  are known before a backend is made (`backends.backend_capabilities`). What depends on a
  made backend's settings is a property of the instance (`Backend.max_concurrency`).
- optional parts, each a small ABC a backend class also derives from and the caller checks
  with `isinstance` (or `issubclass` on the class, before one is made): `WarmSandboxes`
  (pooled sandboxes) and `ImageStore` (its images listed, pruned, a base bootstrapped).

Whether a run may go ahead on a backend (bound secrets, an endpoint its sandboxes can reach)
is decided while the run is prepared (`lifecycle/admission.py`), from these declarations.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ..errors import ConfigError
from ..gateway import GatewayProvision, GatewaySpec
from ..images.imagedef import Progress as Progress  # its one home; backends' API
from ..labels import LABEL_OWNER, LABEL_RUN_ID, LABEL_WARM
from ..schema import did_you_mean, words
from ..spec import Limits, NetworkPolicy

if TYPE_CHECKING:
    from orchestrator_runtime.request import Request

    from ..payloads.binding import BoundSecret, SecretBinding

StreamName = Literal["stdout", "stderr"]


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do beyond the required methods, declared as data on its class (and
    read without making one: `backends.backend_capabilities`). Code outside `backends/`
    decides by these, never by a backend's name."""

    #: How a run's model gateway is provided: "none" (a hosted-model run is refused unless
    #: it opts out with --no-gateway, which puts the key into the sandbox, masked in the
    #: record), "sidecar" (a container of its own on the run's private network) or "sandbox"
    #: (a sandbox of its own, reached through the backend's per-port host name); with one,
    #: the sandbox holds a run token (`gateway.plan_gateway`, `Sandbox.gateway`).
    model_gateway: GatewayProvision = "none"
    #: Where its sandboxes run: "this_host" (a model endpoint on this host is reached as
    #: `policy.HOST_ALIAS`) or "elsewhere" (E2B's cloud: an endpoint on this host, a loopback
    #: or private address is refused before anything starts, `admission.endpoint_on_host`).
    sandboxes_run: Literal["this_host", "elsewhere"] = "this_host"
    #: For "elsewhere": the environment variable that, set to 1, says its sandboxes reach
    #: this host after all (a local or self-hosted deployment); endpoints are used as given.
    local_endpoints_env: str | None = None
    #: A run's `memory_mb` and `cpus` limits are enforced on its sandbox (without: the
    #: sandbox has what the backend gives every sandbox).
    resource_limits: bool = False
    #: Connections refused by the run's egress control come back from
    #: `Sandbox.egress_blocked` (recorded as `egress_blocked` events).
    egress_events: bool = False
    #: Any command may make this backend on its own to remove what a dead run left
    #: (`cleanup.tidy`: local and cheap, as Docker is). Without, only `orchestrator cleanup
    #: --backend NAME` does, and `orphans_end` says what ends such a sandbox meanwhile.
    removes_orphans: bool = False
    #: What ends a dead run's sandbox that no command removed (said in the run's record).
    orphans_end: str = "its sandbox ends with its own lifetime"
    #: The sandbox runtimes a run may ask for besides `auto` (`--sandbox-runtime`, the config
    #: file, a manifest, a schedule), each a kernel or isolation the backend can place a
    #: sandbox on (Docker: runsc, runc; a Kubernetes RuntimeClass such as kata). Empty: the
    #: backend's own isolation only, and a machine's or payload's choice does not apply.
    sandbox_runtimes: tuple[str, ...] = ()
    #: Secrets bound to hosts (`[secrets.bind]`) are kept out of the sandbox: it holds a
    #: placeholder, and an intercepting proxy on its egress path puts the value on the wire
    #: only for the bound hosts. Without: a run with bindings is refused before anything
    #: starts (exit 2), never run with the value inside (`admission.check_bound_secrets`).
    bound_secrets: bool = False


#: The sandbox runtime every backend accepts: its best isolation.
AUTO_RUNTIME = "auto"


def check_sandbox_runtime(
    backend: str, capabilities: Capabilities, runtime: str, *, asked: bool = True
) -> None:
    """Raise ConfigError (exit 2) unless `runtime` is `auto` or one the backend offers
    (`Capabilities.sandbox_runtimes`), naming the allowed ones: the names belong to the
    backend, so only it can tell a typo. `asked`: the run named it; a machine's or a
    payload's choice is ignored by a backend without a choice (it was meant for another)."""
    offered = capabilities.sandbox_runtimes
    if runtime == AUTO_RUNTIME or runtime in offered:
        return
    if not offered:
        if asked:
            raise ConfigError(
                f"The {backend} backend has no choice of sandbox runtime (asked for {runtime}).",
                "Leave the sandbox runtime at auto for this backend (--sandbox-runtime auto).",
            )
        return
    allowed = (AUTO_RUNTIME, *offered)
    hint = did_you_mean(runtime, allowed) or "."
    raise ConfigError(
        f"Unknown sandbox runtime {runtime!r} for the {backend} backend{hint}",
        f"Use one of {words(allowed)}.",
    )


class GatewayHandle(ABC):
    """A run's model gateway, as the runner uses it (`Sandbox.gateway`): present only on a
    sandbox whose backend provides one (`Capabilities.model_gateway`)."""

    @property
    @abstractmethod
    def api_base(self) -> str:
        """The `api_base` the runtime must use: the gateway, in place of the model's
        endpoint."""

    @abstractmethod
    def open(self, key: str | None) -> None:
        """Hand the gateway the model's real key (the sandbox never holds it); call before
        `Sandbox.start`. Raises the engine's errors if it cannot be reached."""

    @abstractmethod
    def events(self) -> list[dict[str, Any]]:
        """What the gateway reported since the last call (model calls, refusals, budget
        stops). Never raises."""

    @abstractmethod
    def close(self) -> None:
        """End the gateway's service (the run's token is refused from now on) and collect
        its last reports, so that `events` then holds everything."""


class SecretsProxyHandle(ABC):
    """A run's secret interceptor, as the runner uses it (`Sandbox.secrets_proxy`): present
    only on a sandbox whose backend binds secrets (`Capabilities.bound_secrets`) and whose
    run has bindings (`SandboxSpec.bindings`)."""

    @abstractmethod
    def open(self, bound: tuple[BoundSecret, ...], passthrough: tuple[str, ...] = ()) -> str:
        """Hand the interceptor the bound secrets, values included (the sandbox holds only
        their placeholders), and the hosts whose TLS it relays unread (`passthrough`: no
        secret is bound to one), and wait until it listens; returns the run's CA certificate
        (PEM), which the sandbox must trust. Call before `Sandbox.start`. Raises
        OrchestratorError when it will not start."""

    @abstractmethod
    def injections(self) -> list[dict[str, Any]]:
        """Where each secret's value went on the wire so far, one entry per secret, host and
        place: `{"secret", "host", "place", "count", "first_ts"}`; never a value. Never
        raises."""


@dataclass(frozen=True)
class SandboxSpec:
    """Everything a backend needs to start one sandbox for one run."""

    run_id: str
    image: str
    command: tuple[str, ...]
    limits: Limits
    network: NetworkPolicy
    labels: dict[str, str] = field(default_factory=dict)
    #: The run's model gateway, for backends that provide one; None: no gateway.
    gateway: GatewaySpec | None = None
    #: The sandbox runtime asked for (`auto` or one of `Capabilities.sandbox_runtimes`),
    #: checked by `Backend.check_runtime`; `auto`: the backend's best.
    runtime: str = "auto"
    #: Secrets bound to hosts (`[secrets.bind]`, names and hosts, no values): the backend
    #: puts its secret interceptor on the sandbox's egress path (`Sandbox.secrets_proxy`).
    #: Empty: no interceptor, and no cost.
    bindings: tuple[SecretBinding, ...] = ()


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
    #: The run's model gateway, when the backend provides one (`Capabilities.model_gateway`)
    #: and the run has one; None otherwise.
    gateway: GatewayHandle | None = None
    #: The run's secret interceptor, when the run binds secrets (`SandboxSpec.bindings`);
    #: None otherwise.
    secrets_proxy: SecretsProxyHandle | None = None
    #: What isolates the sandbox from the host, for the run record: its `runtime` (the
    #: kernel its system calls reach), what filters them (`seccomp`), what holds it to its
    #: process limit (`pids`) and, for a sandbox restored from a snapshot, its id
    #: (`snapshot`); empty when the backend does not say.
    isolation: dict[str, str] = {}  # read-only default; set per instance

    @abstractmethod
    def start(self, request: Request, secrets: dict[str, str]) -> None:
        """Start the runtime and hand it the run request and the run's secrets.

        Each backend ships them its own way (Docker: one JSON object on stdin; E2B: the request
        as an uploaded file, the secrets as the command's environment), never through the
        sandbox's configuration or an image. A gateway is opened first (`GatewayHandle.open`).
        Raises the engine's errors if it cannot start.
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
        egress proxy, model gateway) to a later `remove`, which a pool does in the
        background; idempotent. By default the whole `remove` (nothing beside it)."""
        self.remove()

    def health(self) -> str | None:
        """None while the sandbox can work; else why not (say, its egress proxy is gone)."""
        return None

    def egress_blocked(self, *, final: bool = False) -> list[dict[str, Any]]:
        """Connections the backend's egress control saw fail, in order, all of them at each
        call (the caller keeps its place; called while the run goes on): host, port, method,
        `ts`, `verdict` (`denied`: refused; `allowed`: failed upstream) and `reason` (the
        cause); empty unless `Capabilities.egress_events`. `final`: the run's last look, once
        the sandbox has ended or been killed; the backend may end its egress control first
        so that every attempt is in."""
        return []

    def take(self, spec: SandboxSpec) -> None:
        """Hand a pooled sandbox (`WarmSandboxes.create_idle`) to the run of `spec`, whose run id
        must be the sandbox's own. Raises ValueError otherwise."""
        raise ValueError("not a pooled sandbox")


class HostProblem(Exception):
    """A promise of the host's configuration broken: what was seen, and what to do."""

    def __init__(self, detail: str, fix: str) -> None:
        super().__init__(detail)
        self.detail = detail
        self.fix = fix


@dataclass(frozen=True)
class HostCheck:
    """A promise of the host's configuration a backend checks without a run (`orchestrator
    doctor`, before the kit's runs): `function` judges the backend's facts about its host
    (`Backend.host_facts`, passed as data so that a test can hand it a double), returns what
    it saw, and raises HostProblem when the promise is broken."""

    name: str
    promise: str
    function: Callable[[dict[str, Any]], str]


class Backend(ABC):
    """Where sandboxes run. Found by name through `orchestrator.backends.get_backend`, which
    makes one with `create_backend`; a package registers its subclass under the entry-point
    group `orchestrator.backends` (docs/ARCHITECTURE.md, "Adding a backend").

    Required (abstract): `prepare_image`, `create`, `list_sandboxes`, `remove_sandbox`. The
    rest have defaults; pooling and image storage are optional parts (`WarmSandboxes`,
    `ImageStore`), declared by deriving from them."""

    name: str
    #: What it can do; a class attribute, known before one is made (never set per instance).
    capabilities: Capabilities = Capabilities()
    #: What `orchestrator doctor` checks of the host's configuration for this backend, besides
    #: the kit's runs (a class attribute: the names are known before one is made).
    host_checks: tuple[HostCheck, ...] = ()

    @classmethod
    def create_backend(cls, env_file: str | Path | None = None) -> Backend:
        """A backend ready to use, with its settings from the environment (and `env_file`).
        Raises ConfigError for bad or missing settings, EngineUnavailable when its engine
        or API cannot be reached."""
        return cls()

    @property
    def max_concurrency(self) -> int | None:
        """The most sandboxes this backend may have alive at once, from its settings (None:
        no cap of its own); batch lowers its concurrency to it."""
        return None

    def check_runtime(self, runtime: str, *, asked: bool = True) -> None:
        """Raise ConfigError unless this backend's sandboxes can run on `runtime` (called
        before anything of a run starts). `asked`: the run named it (not the machine's
        default or the payload's). By default: `auto` or one of
        `Capabilities.sandbox_runtimes` (`check_sandbox_runtime`); a backend whose runtimes
        depend on its engine checks that too."""
        check_sandbox_runtime(self.name, self.capabilities, runtime, asked=asked)

    @abstractmethod
    def prepare_image(self, extra_requirements: tuple[str, ...], progress: Progress) -> str:
        """Build or reuse the image (template) for a run; returns its reference.

        Raises `ImageBuildError` when it cannot be built, `EngineUnavailable` when the engine
        cannot be reached."""

    @abstractmethod
    def create(self, spec: SandboxSpec, progress: Progress) -> Sandbox:
        """Create (not start) a sandbox with the spec's limits, network and labels."""

    @abstractmethod
    def list_sandboxes(self, labels: dict[str, str]) -> list[SandboxInfo]:
        """Sandboxes (and helper containers/networks) carrying all of `labels`."""

    @abstractmethod
    def remove_sandbox(self, info: SandboxInfo) -> None:
        """Remove a sandbox found by `list_sandboxes`; gone already is fine."""

    def remove_run(self, run_id: str) -> SandboxInfo | None:
        """Remove everything of one run (a dead one's, say); returns its sandbox as found
        (with how it ended, where the backend can tell), None if there was none. Raises the
        engine's errors when nothing can be listed."""
        sandbox = None
        for info in self.list_sandboxes({LABEL_RUN_ID: run_id}):
            if info.kind == "sandbox":
                sandbox = info
            with contextlib.suppress(Exception):  # gone already, or the engine hiccuped
                self.remove_sandbox(info)
        return sandbox

    def host_facts(self) -> dict[str, Any]:
        """What `host_checks` judge (for an engine: its own description of itself). Raises
        the engine's errors when it cannot be asked."""
        return {}

    def build_image(
        self, base: str | None, extra_requirements: tuple[str, ...], progress: Progress
    ) -> str:
        """`orchestrator images build`: the run image (on `base`, else the configured one);
        returns its reference. Raises as `prepare_image`, and ConfigError for a `base` on a
        backend that takes none."""
        if base is not None:
            raise ConfigError(
                f"The {self.name} backend builds on no other base image (--base {base}).",
                "Leave out --base.",
            )
        return self.prepare_image(extra_requirements, progress)


class WarmSandboxes(Backend):
    """The optional part of a backend that makes pooled sandboxes: `pool.Pool` keeps them
    warm for batch, schedules and the Python API (a backend without it: every run is cold).
    Its sandboxes implement `Sandbox.take`."""

    @abstractmethod
    def create_idle(self, spec: SandboxSpec, progress: Progress, ttl: float) -> Sandbox:
        """A pooled sandbox: created as `create` does, then started with nothing in it; its
        runtime waits for a request (`Sandbox.start`) and stops by itself `ttl` seconds from
        now if none comes, even with no orchestrator process left."""

    def remove_idle(self, owner: str) -> None:
        """Remove the pooled sandboxes of the pool process `owner` (a dead one's). Raises the
        engine's errors when nothing can be listed."""
        for info in self.list_sandboxes({LABEL_OWNER: owner, LABEL_WARM: "true"}):
            self.remove_sandbox(info)

    def starts_per_core(self, spec: SandboxSpec) -> int:
        """How many of `spec`'s sandboxes a pool makes at once per core, so that its makings
        alone keep the CPU full (runs wait for them on a full CPU): one where a start is
        mostly CPU (more at once only contend for it), more where a start also waits."""
        return 1


class ImageStore(Backend):
    """The optional part of a backend that keeps its images itself (an engine's image store):
    `orchestrator images list/prune/bootstrap-base --backend NAME` (a backend without it: they
    are refused, exit 2)."""

    @abstractmethod
    def list_images(self) -> list[dict[str, Any]]:
        """Its images: each `{tag, id, kind, created (ISO 8601), size (bytes), in_use,
        labels}`, newest first."""

    @abstractmethod
    def prune_images(self, *, dry_run: bool = False) -> list[str]:
        """Remove its images that are no longer current; returns what went (or would go)."""

    @abstractmethod
    def bootstrap_base(self, *, suite: str, mirror: str, progress: Progress) -> str:
        """Make a base image without a registry; returns its reference."""
