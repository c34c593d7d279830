"""What a prepared run's sandbox is asked for: its `SandboxSpec` (image, command, limits,
network, labels, gateway, runtime), the runtime's command line, and the request the runtime
reads (docs/PROTOCOL.md). Plain functions of a `PreparedRun`; pools key sandboxes by them."""

from __future__ import annotations

from orchestrator_runtime.protocol import PRELOAD_TRACES, RESULT_PATH, model_client_module
from orchestrator_runtime.request import Request

from ..backends.base import SandboxSpec
from ..labels import run_labels
from ..policy import sandbox_api_base
from ..records.traces import trace_request
from .prepared import PreparedRun

RUNTIME_COMMAND = ("python", "-m", "orchestrator_runtime")


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
        bindings=prepared.bindings,
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


def build_request(
    prepared: PreparedRun, *, api_base: str | None = None, trust_ca: str = ""
) -> Request:
    """What the runtime is asked to do (docs/PROTOCOL.md), without the secrets: the backend
    adds those its own way (`Sandbox.start`) and ships the request. `api_base`: the run's
    model gateway, which then stands in for the model's endpoint. `trust_ca`: the run's
    secret interceptor's CA (PEM), trusted by the sandbox before the payload starts."""
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
        # A Bedrock model without a gateway (no network) has no credentials inside at all.
        credential_env=None
        if model.aws_signed and prepared.gateway is None
        else model.credential_env,
        options=dict(model.options),
        endpoint_env=list(model.endpoint_env),
        model_env=prepared.client_env,
        model_source=prepared.model_source,
        mock_scripts=manifest.mock_scripts if model.provider == "mock" else {},
        result_path=RESULT_PATH,
        check_only=prepared.spec.check_only,
        trace=trace_request(prepared.run_id, prepared.trace),
        trust_ca=trust_ca,
    )
