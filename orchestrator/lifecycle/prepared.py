"""A run checked before anything starts: `prepare` reads and checks every input of a
`RunSpec` (manifest, model, task, limits, network, backend, gateway, secrets) into a
`PreparedRun`, or raises with the field at fault; nothing exists yet either way."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..backends import backend_capabilities, backend_name
from ..backends.base import check_sandbox_runtime
from ..defaults import choose_sandbox_runtime
from ..errors import ConfigError, ManifestError, at_field
from ..gateway import GatewaySpec, describe_gateway, plan_gateway, sandbox_network
from ..models import ModelSpec
from ..models.aws import CREDENTIAL_ENV, host_credentials
from ..payloads.agentnames import check_mock_scripts
from ..payloads.binding import SecretBinding
from ..payloads.manifest import Manifest, load_manifest
from ..payloads.program_models import choose_model, key_names, unused_model_env
from ..payloads.secrets import needed_secrets, run_secrets
from ..payloads.servers import check_servers
from ..payloads.shipped import ShippedFile, check_task
from ..policy import describe_allowlist, resolve_policy
from ..records.otlp import TraceTarget, trace_target
from ..records.store import new_run_id
from ..registry import DEFAULT_BACKEND
from ..spec import SETTABLE_LIMITS, Limits, NetworkPolicy, RunSpec
from .admission import (
    check_bound_network,
    check_bound_secrets,
    endpoint_on_host,
)


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
    #: Variables the models' clients read that are not secret (a Bedrock model's region; a
    #: program's Bedrock models need one to be made even when the run replaces them).
    client_env: dict[str, str] = field(default_factory=dict)

    @property
    def sandbox_network(self) -> NetworkPolicy:
        """What the sandbox itself may reach (with a gateway, not the model's endpoint)."""
        hosts = (*self.manifest.hosts, *self.spec.allow_hosts)
        return sandbox_network(self.network, self.gateway, hosts)

    @property
    def secrets_inside(self) -> tuple[str, ...]:
        """The secrets whose values the sandbox holds (the record and the start line say
        so): every one the run gets, but the model's key when a gateway holds it and the
        bound ones (the sandbox holds their placeholders)."""
        held = self.gateway.held if self.gateway else ()
        bound = {b.name for b in self.manifest.bindings}
        return tuple(n for n in self.secret_names if n not in held and n not in bound)

    @property
    def bindings(self) -> tuple[SecretBinding, ...]:
        """The bound secrets the backend's interceptor carries: the manifest's, but none in
        a check (`validate` ships placeholders and runs no step) or under `none` (nothing
        leaves the sandbox: its placeholder alone is inside, no interceptor is needed)."""
        if self.spec.check_only or self.network.mode != "allowlist":
            return ()
        return self.manifest.bindings

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


def load_payload(spec: RunSpec) -> tuple[Manifest, dict[str, ShippedFile]]:
    """The payload's manifest and the files it ships. Raises ManifestError for a manifest
    that grants imports which escape the inner executor (unless accepted by name), for
    files that cannot be shipped (links out, devices, FIFOs, sizes), and for source that
    starts an MCP server with a command the sandbox lacks (`npx`, `uvx`: servers.py)."""
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
    files = manifest.payload_files()
    check_servers(files, manifest.folder, "payload" if manifest.program is None else "program")
    return manifest, files


def choose_task(spec: RunSpec, manifest: Manifest) -> str:
    """The run's task: the spec's, else the payload's example (a program's own tasks stand
    unless the run gives one). Raises ConfigError (field `task`) when there is none, or
    when it breaks the task's limits."""
    task = spec.task if spec.task is not None else manifest.example_task
    if manifest.program is not None:
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
    return task


def host_aws_credentials(manifest: Manifest, skip: bool) -> dict[str, str]:
    """The host's AWS credentials for a Bedrock run's gateway (botocore's chain; none read
    when `skip`: a check or schedule validation). Raises ConfigError when there are none, or
    when the payload declares AWS credentials of its own: inside, those names hold the
    run's own credentials, which would shadow them."""
    own = [name for name in manifest.secrets if name in CREDENTIAL_ENV]
    if own:
        raise ConfigError(
            f"{manifest.path}: the payload declares {', '.join(own)} as its secret, and its "
            "Bedrock model's sandbox holds AWS credentials of the run's own under those "
            "names (the host's stay with the run's gateway). Nothing was started.",
            "Remove them from [secrets] required; the model signs through the gateway.",
        )
    return {} if skip else host_credentials()


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
        manifest, files = load_payload(spec)
    with at_field("model"):
        model, own_model = choose_model(spec, manifest)
    if not spec.check_only:  # `validate` reports it with what its load finds (cli/payload.py)
        with at_field("payload"):  # a mock script for no agent, when the source tells
            check_mock_scripts(manifest, files, model.provider)
    task = choose_task(spec, manifest)
    with at_field("limits"):
        overrides = {k: getattr(spec, k) for k in SETTABLE_LIMITS if getattr(spec, k) is not None}
        limits = replace(manifest.limits, **overrides)
        limits.validate(limits_from)
    with at_field("backend"):
        backend = backend_name(spec.backend, manifest)
        capabilities = backend_capabilities(backend)
    with at_field("payload"):  # bound secrets on a backend that cannot keep them out
        check_bound_secrets(backend, capabilities, manifest)
    with at_field("model"):  # an endpoint the backend's sandboxes cannot reach: refused here
        host_alias = endpoint_on_host(capabilities, model, backend)
    with at_field("network"):
        network = resolve_policy(
            spec.network,
            model=model,
            hosts=manifest.hosts,
            allow_hosts=spec.allow_hosts,
            host_alias=host_alias,
        )
    with at_field("network"):  # a bound secret needs the allowlist: never `open`
        check_bound_network(manifest, network)
    with at_field("model"):
        gateway, gateway_off = plan_gateway(
            enabled=spec.gateway,
            model=model,
            network=network,
            backend=backend,
            provision=capabilities.model_gateway,
            limits=limits,
        )
    with at_field("sandbox_runtime"):
        sandbox_runtime = choose_sandbox_runtime(spec.sandbox_runtime, manifest.sandbox_runtime)
        # a name the chosen backend does not offer: refused here, so schedule validation (which
        # only prepares) refuses it too; an engine without it is found when the run starts
        check_sandbox_runtime(
            backend, capabilities, sandbox_runtime, asked=bool(spec.sandbox_runtime)
        )
    with at_field("traces_to"):
        trace = None if spec.check_only else trace_target(spec.traces_to)
    needed = needed_secrets(manifest, own_model or model)
    with at_field("secrets"):
        secrets = run_secrets(
            needed,
            check_only=spec.check_only,
            values=secret_values,
            env_file=spec.env_file,
            placeholders=key_names(manifest.model_uses)
            if own_model is None or spec.check_only
            else (),
        )
    client_env = model.client_env
    if own_model is None or spec.check_only:  # the program's models are made, never called
        client_env = {**unused_model_env(manifest.model_uses), **client_env}
    if gateway is not None and gateway.aws is not None:
        with at_field("secrets"):
            signing = host_aws_credentials(manifest, spec.check_only or not secret_values)
        secrets.update(signing)
        needed += [name for name in signing if name not in needed]
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
        client_env=client_env,
    )
