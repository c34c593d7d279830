"""Host-side test servers: a scripted OpenAI-compatible model, and a sink.

`ScriptedModelServer` is a real HTTP server (so the sandbox → egress proxy → Docker host path
is exercised for real) bound to 0.0.0.0 on a free port. It answers
`POST /v1/chat/completions` with the next output of its script, records every request, and
can be told to fail the next requests with a status (429, 500, ...).

`SinkServer` listens on 0.0.0.0 and records every connection it gets: tests assert it got
none, whatever the sandbox tried.
"""

from __future__ import annotations

import http.server
import json
import socket
import socketserver
import threading
from collections import deque
from typing import Any


class ScriptedModelServer:
    """An OpenAI-compatible chat-completions server that plays a script in order."""

    def __init__(self, outputs: list[str], *, host: str = "0.0.0.0") -> None:
        self.outputs = deque(outputs)
        self.requests: list[dict[str, Any]] = []
        self.failures: deque[int] = deque()
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer((host, 0), self._handler())
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def api_base(self, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}/v1"

    def fail_next(self, status: int, count: int = 1) -> None:
        """Answer the next `count` requests with HTTP `status` instead of the script."""
        self.failures.extend([status] * count)

    def _reply(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self._lock:
            if self.failures:
                status = self.failures.popleft()
                return status, {"error": {"message": f"scripted {status}", "type": "scripted"}}
            if not self.outputs:
                return 500, {"error": {"message": "the script is exhausted", "type": "scripted"}}
            text = self.outputs.popleft()
            number = len(self.requests)
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
            "usage": {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110},
        }

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                """Recorded, then 404: only chat completions are served."""
                self.do_POST()

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
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
                    status, reply = server._reply(body)
                else:
                    status, reply = 404, {"error": {"message": "not found"}}
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler

    def __enter__(self) -> ScriptedModelServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
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
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

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
