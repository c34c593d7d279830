"""A model endpoint on this host for the gateway's check: OpenAI's chat-completions shape,
answering every call with one CodeAgent step that runs the probe, and keeping the
credentials each call came with (what the gateway forwarded, where the key must be)."""

from __future__ import annotations

import http.server
import json
import threading
import time
from typing import Any

#: The one step every answer holds: the probe does what its action says.
STEP = (
    "Thought: I will do what the action says.\n<code>\nfinal_answer(probe(action=action))\n</code>"
)
#: The usage every answer declares (what a gateway measures per call).
PROMPT_TOKENS, COMPLETION_TOKENS = 10, 5


class ModelStub:
    """Serves until `close`; `authorizations` holds each call's credential headers."""

    def __init__(self) -> None:
        self.authorizations: list[str] = []
        self.gets = 0
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                stub.authorizations.append(
                    self.headers.get("Authorization") or self.headers.get("X-Api-Key") or ""
                )
                body = json.dumps(stub.completion()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                stub.gets += 1
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, format: str, *args: Any) -> None:
                return

        self.server = http.server.ThreadingHTTPServer(("0.0.0.0", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def api_base(self, host: str = "127.0.0.1") -> str:
        """Its URL as reached at `host` (it listens on every address of this host)."""
        return f"http://{host}:{self.port}/v1"

    @staticmethod
    def completion() -> dict[str, Any]:
        return {
            "id": "chatcmpl-conformance",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": "conformance",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": STEP},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": PROMPT_TOKENS,
                "completion_tokens": COMPLETION_TOKENS,
                "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS,
            },
        }

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
