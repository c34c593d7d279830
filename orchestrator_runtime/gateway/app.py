"""The model gateway's ASGI application: check the run's token, keep the budget, forward.

One gateway serves one run. The sandbox holds only the run's random token; the gateway
swaps it for the real key and forwards the request to the one upstream it was given, then
passes the response back chunk by chunk as it arrives (server-sent events are never
buffered) while reading its token usage on the side. Every call, refusal and budget stop is
reported through `emit` (the host records them).

Refused without forwarding: a client outside the run's network (403), a missing or wrong
token (401), a path outside the upstream's base path or with dot segments (404), a request
that is not a model call (403: the key is for the model, not for the provider's account,
its files or its billing), a body over MAX_REQUEST_BYTES (413), and once the run's budget
of calls or tokens is spent, every further call (429).

A signing gateway (Bedrock's) has no run token: the sandbox signs each request with the
run's own AWS credentials, the gateway checks that signature (`sigv4.py`: 401 when it is not
the run's) and signs the request anew with the host's credentials.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx

from .usage import UsageReader, requested_model

if TYPE_CHECKING:
    from .sigv4 import Signing

Emit = Callable[[dict[str, Any]], None]
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

#: The largest request body forwarded (a model request with images can be large; not endless).
MAX_REQUEST_BYTES = 32 * 1024 * 1024
#: Headers that may carry the credential, and how each carries it (`Bearer ` or bare).
CREDENTIAL_HEADERS = {
    b"authorization": "Bearer ",
    b"x-api-key": "",
    b"api-key": "",
    b"x-goog-api-key": "",
}
#: What a model call looks like: POST to a generation or embedding endpoint (OpenAI and
#: compatible servers, Azure deployments, Anthropic's messages, Gemini's `:generateContent`,
#: Bedrock's `/model/ID/converse` and `converse-stream`), or GET of the model list. Matched on
#: the end of the path.
MODEL_CALLS = {
    "POST": (
        "/chat/completions",
        "/completions",
        "/responses",
        "/embeddings",
        "/messages",
        ":generateContent",
        ":streamGenerateContent",
        "/converse",
        "/converse-stream",
    ),
    "GET": ("/models",),
}
#: Refusals reported one by one; further ones are only counted (a flood stays small).
MAX_REFUSAL_EVENTS = 100
#: Not forwarded in either direction (RFC 9110 7.6.1), plus what httpx and the server set.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"accept-encoding",
        b"content-encoding",
    }
)


@dataclass
class GatewayConfig:
    """What the host tells a gateway on its stdin (the key is never in its environment)."""

    token: str
    upstream: str
    clients: list[str]
    max_calls: int
    max_tokens: int
    key: str | None = None
    port: int = 8000
    #: A signing gateway's scope and credentials (`signing` in the configuration, the host's
    #: credentials in its `key`): requests carry an AWS signature, not the run's token.
    signing: Signing | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GatewayConfig:
        """Raises ValueError naming the first bad field (botocore is imported only for a
        `signing` one)."""
        given: dict[str, Any] = {  # unchecked until the checks below
            name: data.get(name)
            for name in ("token", "upstream", "clients", "max_calls", "max_tokens", "key")
        }
        config = cls(**given, port=data.get("port", 8000))
        if not isinstance(config.token, str) or len(config.token) < 32:
            raise ValueError("`token` must be a string of at least 32 characters")
        parts = urlsplit(config.upstream if isinstance(config.upstream, str) else "")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("`upstream` must be an http(s) URL")
        if not isinstance(config.clients, list) or not config.clients:
            raise ValueError("`clients` must list the run's networks")
        for name in ("max_calls", "max_tokens", "port"):
            value = getattr(config, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` must be a positive whole number")
        if config.key is not None and not isinstance(config.key, str):
            raise ValueError("`key` must be a string")
        if data.get("signing") is not None:
            from .sigv4 import Signing

            config.signing = Signing.from_json(data["signing"], config.key)
            config.key = None  # the host's credentials sign; no header carries them
        return config


@dataclass
class Ledger:
    """What the run has spent, as the gateway measured it."""

    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    refused: int = 0
    #: Calls whose response said nothing of its usage (the figures are then a lower bound).
    unmeasured: int = 0
    exceeded: list[str] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def summary(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "total_tokens": self.total_tokens,
            "refused": self.refused,
            "unmeasured": self.unmeasured,
        }


class Gateway:
    """The ASGI app (raw ASGI: one route, nothing a framework would add)."""

    def __init__(self, config: GatewayConfig, emit: Emit, client: httpx.AsyncClient) -> None:
        self.config = config
        self.emit = emit
        self.client = client
        self.ledger = Ledger()
        self.closed = False
        upstream = urlsplit(config.upstream)
        self.origin = f"{upstream.scheme}://{upstream.netloc}"
        self.base_path = upstream.path.rstrip("/")
        self.clients = [ipaddress.ip_network(c, strict=False) for c in config.clients]
        self.token = config.token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope.get("path") or "/"
        started = time.time()
        problem = self._refusal(scope, path)
        if problem is not None:
            await self._refuse(send, scope, path, started, problem)
            return
        body = await _read_body(receive)
        if body is None:
            await _reply(send, 413, "request_too_large", "the request body is too large")
            return
        if self.config.signing is not None:
            wrong = self._unsigned(scope, body, started)
            if wrong is not None:
                problem = (401, "bad_signature", f"the request's AWS signature is refused: {wrong}")
                await self._refuse(send, scope, path, started, problem)
                return
        over = self._over_budget()
        if over is not None:
            self.ledger.refused += 1
            await _reply(send, 429, "budget_exceeded", over)
            return
        self.ledger.calls += 1
        await self._forward(scope, path, body, send, started)

    async def _refuse(
        self, send: Send, scope: Scope, path: str, started: float, problem: tuple[int, str, str]
    ) -> None:
        status, kind, message = problem
        self.ledger.refused += 1
        if self.ledger.refused <= MAX_REFUSAL_EVENTS:
            self.emit(
                {
                    "type": "model_call_refused",
                    "ts": started,
                    "path": path[:200],
                    "method": scope.get("method"),
                    "status": status,
                    "reason": kind,
                }
            )
        await _reply(send, status, kind, message)

    def _unsigned(self, scope: Scope, body: bytes, now: float) -> str | None:
        """Why the request is not signed with the run's AWS credentials, or None."""
        assert self.config.signing is not None
        raw = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        query = (scope.get("query_string") or b"").decode("latin-1")
        try:
            return self.config.signing.check(
                scope["method"], raw, query, list(scope.get("headers") or []), body, now
            )
        except Exception as exc:  # a request botocore cannot even read is not signed
            return f"the request cannot be read as signed ({type(exc).__name__})"

    def _refusal(self, scope: Scope, path: str) -> tuple[int, str, str] | None:
        if self.closed:
            return 401, "run_ended", "this run has ended; its token is no longer valid"
        client = (scope.get("client") or ("", 0))[0]
        try:
            address = ipaddress.ip_address(client)
        except ValueError:
            address = None
        if address is None or not any(address in net for net in self.clients):
            return 403, "not_this_run", "this gateway serves one run's sandbox only"
        if self.config.signing is None and not self._token_of(scope):
            return 401, "bad_token", "missing or wrong run token"
        segments = path.split("/")
        if ".." in segments or "." in segments or "//" in path or "\\" in path:
            return 404, "outside_upstream", "paths with dot segments are not served"
        if path != self.base_path and not path.startswith(self.base_path + "/"):
            return 404, "outside_upstream", f"only paths under {self.base_path or '/'} are served"
        method = scope.get("method", "")
        tail = path[len(self.base_path) :]
        ends = MODEL_CALLS.get(method, ())
        if not (tail.endswith(ends) or (method == "GET" and "/models/" in tail)):
            return (
                403,
                "not_a_model_call",
                (
                    f"{method} {path} is not a model call; the gateway forwards only generation "
                    "and embedding requests (and the model list)"
                ),
            )
        return None

    def _token_of(self, scope: Scope) -> bool:
        """True when a credential header carries this run's token (compared in constant
        time)."""
        found = False
        for name, value in scope.get("headers") or []:
            prefix = CREDENTIAL_HEADERS.get(name.lower())
            if prefix is None:
                continue
            given = value.strip()
            if prefix and given[: len(prefix)].lower() == prefix.lower().encode():
                given = given[len(prefix) :].strip()
            found = hmac.compare_digest(given, self.token) or found
        return found

    def _over_budget(self) -> str | None:
        """Why the next call is refused, or None. The first refusal is reported once as
        `budget_exceeded` (the host then ends the run)."""
        config, ledger = self.config, self.ledger
        reason = None
        if ledger.calls >= config.max_calls:
            reason = ("max_model_calls", config.max_calls, ledger.calls)
        elif ledger.total_tokens >= config.max_tokens:
            reason = ("max_tokens", config.max_tokens, ledger.total_tokens)
        if reason is None:
            return None
        limit, value, used = reason
        message = (
            f"this run's budget is spent: {limit} = {value} (used {used}); the gateway "
            "forwards no further model calls"
        )
        if limit not in ledger.exceeded:
            ledger.exceeded.append(limit)
            self.emit(
                {
                    "type": "budget_exceeded",
                    "ts": time.time(),
                    "limit": limit,
                    "value": value,
                    "used": used,
                    "message": message,
                }
            )
        return message

    def _upstream_headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        headers, carrier = [], None
        for name, value in scope.get("headers") or []:
            lower = name.lower()
            if lower in CREDENTIAL_HEADERS:
                carrier = carrier or lower
                continue
            if lower not in HOP_BY_HOP:
                headers.append((name, value))
        if self.config.key is not None and carrier is not None:
            value = CREDENTIAL_HEADERS[carrier] + self.config.key
            headers.append((carrier.title(), value.encode()))  # as clients spell it
        headers.append((b"accept-encoding", b"identity"))  # usage is read from the bytes
        return headers

    async def _forward(
        self, scope: Scope, path: str, body: bytes, send: Send, started: float
    ) -> None:
        query = scope.get("query_string") or b""
        raw = (scope.get("raw_path") or path.encode()).decode("latin-1")  # as the client sent it
        url = self.origin + raw + (f"?{query.decode('latin-1')}" if query else "")
        headers = self._upstream_headers(scope)
        if self.config.signing is not None:  # the host's signature, for the real endpoint
            headers = self.config.signing.sign(scope["method"], url, headers, body)
        request = self.client.build_request(scope["method"], url, headers=headers, content=body)
        event: dict[str, Any] = {
            "type": "model_call",
            "ts": started,
            "method": scope["method"],
            "path": path,
        }
        if (model := requested_model(body, path)) is not None:
            event["model"] = model  # what the provider bills the call at
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            event.update(status=502, latency_ms=_ms(started), error=type(exc).__name__)
            self._account(event, None)
            message = f"the model endpoint could not be reached: {type(exc).__name__}"
            await _reply(send, 502, "upstream_unavailable", message)
            return
        reader = UsageReader(response.headers.get("content-type", ""))
        try:
            headers = [(k, v) for k, v in response.headers.raw if k.lower() not in HOP_BY_HOP]
            await send(
                {"type": "http.response.start", "status": response.status_code, "headers": headers}
            )
            first = True
            async for chunk in response.aiter_raw():
                if first:
                    event["first_byte_ms"] = _ms(started)
                    first = False
                reader.feed(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (httpx.HTTPError, OSError) as exc:
            event["error"] = type(exc).__name__
        finally:
            await response.aclose()
            reader.close()
            event.update(
                status=response.status_code, latency_ms=_ms(started), streamed=reader.streamed
            )
            # Recorded before the response ends: a sandbox that has its answer cannot end
            # the run before the host has heard of the call.
            self._account(event, reader)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _account(self, event: dict[str, Any], reader: UsageReader | None) -> None:
        ledger = self.ledger
        measured = reader is not None and (
            reader.input_tokens is not None or reader.output_tokens is not None
        )
        if reader is not None and measured:
            event["input_tokens"] = reader.input_tokens or 0
            event["output_tokens"] = reader.output_tokens or 0
            ledger.input_tokens += event["input_tokens"]
            ledger.output_tokens += event["output_tokens"]
        elif event.get("status") == 200:
            ledger.unmeasured += 1
            event["usage_unknown"] = True
        event.update(calls=ledger.calls, total_tokens=ledger.total_tokens)
        self.emit(event)


def _ms(started: float) -> float:
    return round((time.time() - started) * 1000, 2)


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None once it is over MAX_REQUEST_BYTES."""
    body = bytearray()
    while True:
        message = await receive()
        body += message.get("body", b"")
        if len(body) > MAX_REQUEST_BYTES:
            return None
        if not message.get("more_body"):
            return bytes(body)


async def _reply(send: Send, status: int, kind: str, message: str) -> None:
    """An error in the OpenAI shape, which every client here reports readably (botocore
    reads AWS's: the `x-amzn-errortype` header and the top-level `message`)."""
    error = {"type": kind, "code": kind, "message": message}
    body = json.dumps({"error": error, "message": message}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"x-amzn-errortype", kind.encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
