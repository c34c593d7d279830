"""The single ASGI app: records every request, then routes it to envd or the control plane.

A request carrying `E2b-Sandbox-Id` is for a sandbox (envd, through the sandbox proxy), as
the SDK sends when `E2B_SANDBOX_URL` is set; anything else is for the control-plane API.
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from .cloud import FakeE2BCloud, RecordedRequest
from .control import api_app
from .edge import Edge
from .envd import SANDBOX_HEADER, EnvdApp
from .templates import UPLOAD_PREFIX

MAX_RECORDED_BODY = 1 << 20


class E2BApp:
    """ASGI entry point of the test server."""

    def __init__(self, cloud: FakeE2BCloud) -> None:
        self.cloud = cloud
        self.api = api_app(cloud)
        self.envd = EnvdApp(cloud)
        self.edge = Edge(cloud)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        port_of = self.edge.route(headers.get("host", ""))
        if port_of is not None:  # a sandbox's port, by name: the edge (edge.py)
            self.cloud.requests.append(
                RecordedRequest(
                    "edge", scope["method"], scope["path"], {}, headers, sandbox_id=port_of[1]
                )
            )
            await self.edge(scope, receive, send, *port_of)
            return
        sandbox_id = headers.get(SANDBOX_HEADER)
        plane = "envd" if sandbox_id is not None else "api"
        query = dict(urllib.parse.parse_qsl(scope.get("query_string", b"").decode()))
        record = RecordedRequest(
            plane, scope["method"], scope["path"], query, headers, sandbox_id=sandbox_id
        )
        self.cloud.requests.append(record)
        chunks: list[bytes] = []
        # Uploaded template files are not JSON and may be large: record the request only.
        keep_body = plane == "api" and not scope["path"].startswith(UPLOAD_PREFIX)

        async def recording_receive() -> Message:
            message = await receive()
            if keep_body and message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    record.body = _decode(b"".join(chunks))
            return message

        async def recording_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)

        app = self.envd if plane == "envd" else self.api
        await app(scope, recording_receive, recording_send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                # Blocking Docker calls run in threads: give them more than the default 6.
                executor = ThreadPoolExecutor(max_workers=64, thread_name_prefix="e2b-server")
                asyncio.get_running_loop().set_default_executor(executor)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return


def _decode(raw: bytes) -> Any:
    if not raw:
        return None
    if len(raw) > MAX_RECORDED_BODY:
        return raw[:MAX_RECORDED_BODY]
    try:
        return json.loads(raw)
    except ValueError:
        return raw
