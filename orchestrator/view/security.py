"""Who may see the viewer, and what a page may do: an ASGI wrapper around the app.

- On a loopback address any local user may connect (as with `inspect view`), but only with a
  loopback Host header: a web page elsewhere cannot reach it by DNS rebinding.
- On any other address every request needs the access token the command printed (in the URL
  once, then an HttpOnly cookie); without it nothing is served, not even the stylesheet.
- Every response carries the Content-Security-Policy (no inline script, no event handler
  attributes, nothing from elsewhere) and headers that stop sniffing, framing and referrers.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qsl, urlencode

from .render import CSP

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

COOKIE = "orchestrator_view_token"
HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
]
LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name in a Host header, without its port (`[::1]:8080` -> `::1`)."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def new_token() -> str:
    return secrets.token_urlsafe(24)


class Guard:
    """The ASGI wrapper (see the module docstring). `token` None: loopback mode."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.token is None:
            if not is_loopback(host_name(headers.get("host", ""))):
                await respond(send, 403, "This viewer answers only to a loopback host name.")
                return
        else:
            query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
            given = query.pop("token", None)
            if given is not None and self.matches(given):
                rest = urlencode(query)
                # One leading slash: `//host` would send the browser to another site.
                location = "/" + scope["path"].lstrip("/") + (f"?{rest}" if rest else "")
                cookie = f"{COOKIE}={given}; Path=/; HttpOnly; SameSite=Strict"
                await respond(
                    send,
                    303,
                    "",
                    [(b"location", location.encode()), (b"set-cookie", cookie.encode())],
                )
                return
            jar = SimpleCookie()
            try:
                jar.load(headers.get("cookie", ""))
            except Exception:
                jar = SimpleCookie()
            bearer = headers.get("authorization", "").removeprefix("Bearer ").strip()
            held = jar[COOKIE].value if COOKIE in jar else bearer
            if not held or not self.matches(held):
                await respond(
                    send,
                    401,
                    "An access token is needed: open the URL that `orchestrator view` "
                    "printed (it ends with ?token=...).",
                )
                return

        async def secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *HEADERS]
            await send(message)

        await self.app(scope, receive, secured)

    def matches(self, given: str) -> bool:
        assert self.token is not None
        return hmac.compare_digest(given.encode(), self.token.encode())


async def respond(
    send: Send, status: int, text: str, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = text.encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
                *HEADERS,
                *(extra or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
