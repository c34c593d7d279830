"""A remote MCP server for the bound-secret runs: the `mcp` package's FastMCP, its streamable
HTTP app (`/mcp`) and its SSE app (`/sse`, `/messages/`) served together by uvicorn over TLS
with a CA of its own, on an address of this host a container reaches, behind
tests/https_upstream.py's CONNECT stand-in for squid (so that its name needs no resolver).

It is a server that wants a bearer token: a request without `Authorization: Bearer <token>`
gets 401 and never reaches FastMCP. Every request is recorded (method, path, headers) before
that decision. Its one tool answers with a nonce made when the server starts, so an answer
that quotes it came from this server."""

from __future__ import annotations

import secrets
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from mcp.server.fastmcp import FastMCP
from mcp.server.transport_security import TransportSecuritySettings

from .https_upstream import Upstream, make_ca, make_leaf, stand_in

BOOKS = {"dune": ("Frank Herbert", 1965), "solaris": ("Stanisław Lem", 1961)}


@dataclass
class McpServer:
    """The running server: what it received (`upstream.requests`), its CA (`upstream.ca`),
    the stand-in's port (`upstream.proxy_port`), and the nonce its tool answers with."""

    upstream: Upstream
    nonce: str

    def facts(self, title: str) -> str:
        """What the tool answers for `title` (a book in `BOOKS`)."""
        author, year = BOOKS[title.lower()]
        return f"{title} was written by {author} in {year} (almanac {self.nonce})"


def almanac(host: str, nonce: str) -> Any:
    """FastMCP's streamable HTTP app with its SSE app's routes beside it (one lifespan: the
    streamable app's session manager). Host checking on, for `host` only, as a server
    published under a name keeps it."""
    server = FastMCP(
        "almanac",
        log_level="WARNING",
        transport_security=TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=[host, f"{host}:*"],
            allowed_origins=[f"https://{host}"],
        ),
    )

    @server.tool()
    def book_facts(title: str) -> str:
        """Who wrote a book, and when.

        Args:
            title: the book's title, e.g. "Dune".
        """
        author, year = BOOKS.get(title.strip().lower(), ("unknown", 0))
        return f"{title} was written by {author} in {year} (almanac {nonce})"

    app = server.streamable_http_app()
    app.router.routes.extend(server.sse_app().routes)
    return app


class BearerGate:
    """ASGI middleware: records each HTTP request, lets through only the expected bearer
    token (401 otherwise: a server that cannot tell a placeholder from its token)."""

    def __init__(self, app: Any, token: str, upstream: Upstream) -> None:
        self.app, self.token, self.upstream = app, token, upstream

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        self.upstream.requests.append(
            {
                "method": scope["method"],
                "host": headers.get("host"),
                "path": scope["path"],
                "headers": headers,
            }
        )
        if headers.get("authorization") != f"Bearer {self.token}":
            await send({"type": "http.response.start", "status": 401, "headers": []})
            await send({"type": "http.response.body", "body": b"unauthorized\n"})
            return
        await self.app(scope, receive, send)


@contextmanager
def mcp_server(folder: Path, host: str, token: str, address: str) -> Iterator[McpServer]:
    """The almanac on `address` over TLS for `host`, wanting `token`, and the CONNECT
    stand-in in front of it; stopped (its open streams closed) when the block ends."""
    ca = make_ca(folder, "mcp-ca")
    key, cert = make_leaf(folder, ca, [host])
    nonce = secrets.token_hex(8)
    upstream = Upstream(ca=ca[1], address=address)
    listener = socket.create_server((address, 0))
    upstream.port = listener.getsockname()[1]
    config = uvicorn.Config(
        BearerGate(almanac(host, nonce), token, upstream),
        ssl_keyfile=str(key),
        ssl_certfile=str(cert),
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=5,  # an SSE stream a client left open
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        while not server.started:  # uvicorn's own flag: its lifespan ran, it listens
            if not thread.is_alive():
                raise RuntimeError("the MCP server did not start (see its log above)")
            threading.Event().wait(0.05)
        with stand_in(upstream):
            yield McpServer(upstream, nonce)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        listener.close()
