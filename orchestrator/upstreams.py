"""Where a LiteLLM model's own client sends its calls, learned from LiteLLM itself.

LiteLLM knows, for each of its providers, the base URL, the path a chat is posted to (the
provider's own protocol: Anthropic's `/v1/messages`, Gemini's `:generateContent`, OpenAI's
`/chat/completions`) and the header its key goes in. We keep no copy of those tables: the
host asks LiteLLM. In a child process whose network is shut (every connection and name
lookup refused), LiteLLM builds the request it would send twice, once as it would by itself
and once given a base URL of ours, and a transport catches each before a byte leaves. The
part the two URLs share after their bases is what the client appends to any base; what is
left of the first is the provider's base URL. The run's gateway forwards there, and the
sandbox's client, given the gateway as its base, posts exactly what LiteLLM would have.

Learned once per (model, LiteLLM's version, the base-URL settings in the environment) and
kept in the state directory (importing LiteLLM takes seconds).

Amazon Bedrock's client (boto3) is asked the same way, of botocore, the AWS SDK's core: its
endpoint rules (the user's AWS_ENDPOINT_URL_BEDROCK_RUNTIME or AWS_ENDPOINT_URL, the
region's partition), its region settings and its credential chain. The host's AWS
credentials never enter a sandbox: its Bedrock client signs with credentials of the run's own
(`RunSigning`: random, made for one run, worthless anywhere else) and sends its calls to the
run's gateway, which checks that signature and signs each call again with the host's
credentials (`orchestrator_runtime/gateway/sigv4.py`). botocore is imported only for a
Bedrock run (the `bedrock` extra).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets as random_tokens
import string
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from orchestrator_runtime.protocol import AWS_REGION_ENV, BEDROCK_ENDPOINT_ENV

from .errors import ConfigError
from .paths import home_dir

#: The base URL the probe gives LiteLLM the second time (never reached: the transport
#: catches the request).
SENTINEL = "http://orchestrator-probe.invalid/base"
#: The key the probe gives LiteLLM, found again in the caught request's headers.
PROBE_KEY = "orchestrator-probe-key"
#: Environment variables that may move a provider's endpoint (LiteLLM reads e.g.
#: ANTHROPIC_API_BASE, GEMINI_API_BASE, AZURE_API_BASE, OPENAI_BASE_URL): part of the
#: cache key, so a changed setting is learned again.
ENDPOINT_SETTINGS = ("API_BASE", "BASE_URL", "ENDPOINT", "API_VERSION")
#: How long the probe may take (importing LiteLLM is most of it).
PROBE_TIMEOUT = 120


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


def litellm_upstream(model_id: str) -> Upstream:
    """Where LiteLLM sends `model_id`'s chats (`anthropic/claude-...`), learned from the
    LiteLLM installed on the host.

    Raises ConfigError when LiteLLM is not installed, does not know the model's provider,
    or builds its request in a way the probe cannot read (then --api-base says where)."""
    try:
        version = metadata.version("litellm")
    except metadata.PackageNotFoundError:
        raise ConfigError(
            f"The LiteLLM model {model_id!r} has no endpoint given, and LiteLLM, which knows "
            "where each of its providers is served, is not installed on this host.",
            "Install it (pip install 'orchestrator[litellm]'), or pass --api-base with the "
            "provider's base URL.",
        ) from None
    settings = sorted(
        (name, value)
        for name, value in os.environ.items()
        if any(part in name for part in ENDPOINT_SETTINGS)
    )
    key = hashlib.sha256(json.dumps([version, model_id, settings]).encode()).hexdigest()[:32]
    cache = _cache_file()
    known = _read_cache(cache)
    if key in known:
        with contextlib.suppress(ValueError, AttributeError):
            return Upstream.from_dict(known[key])
    upstream = _probe(model_id)
    known[key] = asdict(upstream)
    _write_cache(cache, known)
    return upstream


def _cache_file() -> Path:
    return home_dir() / "cache" / "litellm-upstreams.json"


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, data: dict[str, Any]) -> None:
    """Written whole through a temporary file (two runs at once each write a whole file)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(data, indent=1, sort_keys=True))
        temporary.replace(path)
    except OSError:
        pass  # a cache: the next run learns it again


def _probe(model_id: str) -> Upstream:
    """Where LiteLLM sends `model_id`, learned in a child process. Raises ConfigError."""
    answer = probe_many([model_id])[model_id]
    if isinstance(answer, str):
        raise ConfigError(
            f"Where LiteLLM sends {model_id!r} could not be learned from it: {answer}.",
            "Check the model's name (`provider/model`, as LiteLLM's docs list them), or pass "
            "--api-base with the provider's base URL.",
        )
    return answer


def probe_many(model_ids: list[str]) -> dict[str, Upstream | str]:
    """Each model's upstream, or why it could not be learned, from one child process (one
    import of LiteLLM). Uncached. Raises ConfigError when the child does not answer in time."""
    code = "from orchestrator.upstreams import _probe_main; _probe_main()"
    environment = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, *model_ids],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT,
            env=environment,
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"LiteLLM did not say where {', '.join(model_ids)} is served within {PROBE_TIMEOUT} s.",
            "Pass --api-base with the provider's base URL.",
        ) from None
    answers: dict[str, Upstream | str] = {}
    for line in done.stdout.splitlines():
        try:
            answer = json.loads(line)
            model_id = answer.pop("model_id")
            answers[model_id] = answer["error"] if "error" in answer else Upstream.from_dict(answer)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # LiteLLM's own chatter on stdout
    last = (done.stderr.strip().splitlines() or ["no answer"])[-1]
    return {m: answers.get(m, f"the probe said nothing of it ({last})") for m in model_ids}


def _probe_main() -> None:
    """The child process: shut the network, let LiteLLM build its requests, print what the
    two requests say, one JSON line per model (`{"model_id", "error"}` when it cannot)."""
    import socket

    def refused(*args: object, **kwargs: object) -> None:
        raise OSError("the network is shut while LiteLLM is asked where a model is served")

    socket.socket.connect = refused  # type: ignore[method-assign]
    socket.getaddrinfo = refused  # type: ignore[assignment]
    socket.create_connection = refused  # type: ignore[assignment]
    for model_id in sys.argv[1:]:
        try:
            answer: dict[str, str | None] = {"model_id": model_id, **_learn(model_id)}
        except Exception as exc:  # any failure of LiteLLM's is the answer
            answer = {"model_id": model_id, "error": " ".join(str(exc).split())[:500]}
        print(json.dumps(answer), flush=True)


def _learn(model_id: str) -> dict[str, str | None]:
    import litellm

    litellm.suppress_debug_info = True
    _, provider, _, _ = litellm.get_llm_provider(model_id)
    own = _caught_request(model_id, None)
    ours = _caught_request(model_id, SENTINEL)
    own_url, our_url = str(own.url), str(ours.url)
    if not our_url.startswith(SENTINEL):
        raise ValueError(f"given a base URL, LiteLLM posted to {our_url} instead")
    path = our_url[len(SENTINEL) :]
    own_path = own_url.split("?")[0]
    if not own_path.endswith(path.split("?")[0]):
        raise ValueError(f"its own URL {own_url} and ours do not share the path {path}")
    base = own_path[: len(own_path) - len(path.split("?")[0])]
    header = next((name.lower() for name, value in own.headers.items() if PROBE_KEY in value), None)
    for name in [n for n in os.environ if n.endswith(("_KEY", "_TOKEN"))]:
        del os.environ[name]  # so that LiteLLM names the variable it would read
    missing = litellm.validate_environment(model_id).get("missing_keys") or []
    key_env = next((n for n in missing if n.endswith(("_KEY", "_TOKEN"))), None)
    return {
        "provider": provider,
        "base": base,
        "path": path,
        "key_header": header,
        "key_env": key_env,
    }


def _caught_request(model_id: str, base: str | None) -> Any:
    """The HTTP request LiteLLM would send for a one-word chat, caught by the transport."""
    import httpx
    import litellm
    from litellm.llms.custom_httpx.http_handler import HTTPHandler

    class Caught(Exception):
        def __init__(self, request: httpx.Request) -> None:
            super().__init__("caught")
            self.request = request

    def catch(request: httpx.Request) -> httpx.Response:
        raise Caught(request)

    transport = httpx.MockTransport(catch)
    litellm.client_session = httpx.Client(transport=transport)  # paths through OpenAI's SDK
    attempts = [{"client": HTTPHandler(client=httpx.Client(transport=transport))}, {}]
    failure: BaseException | None = None
    for extra in attempts:
        try:
            litellm.completion(
                model=model_id,
                messages=[{"role": "user", "content": "hi"}],
                api_key=PROBE_KEY,
                api_base=base,
                num_retries=0,
                **extra,
            )
        except Exception as exc:  # the caught request is inside
            seen: set[int] = set()
            current: BaseException | None = exc
            while current is not None and id(current) not in seen:
                seen.add(id(current))
                if isinstance(current, Caught):
                    return current.request
                current = current.__cause__ or current.__context__
            failure = exc
    raise ValueError(f"LiteLLM sent no request the probe could catch ({failure})")


# Amazon Bedrock -----------------------------------------------------------------------------------

#: The variables an AWS client reads its credentials from: the host's, on the host; the
#: run's own, in the sandbox (never a session token there).
ACCESS_KEY_ENV = "AWS_ACCESS_KEY_ID"
SECRET_KEY_ENV = "AWS_SECRET_ACCESS_KEY"
SESSION_TOKEN_ENV = "AWS_SESSION_TOKEN"
CREDENTIAL_ENV = (ACCESS_KEY_ENV, SECRET_KEY_ENV, SESSION_TOKEN_ENV)
#: The variable botocore reads Bedrock Runtime's endpoint from (the user's, on the host; the
#: run's gateway, in the sandbox), and the region variables (AWS_REGION, then botocore's own
#: AWS_DEFAULT_REGION and profile, on the host; both, in the sandbox).
ENDPOINT_ENV = BEDROCK_ENDPOINT_ENV
REGION_ENV = AWS_REGION_ENV
#: Set in a Bedrock model's sandbox: no instance role there, so botocore's credential chain
#: must not wait on the metadata endpoint for one.
AWS_NO_INSTANCE_ROLE = {"AWS_EC2_METADATA_DISABLED": "true"}
#: Bedrock Runtime's name for signatures (the SigV4 scope's service).
SERVICE = "bedrock"
#: The client botocore makes for it.
CLIENT = "bedrock-runtime"
#: How the run's access key id begins (the rest random): recognisable as not AWS's.
RUN_KEY_PREFIX = "ORCHRUN"


@dataclass(frozen=True)
class RunSigning:
    """A Bedrock run's signing: the region and service its calls are signed for, and the
    run's own credentials, made for this run (what the sandbox signs with)."""

    region: str
    access_key_id: str
    secret_access_key: str = field(repr=False)
    service: str = SERVICE

    @classmethod
    def new(cls, region: str) -> RunSigning:
        """Random credentials shaped like AWS's (a 20-character key id, a 40-character secret)."""
        alphabet = string.ascii_uppercase + string.digits
        suffix = "".join(random_tokens.choice(alphabet) for _ in range(20 - len(RUN_KEY_PREFIX)))
        return cls(region, RUN_KEY_PREFIX + suffix, random_tokens.token_urlsafe(30))

    def gateway_config(self) -> dict[str, str]:
        """The gateway's `signing` object: what it checks each call's signature against."""
        return {
            "kind": "aws-sigv4",
            "region": self.region,
            "service": self.service,
            "access_key_id": self.access_key_id,
            "secret_access_key": self.secret_access_key,
        }

    def sandbox_env(self) -> dict[str, str]:
        """The sandbox's AWS credentials: the run's own."""
        return {ACCESS_KEY_ENV: self.access_key_id, SECRET_KEY_ENV: self.secret_access_key}


def host_region() -> str | None:
    """The region AWS's tools on this host use: AWS_REGION, else botocore's (AWS_DEFAULT_REGION,
    the profile's `region`); None when none is set."""
    region = os.environ.get(REGION_ENV[0])
    if region:
        return region
    value = _session().get_config_variable("region")
    return value if isinstance(value, str) and value else None


def bedrock_endpoint(region: str) -> str:
    """Bedrock Runtime's endpoint for `region` as botocore resolves it on this host: the
    user's AWS_ENDPOINT_URL_BEDROCK_RUNTIME or AWS_ENDPOINT_URL (or the profile's
    `endpoint_url`), else the region's own (`https://bedrock-runtime.REGION.amazonaws.com`,
    another domain in AWS's other partitions). Raises ConfigError for a region botocore
    cannot place."""
    try:
        client = _session().create_client(
            CLIENT,
            region_name=region,
            aws_access_key_id="unused",  # no credential lookup: only the endpoint is wanted
            aws_secret_access_key="unused",
        )
    except Exception as exc:  # botocore's InvalidRegionError and kin
        raise ConfigError(
            f"botocore cannot place Bedrock in the region {region!r} ({exc}).",
            "Give the model a valid AWS region (region_name in its client_kwargs, or "
            "AWS_REGION on this host).",
        ) from exc
    return str(client.meta.endpoint_url).rstrip("/")


def host_credentials() -> dict[str, str]:
    """The host's AWS credentials, as botocore's chain finds them (the environment, the
    shared credentials and config files and their profile, SSO, a container or instance
    role), by the variable each goes by; taken once, when the run is prepared. Raises
    ConfigError when there are none."""
    found = _session().get_credentials()
    frozen = found.get_frozen_credentials() if found is not None else None
    if frozen is None or not frozen.access_key or not frozen.secret_key:
        raise ConfigError(
            "The run's Bedrock model needs AWS credentials on this host, and botocore finds "
            "none (environment, shared credentials file, profile, SSO or role). Nothing was "
            "started.",
            f"Export {ACCESS_KEY_ENV} and {SECRET_KEY_ENV} (or set AWS_PROFILE); they stay "
            "with the run's gateway, outside the sandbox.",
        )
    values = {ACCESS_KEY_ENV: frozen.access_key, SECRET_KEY_ENV: frozen.secret_key}
    if frozen.token:
        values[SESSION_TOKEN_ENV] = frozen.token
    return values


def gateway_key(secrets: dict[str, str]) -> str:
    """The key a signing gateway gets on its stdin: the host's credentials (among `secrets`,
    by variable) as one JSON object."""
    return json.dumps(
        {
            "access_key_id": secrets.get(ACCESS_KEY_ENV),
            "secret_access_key": secrets.get(SECRET_KEY_ENV),
            "session_token": secrets.get(SESSION_TOKEN_ENV),
        }
    )


def _session() -> Any:
    """A botocore session reading this host's AWS settings. Raises ConfigError without
    botocore."""
    try:
        import botocore.session
    except ImportError:
        raise ConfigError(
            "A Bedrock model needs botocore on this host (it reads the AWS credentials, "
            "region and endpoint as AWS's own tools do), and it is not installed.",
            "Install it: pip install 'orchestrator[bedrock]'.",
        ) from None
    return botocore.session.get_session()
