"""The model gateway, backend-neutral: when a run gets one, what the sandbox then holds, and
what the host makes of the gateway's account.

A run whose model talks HTTP gets a per-run gateway by default (a sidecar container;
E2B: a sandbox of its own), and a backend that provides none refuses such a run unless it
says --no-gateway: the sandbox holds a random run token in place of the key and reaches the
model only through the gateway, which swaps the token for the key, forwards, measures every
call and keeps the run's budget (`orchestrator_runtime/gateway/`). The backend starts it
(`backends/docker/gateway.py`, `backends/e2b/gateway.py`); this module holds the rules.

A Bedrock model's client signs its calls (AWS SigV4) instead of sending a key: its sandbox
holds AWS credentials of the run's own (`models.aws.RunSigning`) in place of the run token,
and the gateway holds the host's AWS credentials, as botocore's chain found them.
"""

from __future__ import annotations

import json
import secrets as random_tokens
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from .errors import ConfigError
from .models import ModelSpec
from .models.aws import CREDENTIAL_ENV, RunSigning, gateway_key
from .policy import HOST_ALIAS, is_this_host
from .registry import DEFAULT_BACKEND
from .spec import Limits, NetworkPolicy

#: Where Hugging Face's router serves its OpenAI-compatible API (the `hf` provider's upstream
#: when no --api-base is given).
HF_ROUTER = "https://router.huggingface.co/v1"

#: How a backend provides a run's gateway (its `Capabilities.model_gateway`): "none";
#: "sidecar", a container of its own on the run's private network that the sandbox reaches;
#: "sandbox", a sandbox of its own that the run's sandbox reaches through the backend's
#: per-port host name (E2B).
GatewayProvision = Literal["none", "sidecar", "sandbox"]


@dataclass(frozen=True)
class GatewaySpec:
    """One run's gateway, as a backend starts it (the key goes in only at start)."""

    #: The real endpoint, as the gateway reaches it (a server on this host under
    #: `HOST_ALIAS`, which the backend maps to the host).
    upstream: str
    token: str
    max_calls: int
    max_tokens: int
    #: The credential's environment variable (its value is the key the gateway holds).
    credential_env: str | None
    #: The endpoint is a server on this machine, the host the sandboxes run on (`upstream`
    #: names it as `HOST_ALIAS`): the backend lets the gateway reach the host.
    on_this_host: bool = False
    #: What the model's client library said of its endpoint (provider, protocol, upstream
    #: host, key header), for the record; empty when the run named the endpoint.
    route: dict[str, str | None] = field(default_factory=dict)
    #: A signing model's (Bedrock's): the region the calls are signed for and the run's own
    #: AWS credentials, which the sandbox signs with; the host's go to the gateway.
    aws: RunSigning | None = None

    @property
    def held(self) -> tuple[str, ...]:
        """The secrets the gateway holds in the sandbox's place (their values never enter
        it): the model's key, or the host's AWS credentials."""
        if self.aws is not None:
            return CREDENTIAL_ENV
        return (self.credential_env,) if self.credential_env else ()

    def describe(self) -> dict[str, Any]:
        """For the run record (no token, no key: the key's variable by name only)."""
        signed = {"signing": f"AWS SigV4, {self.aws.region}"} if self.aws else {}
        return {
            "enabled": True,
            "upstream": self.upstream,
            "max_model_calls": self.max_calls,
            "max_tokens": self.max_tokens,
            "key_from": "the host's AWS credentials" if self.aws else self.credential_env,
            **self.route,
            **signed,
        }

    def stdin_config(self, key: str | None, clients: list[str], port: int) -> dict[str, Any]:
        """The configuration a backend hands the gateway on its stdin (`key`: the real key;
        `clients`: the address ranges it answers; `port`: where it listens)."""
        config: dict[str, Any] = {
            "token": self.token,
            "key": key,
            "upstream": self.upstream,
            "clients": clients,
            "max_calls": self.max_calls,
            "max_tokens": self.max_tokens,
            "port": port,
        }
        if self.aws is not None:
            config["signing"] = self.aws.gateway_config()
        return config


def plan_gateway(
    *,
    enabled: bool,
    model: ModelSpec,
    network: NetworkPolicy,
    backend: str,
    provision: GatewayProvision,
    limits: Limits,
) -> tuple[GatewaySpec | None, str | None]:
    """The run's gateway, or None and why not (for the record). `provision`: how the run's
    backend (named `backend`, for the record) provides one.

    Raises ConfigError when the gateway should serve the model but cannot (a backend without
    one, or a LiteLLM model with no --api-base, which has no single endpoint to forward to):
    fail closed, `--no-gateway` opts out by name.
    """
    if not model.needs_network:
        return None, "the mock model makes no network calls"
    if not enabled and model.aws_signed:
        raise ConfigError(
            f"The Bedrock model {model.model_id!r} is served only through the run's model "
            "gateway: the host's AWS credentials never go into a sandbox, so --no-gateway "
            "cannot put them there. Nothing was started.",
            "Run without --no-gateway (the sandbox then signs with credentials of the run's "
            "own, and the gateway signs with this host's).",
        )
    if not enabled:
        return None, "turned off with --no-gateway: the model key is in the sandbox"
    if model.aws_signed and model.aws_region is None:
        model = model.on_bedrock()  # its region and endpoint, as the host's botocore says
    if network.mode == "none":
        return None, "the run has no network (--network none)"
    if provision == "none":
        raise ConfigError(
            f"The {backend} backend cannot give the run a model gateway, so the key of the "
            f"{model.provider} model would go into the sandbox, where any code the agents run "
            "can read it. Nothing was started.",
            f"Run on a backend with a gateway (--backend {DEFAULT_BACKEND}), or put the key "
            "into the sandbox knowingly with --no-gateway (no host-measured tokens, no budget).",
        )
    upstream = model.api_base or (HF_ROUTER if model.provider == "hf" else None)
    if upstream is None:
        raise ConfigError(
            f"The model gateway needs the endpoint of the {model.provider} model "
            f"{model.model_id!r}, and there is none.",
            "Pass --api-base with the provider's base URL (the gateway forwards there).",
        )
    parts = urlsplit(upstream)
    on_host = bool(network.host_endpoints) and is_this_host(parts.hostname or "")
    if on_host:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        upstream = urlunsplit(parts._replace(netloc=f"{HOST_ALIAS}:{port}"))
    gateway = GatewaySpec(
        upstream=upstream.rstrip("/"),
        token=random_tokens.token_urlsafe(32),
        max_calls=limits.max_model_calls,
        max_tokens=limits.max_tokens,
        credential_env=model.credential_env,
        on_this_host=on_host,
        route=model.upstream.describe() if model.upstream else {},
        aws=RunSigning.new(model.aws_region) if model.aws_region and model.aws_signed else None,
    )
    return gateway, None


def sandbox_network(
    network: NetworkPolicy, gateway: GatewaySpec | None, payload_hosts: tuple[str, ...]
) -> NetworkPolicy:
    """What the sandbox itself may reach. With a gateway, the model's endpoint and its
    provider's hosts leave the allowlist (only the gateway reaches them); the hosts the
    payload and --allow-host listed stay. An allowlist left empty needs no egress proxy."""
    if gateway is None or network.mode != "allowlist":
        return network
    hosts = tuple(dict.fromkeys(h.lower() for h in payload_hosts))
    return NetworkPolicy(mode="allowlist", hosts=hosts)


def starting_line(gateway: GatewaySpec) -> str:
    """The progress line a backend says as it starts a run's gateway: what it is for."""
    parts = urlsplit(gateway.upstream)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return (
        f"starting the run's model gateway to {parts.hostname}:{port} (the model key stays "
        "with it, outside the sandbox, which gets a run token)"
    )


def describe_gateway(gateway: GatewaySpec) -> str:
    """The model endpoint as an allowlist entry of the record."""
    parts = urlsplit(gateway.upstream)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    where = " on the Docker host" if gateway.on_this_host else ""
    return f"{parts.hostname}:{port} (the model, through the run's gateway{where})"


def sandbox_secrets(
    secrets: dict[str, str], gateway: GatewaySpec | None
) -> tuple[dict[str, str], str | None]:
    """The secrets the sandbox gets, and the key the gateway gets: with a gateway, the
    model's credential is replaced by the run token and never enters the sandbox; a signing
    gateway's sandbox gets the run's own AWS credentials, and the gateway the host's (as
    one JSON key), which never enter it."""
    if gateway is not None and gateway.aws is not None:
        inside = {k: v for k, v in secrets.items() if k not in CREDENTIAL_ENV}
        return {**inside, **gateway.aws.sandbox_env()}, gateway_key(secrets)
    if gateway is None or gateway.credential_env is None:
        return dict(secrets), None
    key = secrets.get(gateway.credential_env)
    return {**secrets, gateway.credential_env: gateway.token}, key


def measured_usage(events: list[dict[str, Any]]) -> dict[str, int]:
    """Token usage summed from the gateway's `model_call` events (host-side records)."""
    calls = [e for e in events if e.get("type") == "model_call" and e.get("source") == "gateway"]
    input_tokens = sum(int(e.get("input_tokens") or 0) for e in calls)
    output_tokens = sum(int(e.get("output_tokens") or 0) for e in calls)
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "total_tokens": input_tokens + output_tokens,
    }


def usage_mismatch(measured: dict[str, int], reported: dict[str, Any]) -> bool:
    """True when the sandbox claimed figures other than those measured (a sandbox that
    reported nothing claims nothing)."""
    for name in ("input_tokens", "output_tokens"):
        claimed = reported.get(name)
        if claimed is not None and claimed != measured.get(name):
            return True
    return False


def read_report(line: str) -> dict[str, Any] | None:
    """One line of the gateway's stdout as its report (a JSON object with a string `type`),
    or None for anything else: the gateway's output is read, never trusted to be well formed."""
    try:
        report = json.loads(line)
    except ValueError:
        return None
    if not isinstance(report, dict) or not isinstance(report.get("type"), str):
        return None
    return report
