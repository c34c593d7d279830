"""Host-side test servers: a scripted OpenAI-compatible model, and a sink.

`ScriptedModelServer` is a real HTTP server (so the sandbox → gateway or egress proxy →
Docker host path is exercised for real) bound to 0.0.0.0 on a free port. It answers
`POST /v1/chat/completions` with the next output of its script (or what its `answer`
function makes of the request, for conversations that run at once) (as server-sent events when
the request says `stream`, with usage in the last event when `stream_options.include_usage`
asks for it), records every request, counts the tokens it reports (`usage`: its own figures,
which differ per request), can be told to fail the next requests with a status, and to hold
its later answers until a test lets them go (`hold_after`).

`SinkServer` listens on 0.0.0.0 and records every connection it gets: tests assert it got
none, whatever the sandbox tried.
"""

from __future__ import annotations

import http.server
import json
import socket
import socketserver
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any


class ScriptedModelServer:
    """An OpenAI-compatible chat-completions server that plays a script in order."""

    def __init__(
        self,
        outputs: list[str],
        *,
        host: str = "0.0.0.0",
        answer: Callable[[dict[str, Any]], str] | None = None,
    ) -> None:
        self.outputs = deque(outputs)
        #: Answers a request from its body instead of the script (runs at once, each its
        #: own conversation: a batch at any concurrency).
        self.answer = answer
        self.requests: list[dict[str, Any]] = []
        self.failures: deque[int] = deque()
        #: The tokens this server reported, summed over its answers.
        self.usage = {"input_tokens": 0, "output_tokens": 0}
        #: Seconds between the events of a streamed answer.
        self.stream_delay = 0.0
        self._lock = threading.Lock()
        #: Chat requests come so far, and `hold_after`'s (answers given at once, release).
        self._chats = 0
        self._hold: tuple[int, threading.Event] | None = None
        self._server = http.server.ThreadingHTTPServer((host, 0), self._handler())
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        # shutdown() waits for serve_forever's next poll: 0.5 s idle by default, on every stop.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def api_base(self, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}/v1"

    def hold_after(self, answers: int) -> threading.Event:
        """Give the first `answers` chat answers at once and hold each later one until the
        returned event is set (or the server stops): a run then stays alive, inside a model
        call, exactly as long as a test needs it, not for a time guessed in its script."""
        release = threading.Event()
        self._hold = (answers, release)
        return release

    def _wait_turn(self) -> None:
        with self._lock:
            self._chats += 1
            turn, hold = self._chats, self._hold
        if hold is not None and turn > hold[0]:
            hold[1].wait()

    def fail_next(self, status: int, count: int = 1) -> None:
        """Answer the next `count` requests with HTTP `status` instead of the script."""
        self.failures.extend([status] * count)

    def _reply(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self._lock:
            if self.failures:
                status = self.failures.popleft()
                return status, {"error": {"message": f"scripted {status}", "type": "scripted"}}
            if self.answer is not None:
                text = self.answer(body)
            elif not self.outputs:
                return 500, {"error": {"message": "the script is exhausted", "type": "scripted"}}
            else:
                text = self.outputs.popleft()
            number = len(self.requests)
            # Figures of its own, different for every request, so a count cannot match by luck.
            prompt = 1 + len(json.dumps(body.get("messages", []))) // 4
            completion = 1 + len(text) // 4
            self.usage["input_tokens"] += prompt
            self.usage["output_tokens"] += completion
        return 200, {
            "id": f"chatcmpl-{number}",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", "scripted"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            },
        }

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # as real model servers: no 40 ms ACK stalls

            def do_GET(self) -> None:  # http.server's naming
                """Recorded, then 404: only chat completions are served."""
                self.do_POST()

            def do_POST(self) -> None:  # http.server's naming
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    body = {}
                with server._lock:
                    server.requests.append(
                        {
                            "method": self.command,
                            "path": self.path,
                            "headers": dict(self.headers),
                            "body": body,
                            "client": self.client_address[0],
                        }
                    )
                if self.command == "POST" and self.path.rstrip("/").endswith("/chat/completions"):
                    server._wait_turn()
                    status, reply = server._reply(body)
                else:
                    status, reply = 404, {"error": {"message": "not found"}}
                if status == 200 and body.get("stream"):
                    return self._stream(
                        reply, bool((body.get("stream_options") or {}).get("include_usage"))
                    )
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, reply: dict[str, Any], include_usage: bool) -> None:
                """The answer as chat.completion.chunk events, a few characters each."""
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                text = reply["choices"][0]["message"]["content"]
                pieces = [text[i : i + 40] for i in range(0, len(text), 40)] or [""]
                base = {k: reply[k] for k in ("id", "created", "model")}
                base["object"] = "chat.completion.chunk"
                events = [
                    {
                        **base,
                        "choices": [
                            {"index": 0, "delta": {"content": piece}, "finish_reason": None}
                        ],
                    }
                    for piece in pieces
                ]
                events[-1]["choices"][0]["finish_reason"] = "stop"
                if include_usage:
                    events.append({**base, "choices": [], "usage": reply["usage"]})
                for event in events:
                    self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(server.stream_delay)
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                self.close_connection = True

            def log_message(self, *args: Any) -> None:
                pass

        return Handler

    def __enter__(self) -> ScriptedModelServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hold is not None:
            self._hold[1].set()  # a held answer goes out: no run waits on a stopped server
        self._server.shutdown()
        self._server.server_close()


class SinkServer:
    """A TCP server that records every connection (and the bytes it was sent)."""

    def __init__(self, host: str = "0.0.0.0") -> None:
        self.connections: list[dict[str, Any]] = []
        sink = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.settimeout(1)
                try:
                    data = self.request.recv(4096)
                except OSError:
                    data = b""
                sink.connections.append({"client": self.client_address[0], "data": data})

        self._server = socketserver.ThreadingTCPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        # shutdown() waits for serve_forever's next poll: 0.5 s idle by default, on every stop.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> SinkServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def docker_bridge_address() -> str:
    """The Docker host's address on the default bridge (docker0), as containers see it."""
    import docker

    client = docker.from_env()
    try:
        config = client.api.inspect_network("bridge")["IPAM"]["Config"]
        return config[0].get("Gateway") or "172.17.0.1"
    finally:
        client.close()


def host_address() -> str:
    """This machine's primary address (the one its default route uses)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("198.51.100.1", 9))  # no packet is sent for a UDP connect
            return sock.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())
