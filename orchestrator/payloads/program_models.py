"""The models a program makes, read from its source, and the model its run serves.

Which model the run's gateway serves is read from the source, never by running it: each
call of a smolagents model class (`ModelUse`) names its class, its model id, its endpoint
(a literal, or the environment variable it is read from) and the environment variable its
key comes from (`os.getenv("HF_TOKEN")`, or the class's own). The host then holds that key;
inside, the variable holds the run token (`program_model`). A LiteLLM model with no endpoint
is served where LiteLLM says (`upstreams.own_endpoint`).
"""

from __future__ import annotations

import ast
import contextlib
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from orchestrator_runtime.protocol import AWS_REGION_ENV, CLASS_KEY_ENV, ROUTABLE_MODELS

from ..errors import ConfigError
from ..models import PROVIDERS, ModelSpec, parse_model
from ..models.aws import AWS_NO_INSTANCE_ROLE, host_region
from ..spec import RunSpec
from .pysource import callee
from .upstreams import own_endpoint

#: The routable model classes (`protocol.ROUTABLE_MODELS`, shared with the runtime): the
#: provider the host knows each by, and the variable its client reads a key from when the
#: program passes none (that provider's credential).
ROUTABLE: dict[str, tuple[str, str]] = {
    cls: (provider, CLASS_KEY_ENV.get(cls) or str(PROVIDERS[provider].credential_env))
    for cls, provider in ROUTABLE_MODELS.items()
}
#: Where Azure's OpenAI client reads its endpoint from when the program gives none.
AZURE_ENDPOINT_ENV = "AZURE_OPENAI_ENDPOINT"
#: smolagents' model classes that cannot go through the gateway: a model in the sandbox
#: itself (weights, a GPU), or a client that sends each call to one of several endpoints
#: (LiteLLM's router).
NOT_ROUTABLE = frozenset(
    {
        "TransformersModel",
        "VLLMModel",
        "MLXModel",
        "LiteLLMRouterModel",
    }
)


@dataclass(frozen=True)
class ModelUse:
    """One place the program makes a smolagents model, as its source says."""

    cls: str
    file: str
    line: int
    model_id: str | None = None
    provider: str | None = None
    #: The endpoint given as a literal (`api_base=`/`base_url=`); `api_base_dynamic`: one
    #: given as an expression the host cannot read.
    api_base: str | None = None
    api_base_dynamic: bool = False
    #: The environment variable an endpoint expression reads (`os.getenv("X")`), which the
    #: host reads too; or the one the class's client reads when given none (Azure's).
    api_base_env: str | None = None
    #: The environment variable its key is read from (`os.getenv("X")` as `token=`/`api_key=`).
    key_env: str | None = None
    #: A Bedrock model's region (`client_kwargs={"region_name": ...}`): a literal, or the
    #: variable it is read from, which the host reads too.
    region: str | None = None
    region_env: str | None = None

    @property
    def own_region(self) -> str | None:
        """A Bedrock model's region as the program would have it: its literal, else the
        host's value of the variable it is read from."""
        return self.region or os.environ.get(self.region_env or "") or None

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def describe(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v not in (None, False)}


def find_models(trees: dict[str, ast.Module]) -> tuple[ModelUse, ...]:
    """Every call of a smolagents model class in the program's files, in file order."""
    uses = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            cls = callee(node.func)
            if cls in ROUTABLE or cls in NOT_ROUTABLE:
                uses.append(_use(cls, name, node))
    return tuple(sorted(uses, key=lambda u: (u.file, u.line)))


def _use(cls: str, file: str, call: ast.Call) -> ModelUse:
    keywords = {k.arg: k.value for k in call.keywords if k.arg}
    model_id = keywords.get("model_id") or (call.args[0] if call.args else None)
    client = _dict_items(keywords.get("client_kwargs"))  # Bedrock's: region, endpoint_url
    base = (
        keywords.get("api_base")
        or keywords.get("base_url")
        or keywords.get("azure_endpoint")
        or client.get("endpoint_url")
    )
    key = keywords.get("token") or keywords.get("api_key")
    base_env = _env_name(base)
    if base is None and cls in CLASS_KEY_ENV:
        base_env = AZURE_ENDPOINT_ENV  # where Azure's client looks when given none
    return ModelUse(
        cls=cls,
        file=file,
        line=call.lineno,
        model_id=_literal(model_id),
        provider=_literal(keywords.get("provider")),
        api_base=_literal(base),
        api_base_dynamic=base is not None and _literal(base) is None and base_env is None,
        api_base_env=base_env,
        key_env=_env_name(key),
        region=_literal(client.get("region_name")),
        region_env=_env_name(client.get("region_name")),
    )


def _dict_items(node: ast.expr | None) -> dict[str, ast.expr]:
    """The string-keyed items of a dict literal (`{"region_name": ...}`), else none."""
    if not isinstance(node, ast.Dict):
        return {}
    return {
        key.value: value
        for key, value in zip(node.keys, node.values, strict=True)
        if isinstance(key, ast.Constant) and isinstance(key.value, str)
    }


def _literal(node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _env_name(node: ast.expr | None) -> str | None:
    """X of `os.getenv("X")`, `os.environ.get("X")`, `os.environ["X"]`, `getenv("X")`."""
    if isinstance(node, ast.Call) and node.args:
        name = callee(node.func)
        if name in ("getenv", "get"):
            return _literal(node.args[0])
    if isinstance(node, ast.Subscript) and callee(node.value) == "environ":
        return _literal(node.slice)
    return None


def program_model(
    uses: tuple[ModelUse, ...],
    source: str,
    *,
    api_base: str | None,
    key_env: str | None,
    options: dict[str, Any] | None = None,
) -> ModelSpec:
    """The model the run serves for a program's own models (the gateway's one endpoint and
    key): read from where the program makes them. `api_base` (--api-base) sends them all to
    that endpoint; `key_env` (--model-key-env) reads the key from that variable.

    Raises ConfigError naming file and line for a class that cannot be routed, for models of
    two providers, keys or AWS regions (one gateway, one endpoint), and for an endpoint given as an
    expression with no --api-base. A program that makes no model the host can see gets the
    mock model: its agents then fail closed at their first call."""
    if not uses:
        return parse_model("mock")
    refused = [u for u in uses if u.cls in NOT_ROUTABLE]
    if refused:
        where = ", ".join(f"{u.cls} at {source}/{u.where}" for u in refused)
        raise ConfigError(
            f"The program makes a model the run's model gateway cannot serve ({where}): "
            "local weights (Transformers, vLLM, MLX) run inside the sandbox with no endpoint "
            "to send calls to, and LiteLLM's router picks among several endpoints. Nothing "
            "was started.",
            "Replace every model of the program with a hosted one: --model provider:model_id "
            f"(providers: {', '.join(p for p in PROVIDERS if p != 'mock')}; e.g. --model "
            "openai:gpt-4o-mini), or make it with one of "
            f"{', '.join(ROUTABLE)} in the program.",
        )
    providers = {ROUTABLE[u.cls][0] for u in uses}
    keys = {u.key_env or ROUTABLE[u.cls][1] for u in uses}
    bases = {u.api_base for u in uses if u.api_base}
    regions = {r for u in uses if (r := u.own_region)}
    if (
        len(providers) > 1
        or (len(keys) > 1 and not key_env)
        or (len(bases) > 1 and not api_base)
        or len(regions) > 1
    ):
        listed = "; ".join(f"{u.cls} at {source}/{u.where}" for u in uses)
        raise ConfigError(
            f"The program's models need more than one endpoint or key ({listed}); a run's "
            "model gateway serves one. Nothing was started.",
            "Give them one provider and one key variable, or send them all to one endpoint "
            "with --api-base and --model-key-env, or replace them with --model.",
        )
    first = uses[0]
    endpoint_env = tuple(dict.fromkeys(u.api_base_env for u in uses if u.api_base_env))
    if endpoint_env and not api_base and not bases:  # the host reads what the program reads
        name = endpoint_env[0]
        api_base = os.environ.get(name) or None
        if api_base is None:
            use = next(u for u in uses if u.api_base_env == name)
            raise ConfigError(
                f"{source}/{use.where}: the {use.cls}'s endpoint comes from {name}, which "
                "is not set on this host (the run's gateway must know where to forward). "
                "Nothing was started.",
                f"Set {name} to the endpoint on this host, or pass --api-base with it.",
            )
    dynamic = [u for u in uses if u.api_base_dynamic]
    if dynamic and not api_base:
        raise ConfigError(
            f"{source}/{dynamic[0].where}: the {dynamic[0].cls}'s endpoint is an expression "
            "the host cannot read before the run, and the run's gateway must know where to "
            "forward. Nothing was started.",
            "Pass the endpoint with --api-base URL (every model of the program goes there).",
        )
    (provider,) = providers
    model_id = next((u.model_id for u in uses if u.model_id), None)
    named_key = key_env or next((u.key_env for u in uses if u.key_env), None)
    spec = parse_model(
        f"{provider}:{model_id or 'default'}",  # the class's own default, in the sandbox
        api_base=api_base or next(iter(bases), None),
        credential_env=named_key or next(iter(keys)),
        options=options,
    )
    region = next(iter(regions), None)
    if region:  # a Bedrock model's own (else the host's: upstreams.on_bedrock)
        spec = replace(spec, aws_region=region)
    spec = own_endpoint(spec, key_env_given=named_key is not None)
    endpoint_env = tuple(dict.fromkeys((*endpoint_env, *spec.endpoint_env)))
    return replace(spec, endpoint_env=endpoint_env).chosen_by_program(first.cls)


#: `--model program`: a program's own models (over its `payload.model`).
PROGRAM_MODEL = "program"


class ReadPayload(Protocol):
    """What `choose_model` reads of a payload (manifest.Manifest, which imports this)."""

    @property
    def program(self) -> str | None: ...
    @property
    def model(self) -> str | None: ...
    @property
    def model_uses(self) -> tuple[ModelUse, ...]: ...
    @property
    def folder(self) -> Path: ...


def choose_model(spec: RunSpec, payload: ReadPayload) -> tuple[ModelSpec, ModelSpec | None]:
    """The run's model, and the program's own model when the program's models are used (the
    run names no model, nor the program's `payload.model`): read from its source
    (`program_model`, which raises ConfigError for a model that cannot be routed). A check
    (`validate`) checks the program's model but runs the mock in its place."""
    chosen = spec.model or payload.model
    if chosen == PROGRAM_MODEL:  # `--model program`: the program's own, whatever it says
        chosen = None
    if payload.program is None or chosen is not None:
        model = parse_model(
            chosen or "mock",
            api_base=spec.api_base,
            credential_env=spec.model_key_env,
            options=spec.model_options,
        )
        return own_endpoint(model, key_env_given=spec.model_key_env is not None), None
    own = program_model(
        payload.model_uses,
        str(payload.folder),
        api_base=spec.api_base,
        key_env=spec.model_key_env,
        options=spec.model_options,
    )
    if spec.check_only:
        return parse_model("mock"), own
    return own, own


#: The region an unused Bedrock model is made with when neither it nor the host names one.
UNUSED_REGION = "us-east-1"


def unused_model_env(uses: tuple[ModelUse, ...]) -> dict[str, str]:
    """What a program's Bedrock models need to be made at all when they are not the run's
    (replaced by --model, or a check that runs no step): a region (boto3 refuses to make a
    client without one), theirs, else the host's, else UNUSED_REGION; and no instance role
    for botocore to wait on the metadata endpoint for. They make no call."""
    bedrock = [u for u in uses if ROUTABLE.get(u.cls, ("",))[0] == "bedrock"]
    if not bedrock:
        return {}
    region = next((r for u in bedrock if (r := u.own_region)), None)
    if region is None:
        with contextlib.suppress(ConfigError):  # no botocore on this host: any region will do
            region = host_region()
    return {**dict.fromkeys(AWS_REGION_ENV, region or UNUSED_REGION), **AWS_NO_INSTANCE_ROLE}


def key_names(uses: tuple[ModelUse, ...]) -> list[str]:
    """The variables a program's models read their keys from, as its source says."""
    return list(dict.fromkeys(u.key_env or ROUTABLE[u.cls][1] for u in uses if u.cls in ROUTABLE))
