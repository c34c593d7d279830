"""A scripted Amazon Bedrock server for the Bedrock tests: converse and converse-stream in
Bedrock's own formats, behind AWS Signature Version 4.

`BedrockServer` is the lead's `ProviderServer` (tests/provider_servers.py: a real HTTP server
on 0.0.0.0, one script of answers, every request recorded, its own token figures summed)
answering Bedrock's calls:

- `POST /model/ID/converse`: `{output: {message}, stopReason, usage: {inputTokens,
  outputTokens, totalTokens}, metrics}`;
- `POST /model/ID/converse-stream`: AWS's binary event stream (`messageStart`,
  `contentBlockDelta`s, `contentBlockStop`, `messageStop`, then `metadata` with the usage).
  botocore has a parser of these frames and no encoder, so `event_frame` builds them by the
  documented format (prelude, headers, payload, two CRC32s); the tests check them with
  botocore's parser.

A call is answered only when its signature is the host's: the server computes it again with
botocore from the request as it came (the headers it says it signed, its X-Amz-Date) and the
host's secret key, and refuses any other (the sandbox's credentials included) with 403, as AWS
does (`refused` says why).
"""

from __future__ import annotations

import hmac
import http.server
import json
import struct
import zlib
from typing import Any

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from .provider_servers import ProviderServer

#: The event-stream header value type of a string (AWS's event-stream encoding).
STRING = 7


def event_frame(event_type: str, payload: dict[str, Any]) -> bytes:
    """One event of AWS's event stream: total length and headers length (big-endian
    uint32), their CRC32, the headers (name length, name, type 7, value length, value),
    the JSON payload, and the CRC32 of everything before it."""
    headers = b""
    for name, value in (
        (":event-type", event_type),
        (":content-type", "application/json"),
        (":message-type", "event"),
    ):
        raw_name, raw_value = name.encode(), value.encode()
        headers += struct.pack(">B", len(raw_name)) + raw_name
        headers += struct.pack(">BH", STRING, len(raw_value)) + raw_value
    body = json.dumps(payload).encode()
    total = 12 + len(headers) + len(body) + 4
    prelude = struct.pack(">II", total, len(headers))
    message = prelude + struct.pack(">I", zlib.crc32(prelude)) + headers + body
    return message + struct.pack(">I", zlib.crc32(message))


def signature_problem(
    method: str,
    path: str,
    headers: list[tuple[str, str]],
    body: bytes,
    keys: Credentials,
    region: str,
) -> str | None:
    """Why a request is not signed with `keys` for Bedrock in `region` (botocore computes the
    expected signature), or None."""
    given = {k.lower(): v for k, v in headers}
    algorithm, _, rest = given.get("authorization", "").partition(" ")
    parts = dict(p.strip().partition("=")[::2] for p in rest.split(",") if "=" in p)
    if algorithm != "AWS4-HMAC-SHA256" or not {"Credential", "Signature"} <= set(parts):
        return "no SigV4 signature"
    key_id, day, scope_region, service, _ = (parts["Credential"].split("/") + [""] * 5)[:5]
    if key_id != keys.access_key or (scope_region, service) != (region, "bedrock"):
        return f"signed by {key_id} for {service} in {scope_region}"
    if given.get("x-amz-security-token") != keys.token:
        return "the session token is not the host's"
    signed = parts.get("SignedHeaders", "").split(";")
    request = AWSRequest(method=method, url=f"http://{given.get('host')}{path}", data=body)
    for name, value in headers:
        if name.lower() in signed:
            request.headers[name.lower()] = value
    request.context["timestamp"] = given.get("x-amz-date", "")
    auth = SigV4Auth(keys, "bedrock", region)
    expected = auth.signature(
        auth.string_to_sign(request, auth.canonical_request(request)), request
    )
    if day != request.context["timestamp"][:8] or not hmac.compare_digest(
        expected, parts["Signature"]
    ):
        return "the signature does not match"
    return None


class BedrockServer(ProviderServer):
    """Answers Bedrock's converse and converse-stream, signed with the host's `keys`."""

    def __init__(self, outputs: list[str], *, keys: Credentials, region: str = "us-east-1"):
        self.keys = keys
        self.region = region
        #: Why each refused call was refused.
        self.refused: list[str] = []
        super().__init__(outputs, key=keys.secret_key)

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        server = self
        base: Any = super()._handler()

        class Handler(base):  # type: ignore[misc,valid-type]
            def do_POST(self) -> None:  # http.server's naming
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = list(self.headers.items())
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    body = {}
                with server._lock:
                    server.requests.append(
                        {
                            "method": "POST",
                            "path": self.path,
                            "headers": {k.lower(): v for k, v in headers},
                            "body": body,
                        }
                    )
                action = self.path.rsplit("/", 1)[-1]
                if not self.path.startswith("/model/") or action not in (
                    "converse",
                    "converse-stream",
                ):
                    return self._json(404, {"message": f"no such path {self.path}"})
                wrong = signature_problem(
                    "POST", self.path, headers, raw, server.keys, server.region
                )
                if wrong is not None:
                    server.refused.append(wrong)
                    return self._json(403, {"message": wrong})
                text, prompt, completion = server._next(body)
                if action == "converse":
                    return self._converse(text, prompt, completion)
                return self._converse_stream(text, prompt, completion)

            def _converse(self, text: str, i: int, o: int) -> None:
                message = {"role": "assistant", "content": [{"text": text}]}
                usage = {"inputTokens": i, "outputTokens": o, "totalTokens": i + o}
                self._json(
                    200,
                    {
                        "output": {"message": message},
                        "stopReason": "end_turn",
                        "usage": usage,
                        "metrics": {"latencyMs": 7},
                    },
                )

            def _converse_stream(self, text: str, i: int, o: int) -> None:
                pieces = [text[n : n + 30] for n in range(0, len(text), 30)] or [""]
                frames = [event_frame("messageStart", {"role": "assistant"})]
                frames += [
                    event_frame("contentBlockDelta", {"contentBlockIndex": 0, "delta": {"text": p}})
                    for p in pieces
                ]
                frames += [
                    event_frame("contentBlockStop", {"contentBlockIndex": 0}),
                    event_frame("messageStop", {"stopReason": "end_turn"}),
                    event_frame(
                        "metadata",
                        {
                            "usage": {"inputTokens": i, "outputTokens": o, "totalTokens": i + o},
                            "metrics": {"latencyMs": 7},
                        },
                    ),
                ]
                self.send_response(200)
                self.send_header("Content-Type", "application/vnd.amazon.eventstream")
                self.send_header("Connection", "close")
                self.end_headers()
                for frame in frames:
                    self.wfile.write(frame)
                    self.wfile.flush()
                self.close_connection = True

        return Handler
