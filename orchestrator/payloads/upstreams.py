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
kept in the state directory (importing LiteLLM takes seconds). A Bedrock model's endpoint
and region come from botocore (`ModelSpec.on_bedrock`, `models/aws.py`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..models import ModelSpec, Upstream
from ..paths import home_dir

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


def own_endpoint(model: ModelSpec, *, key_env_given: bool) -> ModelSpec:
    """`model` with the endpoint its own client would reach: for a LiteLLM model with no
    api_base, the provider's base URL and key variable as LiteLLM knows them, so that the
    run's gateway forwards there in the provider's own protocol. `key_env_given`: the key's
    variable was named (by --model-key-env or the program's source) and stays. Raises
    ConfigError when LiteLLM cannot say."""
    if model.aws_signed:
        return model.on_bedrock()
    if model.provider != "litellm" or model.api_base is not None:
        return model
    upstream = litellm_upstream(model.model_id)
    key_env = model.credential_env
    if not key_env_given and upstream.key_env:
        key_env = upstream.key_env
    return replace(model, api_base=upstream.base, credential_env=key_env, upstream=upstream)


def litellm_upstream(model_id: str) -> Upstream:
    """Where LiteLLM sends `model_id`'s chats (`anthropic/claude-...`), learned from the
    LiteLLM installed on the host.

    Raises ConfigError when LiteLLM is not installed, does not know the model's provider,
    or builds its request in a way the probe cannot read (then --api-base says where)."""
    from importlib import metadata  # here: its import is 13 ms of every run's start-up

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
    code = "from orchestrator.payloads.upstreams import _probe_main; _probe_main()"
    # No credential goes to the child: it needs none (the probe passes a key of its own),
    # and LiteLLM then names the variable it would read.
    environment = {
        name: value
        for name, value in os.environ.items()
        if not name.endswith(("_KEY", "_TOKEN", "_SECRET", "_PASSWORD", "_CREDENTIALS"))
    }
    environment["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
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
