"""A scripted model server that speaks each provider's own protocol, for the routing tests.

`ProviderServer` is a real HTTP server (bound to 0.0.0.0, so a sandbox's gateway reaches it
on the Docker host) that answers, by the path a call comes to:

- Anthropic's messages (`POST .../v1/messages`), streamed as Anthropic's events
  (`message_start` with the input tokens, `content_block_delta`s, `message_delta` with the
  output tokens) when the body says `stream`;
- Gemini's `POST .../models/NAME:generateContent` and `:streamGenerateContent?alt=sse`
  (`usageMetadata` in the answer, and in each streamed chunk);
- OpenAI's chat completions (`.../chat/completions`, Azure's deployments included), with
  usage in the last streamed event when `stream_options.include_usage` asks.

It plays one script of answers in order whatever the protocol, records every request
(method, path with its query, headers, body), refuses a call whose key is not `key` in the
header that protocol carries it in (Anthropic `x-api-key`, Gemini `x-goog-api-key`, Azure
`api-key`, OpenAI `Authorization: Bearer`) with 401, and sums the tokens it reported
(figures of its own, different for every request, so a count cannot match by luck).
"""

from __future__ import annotations

import http.server
import json
import threading
from collections import deque
from typing import Any


def protocol_of(path: str) -> str:
    """Which protocol a call's path is: anthropic, gemini, azure or openai (else "")."""
    bare = path.split("?")[0].rstrip("/")
    if bare.endswith("/v1/messages"):
        return "anthropic"
    if bare.endswith((":generateContent", ":streamGenerateContent")):
        return "gemini"
    if "/openai/deployments/" in bare and bare.endswith("/chat/completions"):
        return "azure"
    if bare.endswith("/chat/completions"):
        return "openai"
    return ""


#: Where each protocol carries the key, and its prefix.
KEY_HEADERS = {
    "anthropic": ("x-api-key", ""),
    "gemini": ("x-goog-api-key", ""),
    "azure": ("api-key", ""),
    "openai": ("authorization", "Bearer "),
}


class ProviderServer:
    """Answers each protocol's calls with the next output of its script."""

    def __init__(self, outputs: list[str], *, key: str) -> None:
        self.outputs = deque(outputs)
        self.key = key
        self.requests: list[dict[str, Any]] = []
        self.usage = {"input_tokens": 0, "output_tokens": 0}
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("0.0.0.0", 0), self._handler())
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def base(self, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}"

    def calls(self, protocol: str) -> list[dict[str, Any]]:
        """The requests that came in `protocol`."""
        return [r for r in self.requests if protocol_of(r["path"]) == protocol]

    def _next(self, body: dict[str, Any]) -> tuple[str, int, int]:
        with self._lock:
            text = self.outputs.popleft() if self.outputs else "Thought: done\nfinal_answer('x')"
            prompt = 3 + len(json.dumps(body)) // 5
            completion = 2 + len(text) // 3
            self.usage["input_tokens"] += prompt
            self.usage["output_tokens"] += completion
        return text, prompt, completion

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def do_POST(self) -> None:  # http.server's naming
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    body = {}
                headers = {k.lower(): v for k, v in self.headers.items()}
                with server._lock:
                    server.requests.append(
                        {"method": "POST", "path": self.path, "headers": headers, "body": body}
                    )
                protocol = protocol_of(self.path)
                if not protocol:
                    return self._json(404, {"error": {"message": f"no such path {self.path}"}})
                header, prefix = KEY_HEADERS[protocol]
                if headers.get(header) != prefix + server.key:
                    return self._json(401, {"error": {"message": f"bad key in {header}"}})
                text, prompt, completion = server._next(body)
                streamed = ":streamGenerateContent" in self.path or bool(body.get("stream"))
                getattr(self, f"_{protocol if protocol != 'azure' else 'openai'}")(
                    body, text, prompt, completion, streamed
                )

            def _anthropic(self, body: dict, text: str, i: int, o: int, streamed: bool) -> None:
                model = body.get("model", "claude")
                message = {"id": "msg_1", "type": "message", "role": "assistant", "model": model}
                if not streamed:
                    reply = {
                        **message,
                        "content": [{"type": "text", "text": text}],
                        "stop_reason": "end_turn",
                        "usage": {"input_tokens": i, "output_tokens": o},
                    }
                    return self._json(200, reply)
                start = {**message, "content": [], "usage": {"input_tokens": i, "output_tokens": 1}}
                events = [
                    ("message_start", {"type": "message_start", "message": start}),
                    (
                        "content_block_start",
                        {
                            "type": "content_block_start",
                            "index": 0,
                            "content_block": {"type": "text", "text": ""},
                        },
                    ),
                    *(
                        (
                            "content_block_delta",
                            {
                                "type": "content_block_delta",
                                "index": 0,
                                "delta": {"type": "text_delta", "text": text[n : n + 30]},
                            },
                        )
                        for n in range(0, len(text), 30)
                    ),
                    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
                    (
                        "message_delta",
                        {
                            "type": "message_delta",
                            "delta": {"stop_reason": "end_turn"},
                            "usage": {"output_tokens": o},
                        },
                    ),
                    ("message_stop", {"type": "message_stop"}),
                ]
                self._sse(f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events)

            def _gemini(self, body: dict, text: str, i: int, o: int, streamed: bool) -> None:
                def chunk(piece: str, done: bool) -> dict[str, Any]:
                    candidate: dict[str, Any] = {
                        "content": {"role": "model", "parts": [{"text": piece}]},
                        "index": 0,
                    }
                    if done:
                        candidate["finishReason"] = "STOP"
                    usage = {"promptTokenCount": i, "candidatesTokenCount": o if done else 1}
                    usage["totalTokenCount"] = (
                        usage["promptTokenCount"] + usage["candidatesTokenCount"]
                    )
                    return {"candidates": [candidate], "usageMetadata": usage}

                if not streamed:
                    return self._json(200, chunk(text, True))
                pieces = [text[n : n + 30] for n in range(0, len(text), 30)] or [""]
                self._sse(
                    f"data: {json.dumps(chunk(p, n == len(pieces) - 1))}\n\n"
                    for n, p in enumerate(pieces)
                )

            def _openai(self, body: dict, text: str, i: int, o: int, streamed: bool) -> None:
                base = {"id": "chatcmpl-1", "created": 0, "model": body.get("model", "gpt")}
                usage = {"prompt_tokens": i, "completion_tokens": o, "total_tokens": i + o}
                if not streamed:
                    choice = {"index": 0, "message": {"role": "assistant", "content": text}}
                    reply = {**base, "object": "chat.completion", "usage": usage}
                    reply["choices"] = [{**choice, "finish_reason": "stop"}]
                    return self._json(200, reply)
                events = [
                    {
                        **base,
                        "object": "chat.completion.chunk",
                        "choices": [
                            {"index": 0, "delta": {"content": text}, "finish_reason": "stop"}
                        ],
                    }
                ]
                if (body.get("stream_options") or {}).get("include_usage"):
                    events.append(
                        {**base, "object": "chat.completion.chunk", "choices": [], "usage": usage}
                    )
                self._sse([*(f"data: {json.dumps(e)}\n\n" for e in events), "data: [DONE]\n\n"])

            def _json(self, status: int, reply: dict[str, Any]) -> None:
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _sse(self, lines: Any) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                for line in lines:
                    self.wfile.write(line.encode())
                    self.wfile.flush()
                self.close_connection = True

            def log_message(self, *args: Any) -> None:
                pass

        return Handler

    def __enter__(self) -> ProviderServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
