"""Report network attempts that the egress proxy never sees: direct connections and lookups.

Under the `allowlist` policy the sandbox's only way out is the egress proxy named in
`HTTPS_PROXY`/`HTTP_PROXY`: a connection to any other address has no route, and no name
resolves. Those attempts fail inside the sandbox without reaching the proxy, so its log
cannot show them. Under `none` the sandbox has no network at all: every attempt fails
there. This module watches them with an audit hook (`sys.addaudithook`) on
`socket.connect`, `socket.sendto` and `socket.getaddrinfo`/`gethostbyname`, and emits an
`egress_blocked` event (`source: "sandbox"`, `verdict: "denied"`, the cause as `reason`,
and the agent and step that made it) for each distinct destination.

Hosts that `NO_PROXY` names are reached directly by design (the run's model gateway, on the
run's own network): attempts to them are not blocked egress and are not reported.

It is a diagnostic, not a control: the network is what blocks; code that bypasses Python's
socket module (a child process, C code) is not seen. It is active under `none`, and when
a proxy is set.
Standard library only.
"""

from __future__ import annotations

import ipaddress
import os
import sys
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from .events import EventStream

#: At most this many events per run; a loop of attempts must not flood the stream.
MAX_EVENTS = 100
_WATCHED = frozenset(
    {"socket.connect", "socket.sendto", "socket.getaddrinfo", "socket.gethostbyname"}
)


def proxy_addresses() -> set[tuple[str, int]]:
    """The (host, port) of the proxy the sandbox is meant to use."""
    found = set()
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        value = os.environ.get(name)
        if value:
            parts = urlsplit(value if "://" in value else f"http://{value}")
            if parts.hostname:
                found.add((parts.hostname, parts.port or 3128))
    return found


def direct_hosts() -> set[str]:
    """The hosts the sandbox reaches without the proxy (`NO_PROXY`: the model gateway), read
    when the audit starts, before any payload code can change the environment."""
    found: set[str] = set()
    for name in ("NO_PROXY", "no_proxy"):
        for entry in os.environ.get(name, "").split(","):
            host = entry.strip().lower()
            if host and host != "*":  # `*` (proxy nothing) is never what we set
                found.add(host)
    return found


def _is_local(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    return True


class EgressAudit:
    """The audit hook: which attempts to report, each distinct one once."""

    def __init__(
        self,
        events: EventStream,
        proxies: set[tuple[str, int]],
        direct: set[str] | None = None,
        offline: bool = False,
    ) -> None:
        self.events = events
        #: The run has no network (`none`): every attempt is refused, and that is the cause.
        self.offline = offline
        #: The agent and step running now (`agents.Recorder.where`, set once the tree exists).
        self.where: Callable[[], dict[str, Any]] = dict
        self.proxies = proxies
        #: Hosts the sandbox reaches without the proxy by design (lower case).
        self.direct = direct or set()
        self.proxy_hosts = {host for host, _ in proxies}
        self.seen: set[tuple[str, str, int | None]] = set()
        self._local = threading.local()

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if event not in _WATCHED or getattr(self._local, "busy", False):
            return
        self._local.busy = True
        try:
            self._check(event, args)
        except Exception:  # never break the payload's own socket call
            pass
        finally:
            self._local.busy = False

    def _check(self, event: str, args: tuple[Any, ...]) -> None:
        if event in ("socket.connect", "socket.sendto"):
            address = args[1]
            if not (isinstance(address, tuple) and len(address) >= 2):
                return  # a Unix socket or another family: not network egress
            host, port = str(address[0]), address[1]
            if _is_local(host) or (host, port) in self.proxies or host.lower() in self.direct:
                return
            kind = "connect" if event == "socket.connect" else "udp"
            reason = "direct connection: the sandbox's only way out is the egress proxy"
        else:
            host = args[0].decode() if isinstance(args[0], bytes) else str(args[0] or "")
            port = args[1] if event == "socket.getaddrinfo" else None
            if (
                _is_local(host)
                or _is_address(host)
                or host in self.proxy_hosts
                or host.lower() in self.direct
            ):
                return
            port = port if isinstance(port, int) else None
            kind = "dns"
            reason = "name lookup: the sandbox resolves no names (the egress proxy does)"
        if self.offline:
            reason = "the run has no network (network policy none)"
        self.report(kind, host, port, reason)

    def report(self, kind: str, host: str, port: int | None, reason: str) -> None:
        key = (kind, host, port)
        if key in self.seen or len(self.seen) >= MAX_EVENTS:
            return
        self.seen.add(key)
        try:
            where = self.where()
        except Exception:  # the step is a detail; the attempt is what must be reported
            where = {}
        self.events.emit(
            "egress_blocked",
            source="sandbox",
            kind=kind,
            host=host,
            port=port,
            verdict="denied",
            reason=reason,
            **where,
        )


def install(events: EventStream, network: str = "") -> EgressAudit | None:
    """Start reporting (for the rest of the process) under `none`, and when the sandbox has
    an egress proxy (Docker's `allowlist`). Not otherwise: an allowlist without a proxy is
    enforced elsewhere (E2B's lists, or a Docker network that holds only the gateway), and a
    direct connection there may well be allowed."""
    proxies = proxy_addresses()
    if network != "none" and not (proxies and network != "open"):
        return None
    audit = EgressAudit(events, proxies, direct_hosts(), offline=network == "none")
    sys.addaudithook(audit)
    return audit
