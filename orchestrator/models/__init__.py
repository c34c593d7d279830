"""Model providers: parse `--model`, know each provider's credential and network endpoint."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

from orchestrator_runtime.protocol import PROVIDERS as RUNTIME_PROVIDERS

from ..errors import ConfigError
from .aws import AWS_NO_INSTANCE_ROLE, ENDPOINT_ENV, REGION_ENV, bedrock_endpoint, host_region


@dataclass(frozen=True)
class Provider:
    """What the host must know about a provider; the runtime builds the actual model."""

    name: str
    credential_env: str | None
    default_api_base: str | None
    default_model_id: str
    extra_requirements: tuple[str, ...] = ()
    summary: str = ""
    #: Hosts its client reaches when no api_base is given (the `allowlist` policy's share).
    hosts: tuple[str, ...] = ()
    #: Its client signs each call with AWS credentials (SigV4) instead of sending a key: the
    #: host's credentials come from botocore's chain and stay with the run's gateway
    #: (`models/aws.py`); `credential_env` names only the variable the sandbox's stand-in is in.
    aws_signed: bool = False


#: What the host knows of each provider the runtime can build (orchestrator_runtime.protocol).
PROVIDERS: dict[str, Provider] = {
    p.name: p
    for p in (
        Provider(
            "mock",
            None,
            None,
            "scripted",
            summary="plays the payload's [mock.scripts]; no network",
        ),
        Provider(
            "openai",
            "OPENAI_API_KEY",
            "https://api.openai.com/v1",
            "gpt-4o-mini",
            summary="OpenAIServerModel: OpenAI or any compatible server (llama.cpp, vLLM, Ollama)",
        ),
        # No default api_base: the runtime would take it for the model (an endpoint URL).
        # huggingface_hub asks huggingface.co which provider serves the model, then calls
        # the router.
        Provider(
            "hf",
            "HF_TOKEN",
            None,
            "Qwen/Qwen2.5-Coder-32B-Instruct",
            summary="InferenceClientModel (Hugging Face Inference Providers)",
            hosts=("router.huggingface.co", "huggingface.co"),
        ),
        Provider(
            "litellm",
            "LITELLM_API_KEY",
            None,
            "gpt-4o-mini",
            extra_requirements=("litellm",),
            summary="LiteLLMModel (optional; adds litellm to the image)",
        ),
        Provider(
            "bedrock",
            "AWS_SECRET_ACCESS_KEY",
            None,
            "anthropic.claude-3-haiku-20240307-v1:0",
            summary="AmazonBedrockModel (Amazon Bedrock's converse; the host's AWS "
            "credentials stay with the run's gateway)",
            aws_signed=True,
        ),
    )
}
if tuple(PROVIDERS) != RUNTIME_PROVIDERS:  # the names are the runtime's; this adds host facts
    raise RuntimeError(f"host providers {tuple(PROVIDERS)} != runtime's {RUNTIME_PROVIDERS}")


@dataclass(frozen=True)
class Upstream:
    """Where one model's calls go and how they carry its key, as its client library says."""

    #: LiteLLM's name of the provider (`anthropic`, `gemini`, `groq`, ...).
    provider: str
    #: The provider's base URL (the gateway's upstream): the client appends `path` to it.
    base: str
    #: The path (and query) the client posts a chat to, after its base: the protocol.
    path: str
    #: The header the client puts its key in (`authorization` as Bearer, `x-api-key`, ...).
    key_header: str | None
    #: The variable the client reads its key from when given none.
    key_env: str | None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Upstream:
        """From the probe's answer or the cache. Raises ValueError for a wrong shape."""
        provider, base, path = data.get("provider"), data.get("base"), data.get("path")
        if not (isinstance(provider, str) and isinstance(base, str) and isinstance(path, str)):
            raise ValueError("provider, base and path must be strings")
        header, key_env = data.get("key_header"), data.get("key_env")
        return cls(
            provider=provider,
            base=base,
            path=path,
            key_header=header if isinstance(header, str) else None,
            key_env=key_env if isinstance(key_env, str) else None,
        )

    @property
    def protocol(self) -> str:
        """The protocol, named by the call the client makes (`POST /v1/messages`)."""
        return f"POST {self.path.split('?')[0]}"

    def describe(self) -> dict[str, str | None]:
        """For the run record."""
        return {
            "provider": self.provider,
            "protocol": self.protocol,
            "upstream_host": urlsplit(self.base).hostname,
            "key_header": self.key_header,
        }


@dataclass(frozen=True)
class ModelSpec:
    """A model as the runtime will build it: `provider:model_id` plus endpoint and options."""

    provider: str
    model_id: str
    api_base: str | None = None
    credential_env: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    #: The program's own model class when a program chose this model (program.py); None
    #: when the run chose it (--model, a payload's model).
    program_class: str | None = None
    #: Where the model's own client sends its calls when the run named no endpoint, as its
    #: client library says (a LiteLLM provider's base URL, protocol and key header):
    #: `payloads.upstreams.own_endpoint`.
    upstream: Upstream | None = None
    #: Variables a program reads its models' endpoint from (`os.getenv("X")`, or the one
    #: its client reads): inside the sandbox each holds the endpoint the run gives it.
    endpoint_env: tuple[str, ...] = ()
    #: A Bedrock model's AWS region (the program's `region_name`, else the host's): where
    #: its calls go and what they are signed for.
    aws_region: str | None = None

    def chosen_by_program(self, cls: str) -> ModelSpec:
        """This model as the one a program's `cls` makes (kept in the sandbox, served by
        the run's gateway)."""
        return replace(self, program_class=cls)

    @property
    def endpoint(self) -> tuple[str, int] | None:
        """The (host, port) the sandbox must reach for this model, or None (mock)."""
        if not self.api_base:
            return None
        parts = urlsplit(self.api_base)
        default_port = 443 if parts.scheme == "https" else 80
        return (parts.hostname or "", parts.port or default_port)

    @property
    def hosts(self) -> tuple[str, ...]:
        """Hosts the provider's client reaches by default (when no api_base is given)."""
        return () if self.api_base else PROVIDERS[self.provider].hosts

    @property
    def extra_requirements(self) -> tuple[str, ...]:
        """Packages the image needs for this provider's client (litellm), beyond smolagents."""
        return PROVIDERS[self.provider].extra_requirements

    @property
    def needs_network(self) -> bool:
        return self.provider != "mock"

    @property
    def aws_signed(self) -> bool:
        """Its client signs its calls with AWS credentials (Bedrock), never one key."""
        return PROVIDERS[self.provider].aws_signed

    @property
    def client_env(self) -> dict[str, str]:
        """Variables the model's client reads that are not secret (a Bedrock model's region,
        and no instance role to look for), set in the sandbox before any payload code runs."""
        if not self.aws_region:
            return {}
        return {**dict.fromkeys(REGION_ENV, self.aws_region), **AWS_NO_INSTANCE_ROLE}

    def on_bedrock(self) -> ModelSpec:
        """This Bedrock model with its region (its own, else the host's: `aws.host_region`)
        and endpoint (the run's --api-base, else as botocore resolves it on the host:
        `aws.bedrock_endpoint`); inside the sandbox, its client finds the run's endpoint in
        AWS_ENDPOINT_URL_BEDROCK_RUNTIME. Raises ConfigError without a region."""
        region = self.aws_region or host_region()
        if region is None:
            raise ConfigError(
                f"The Bedrock model {self.model_id!r} has no AWS region: its program gives "
                "no region_name and none is set on this host. Nothing was started.",
                "Set AWS_REGION (or AWS_DEFAULT_REGION, or a profile's region) on this host, "
                'or give the model client_kwargs={"region_name": "us-east-1"}.',
            )
        base = self.api_base or bedrock_endpoint(region)
        upstream = Upstream(
            provider="bedrock",
            base=base,
            path=f"/model/{self.model_id}/converse",
            key_header="authorization (AWS SigV4)",
            key_env=None,
        )
        return replace(
            self,
            api_base=base,
            aws_region=region,
            upstream=upstream,
            endpoint_env=tuple(dict.fromkeys((*self.endpoint_env, ENDPOINT_ENV))),
            credential_env=PROVIDERS[self.provider].credential_env,  # the stand-in's, always
        )

    def describe(self) -> str:
        base = f" at {self.api_base}" if self.api_base and self.provider != "mock" else ""
        chosen = f" (the program's {self.program_class})" if self.program_class else ""
        return f"{self.provider}:{self.model_id}{base}{chosen}"


def parse_model(
    text: str,
    *,
    api_base: str | None = None,
    credential_env: str | None = None,
    options: dict[str, Any] | None = None,
) -> ModelSpec:
    """Parse `mock`, `openai:gpt-4o-mini`, `hf:Qwen/...`, `litellm:anthropic/claude-...`."""
    provider_name, _, model_id = text.partition(":")
    provider = PROVIDERS.get(provider_name.strip().lower())
    if provider is None:
        known = ", ".join(f"`{p}`" for p in PROVIDERS)
        raise ConfigError(
            f"Unknown model provider {provider_name!r} in --model {text!r}.",
            f"Use one of {known}, as `provider:model_id` (for example `openai:gpt-4o-mini`, "
            "or just `mock`).",
        )
    if api_base is not None:
        parts = urlsplit(api_base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"--api-base {api_base!r} is not an http(s) URL.",
                "Give the server's base URL, for example http://127.0.0.1:8080/v1.",
            )
    if provider.name == "mock":
        return ModelSpec("mock", model_id or provider.default_model_id)
    env = credential_env or provider.credential_env
    return ModelSpec(
        provider=provider.name,
        model_id=model_id or provider.default_model_id,
        api_base=api_base or provider.default_api_base,
        credential_env=env,
        options=dict(options or {}),
    )
