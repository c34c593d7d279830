"""The secret interceptor: mitmproxy with one addon, on a run's egress path.

A bound secret never enters the sandbox: the sandbox holds a placeholder, and this proxy
puts the value into a request only when the request goes, over TLS, to a host the secret is
bound to (its SNI, its CONNECT authority and its Host header all naming that host), and only
in the places declared (`header`: any header value, Authorization's Basic credentials
included; `query`; `body`). A placeholder anywhere else (another host, an undeclared place,
plain HTTP, a Host that differs from the SNI, percent-, base64- or hex-encoded) refuses the
request with 403 before any connection upstream is made (the upstream connection is lazy); in a
WebSocket message it ends the connection. What is not HTTP inside a tunnel is never relayed
(`rawtcp` off). Responses have each value replaced by its placeholder, its encoded forms by `***`;
an event stream (Server-Sent Events) is relayed as it arrives, each event scrubbed whole.

TLS and HTTP are mitmproxy's; this file decides only where a value may go. It runs in its own
interpreter (mitmproxy's), imports nothing from the orchestrator package, and finds
`masking.py` (the runtime's, standard library only) beside itself.

Configuration comes as one JSON line on stdin, as the model gateway gets its key (values
never in an argument, an environment variable or a file):

    {"listen": ["0.0.0.0", 3129],             port 0: any; the bound port is reported
     "confdir": "/tmp/interceptor",           tmpfs: where mitmproxy makes the run's CA
     "upstream_proxy": "http://egress:3128",  optional: squid, the allowlist, after us
     "upstream_ca": "/path/ca.pem",           optional: extra CAs upstream (tests)
     "upstream_ca_pem": "-----BEGIN ...",     optional: the same as text (a container's
                                               tests: no file to mount)
     "bindings": [{"name": "ANALYTICS_TOKEN", "placeholder": "...", "value": "...",
                   "hosts": ["api.example.com", "*.example.org"], "in": ["header"]}],
     "passthrough": ["pinned.example.net"]}    optional: hosts whose TLS is relayed unread
                                               (pinning clients); no secret is bound to one

A passthrough host's TLS is not intercepted when the CONNECT authority and the SNI both name
it: the client sees the real server's certificate, and whatever it sends goes unread (a
placeholder too, but never a value: none is injected there). Logged as `passthrough`.

Every decision is one line on stdout, `ORCH-SECRET<TAB>{json}`, read back by the host like
squid's access log: `injected` (name, host, place) and `refused` (reason `secret_not_bound`,
name, host, place, why), `tls_failed` (a client that refused our certificate: pinning, its
own CA store), `upstream_tls_failed` (a server whose certificate did not verify, why).
`ORCH-INTERCEPTOR-READY<TAB>host:port<TAB>CERT` says it listens; CERT is the run's CA
certificate (PEM, base64 on one line), what the sandbox must trust.

The run's CA is made by mitmproxy as it starts, in `confdir` (a tmpfs in the container): a
fresh one per run, whose key never leaves this process's files and memory (the host, the
sandbox, the image and the container's configuration never hold it).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, quote_plus, unquote, unquote_plus

sys.path.insert(0, str(Path(__file__).resolve().parent))
from masking import Masker  # beside this file, in the image and in tests

PLACES = ("header", "query", "body")
REASON = "secret_not_bound"
LOG_PREFIX = "ORCH-SECRET"
EVENT_STREAM = "text/event-stream"
EVENT_ENDS = (b"\n\n", b"\r\r", b"\r\n\r\n")
READY_PREFIX = "ORCH-INTERCEPTOR-READY"
_NAME = re.compile(
    r"^(\*\.)?([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
)


@dataclass(frozen=True)
class Binding:
    """One secret: its placeholder (what the sandbox holds), its value, where it may go."""

    name: str
    placeholder: str
    value: str
    hosts: tuple[str, ...]
    places: tuple[str, ...]

    @classmethod
    def parse(cls, data: dict[str, Any]) -> Binding:
        """Checked again here: a malformed binding stops the proxy (fail closed)."""
        hosts = tuple(str(h).lower() for h in data["hosts"])
        places = tuple(data.get("in") or ("header",))
        placeholder, value = str(data["placeholder"]), str(data["value"])
        if not hosts or any(not _NAME.match(h) for h in hosts):
            raise ValueError(f"binding {data.get('name')!r}: bad hosts {hosts!r}")
        if not places or any(p not in PLACES for p in places):
            raise ValueError(f"binding {data.get('name')!r}: bad places {places!r}")
        if len(placeholder) < 16 or not value or placeholder in value or value in placeholder:
            raise ValueError(f"binding {data.get('name')!r}: bad placeholder or value")
        return cls(str(data["name"]), placeholder, value, hosts, places)

    def bound_to(self, host: str) -> bool:
        """`host` is one of the bound names, or under a bound `*.` pattern (not its apex)."""
        return any(covers(h, host) for h in self.hosts)


def covers(entry: str, host: str) -> bool:
    """`entry` (a name or a `*.` pattern) names `host` (a name, or a pattern under it)."""
    under = entry.startswith("*.") and host.removeprefix("*.").endswith(entry[1:])
    return host == entry or under


def passthrough_list(config: dict[str, Any], bindings: list[Binding]) -> tuple[str, ...]:
    """The passthrough hosts, checked: names or patterns, none that a binding's host shares
    (a secret bound to a host whose TLS is not read could never be injected: fail closed)."""
    hosts = tuple(str(h).lower() for h in config.get("passthrough") or ())
    for host in hosts:
        if not _NAME.match(host):
            raise ValueError(f"passthrough: not a host name {host!r}")
        for binding in bindings:
            if any(covers(host, b) or covers(b, host) for b in binding.hosts):
                raise ValueError(f"passthrough {host!r}: {binding.name} is bound there")
    return hosts


def decoded_forms(text: str) -> list[str]:
    """`text` and what percent-decoding makes of it (up to three layers), so that a
    placeholder spelt `%6F%72...` is found too; base64 and hex are found by the masker."""
    forms = [text]
    for _ in range(3):
        nxt = {unquote(forms[-1]), unquote_plus(forms[-1])} - set(forms)
        if not nxt:
            break
        forms.extend(sorted(nxt))
    return forms


class Finder:
    """Finds a placeholder in text: as it is, or in any encoding `masking.Masker` masks
    (base64 at any alignment, hex, percent), after percent-decoding."""

    def __init__(self, placeholder: str) -> None:
        self.masker = Masker([placeholder])

    def __call__(self, text: str) -> bool:
        return any(self.masker(form) != form for form in decoded_forms(text))


class Scrubber:
    """A response's text with a value put back as its placeholder, its encoded forms masked."""

    def __init__(self, binding: Binding) -> None:
        self.value, self.placeholder = binding.value, binding.placeholder
        self.masker = Masker([binding.value])

    def __call__(self, text: str) -> str:
        return self.masker(text.replace(self.value, self.placeholder))


class EventScrubber:
    """A Server-Sent Events body relayed as it arrives, scrubbed one whole event at a time:
    bytes are held until the blank line that ends an event (the unit a client acts on), so a
    value split across chunks is still found; what is left at the end is scrubbed too.
    mitmproxy calls it with each chunk, and with b"" when the body ends; it sends each item
    of the list returned (none while an event is incomplete: an empty chunk would end a
    chunked body)."""

    def __init__(self, scrubbers: list[Scrubber]) -> None:
        self.scrubbers = scrubbers
        self.held = b""

    def __call__(self, chunk: bytes) -> list[bytes]:
        self.held += chunk
        end = len(self.held) if not chunk else event_end(self.held)
        done, self.held = self.held[:end], self.held[end:]
        if not done:
            return []
        text = done.decode("latin-1")
        for scrub in self.scrubbers:
            text = scrub(text)
        return [text.encode("latin-1")]


def event_end(data: bytes) -> int:
    """Where the last complete event of a Server-Sent Events stream ends (after its blank
    line: LF, CR or CRLF line ends), 0 when none has ended yet."""
    ends = [data.rfind(blank) + len(blank) for blank in EVENT_ENDS if blank in data]
    return max(ends, default=0)


def emit(record: dict[str, Any]) -> None:
    print(f"{LOG_PREFIX}\t{json.dumps({'ts': round(time.time(), 3), **record})}", flush=True)


def basic_value(header: str) -> str | None:
    """The `user:password` of a Basic Authorization header, or None."""
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        return base64.b64decode(token.strip(), validate=True).decode("latin-1")
    except (binascii.Error, ValueError):
        return None


class SecretBinder:
    """The mitmproxy addon: injects bound secrets, refuses placeholders elsewhere, scrubs
    responses. `connects` maps a client connection to the authority of its CONNECT."""

    def __init__(self, bindings: list[Binding], passthrough: tuple[str, ...] = ()) -> None:
        self.bindings = bindings
        self.passthrough = passthrough
        self.finders = {b.name: Finder(b.placeholder) for b in bindings}
        self.scrubbers = {b.name: Scrubber(b) for b in bindings}
        self.connects: dict[str, str] = {}

    # ---- hooks ---------------------------------------------------------------------------

    def http_connect(self, flow: Any) -> None:
        self.connects[flow.client_conn.id] = flow.request.host.lower()

    def client_disconnected(self, client: Any) -> None:
        self.connects.pop(client.id, None)

    def request(self, flow: Any) -> None:
        host = self.bound_host(flow)
        for binding in self.bindings:
            refusal = self.place(flow, binding, host)
            if refusal is not None:
                self.refuse(flow, binding, *refusal)
                return

    def responseheaders(self, flow: Any) -> None:
        """The response's headers scrubbed before anything of it goes on; an event stream
        (`text/event-stream`: MCP's streamable HTTP and SSE transports, streamed model
        answers) is then relayed as it comes, one event at a time (`EventScrubber`): held
        whole until its end it would never reach the client (a stream stays open)."""
        response = flow.response
        self.scrub_headers(response)
        kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
        encoded = response.headers.get("content-encoding", "identity").strip().lower()
        if kind == EVENT_STREAM and encoded == "identity":  # else buffered and decoded
            response.stream = EventScrubber([self.scrubbers[b.name] for b in self.bindings])

    def response(self, flow: Any) -> None:
        """Each value echoed back becomes its placeholder; an encoded form of it (base64,
        hex, percent, as `masking` knows them) becomes `***`: the sandbox never reads one.
        Headers were scrubbed as they arrived (`responseheaders`), a stream as it went."""
        if flow.response is None or flow.metadata.get("orchestrator_refused"):
            return
        response = flow.response
        self.scrub_headers(response)  # again: one an addon or mitmproxy itself made
        if response.stream:
            return
        for binding in self.bindings:
            scrub = self.scrubbers[binding.name]
            content = response.get_content(strict=False)
            if content:
                text = content.decode("latin-1")
                if scrub(text) != text:
                    response.set_content(scrub(text).encode("latin-1"))

    def scrub_headers(self, response: Any) -> None:
        for binding in self.bindings:
            scrub = self.scrubbers[binding.name]
            for name in list(response.headers.keys()):
                values = response.headers.get_all(name)
                scrubbed = [scrub(v) for v in values]
                if scrubbed != values:
                    response.headers.set_all(name, scrubbed)

    def websocket_message(self, flow: Any) -> None:
        self.refuse_message(flow, flow.websocket.messages[-1], "websocket")

    def tcp_message(self, flow: Any) -> None:
        self.refuse_message(flow, flow.messages[-1], "tcp")

    def tls_clienthello(self, data: Any) -> None:
        """A passthrough host's TLS goes unread, when the tunnel and the SNI both name it."""
        sni = (data.client_hello.sni or "").lower()
        connect = self.connects.get(data.context.client.id)
        if sni and connect == sni and any(covers(p, sni) for p in self.passthrough):
            data.ignore_connection = True
            emit({"verdict": "passthrough", "host": sni})

    def tls_start_client(self, tls_start: Any) -> None:
        """HTTP/2 when the client offers it: clients list `http/1.1` first through a proxy
        (httpx does), and mitmproxy, with no server connection yet (lazy), takes the
        client's first choice."""
        app = tls_start.ssl_conn.get_app_data()
        offers = tls_start.context.client.alpn_offers or []
        if b"h2" in offers and app["client_alpn"] is None and app["server_alpn"] is None:
            app["client_alpn"] = b"h2"

    def tls_failed_client(self, data: Any) -> None:
        emit(
            {
                "verdict": "tls_failed",
                "host": data.context.client.sni,
                "why": str(
                    data.conn.error
                    or "the client refused the interception's "
                    "certificate (certificate pinning, or its own CA store)"
                ),
            }
        )

    def tls_failed_server(self, data: Any) -> None:
        """The upstream's certificate did not verify (or its TLS failed): the client gets a
        502, and the host records why (an `egress_failed` event)."""
        emit(
            {
                "verdict": "upstream_tls_failed",
                "host": data.conn.sni or (data.conn.address or ("?",))[0],
                "why": str(data.conn.error or "TLS with the server failed"),
            }
        )

    # ---- decisions -----------------------------------------------------------------------

    def bound_host(self, flow: Any) -> str | None:
        """The host a request goes to when SNI, CONNECT authority and Host header all name
        the same one over TLS; else None (no secret may be injected into it)."""
        request = flow.request
        sni = (flow.client_conn.sni or "").lower()
        connect = self.connects.get(flow.client_conn.id)
        host_header = (request.host_header or "").lower()
        host = host_header.rsplit(":", 1)[0] if not host_header.endswith("]") else host_header
        if request.scheme != "https" or not flow.client_conn.tls_established:
            return None
        if not sni or sni != connect or sni != host or request.host.lower() != sni:
            return None
        return sni

    def place(self, flow: Any, binding: Binding, host: str | None) -> tuple[str, str] | None:
        """Inject `binding` where it may go; the (place, why) of a refusal, or None."""
        request = flow.request
        find = self.finders[binding.name]
        bound = host is not None and binding.bound_to(host)
        why_not = self.why_not_bound(flow, binding, host)
        injected: list[str] = []
        for name, value in request.headers.items(multi=True):
            basic = basic_value(value) if name.lower() == "authorization" else None
            if not (find(name) or find(value) or (basic is not None and find(basic))):
                continue
            if not bound or "header" not in binding.places:
                return f"header:{name}", why_not or "headers are not a declared place"
            injected.append(f"header:{name}")
        for name, value in (request.trailers or {}).items():
            if find(name) or find(value):
                return f"trailer:{name}", "a trailer is never a place for a secret"
        path, _, query = request.path.partition("?")
        if find(path):
            return "path", why_not or "the path is never a place for a secret"
        if query and find(query):
            if not bound or "query" not in binding.places:
                return "query", why_not or "the query is not a declared place"
            injected.append("query")
        body = request.get_content(strict=False) or b""
        if body and find(body.decode("latin-1")):
            if not bound or "body" not in binding.places:
                return "body", why_not or "the body is not a declared place"
            injected.append("body")
        if injected:
            self.inject(flow, binding, injected)
            leftover = self.leftover(flow, binding)
            if leftover:
                return leftover, "an encoded placeholder is left after injection"
            for where in injected:
                emit({"verdict": "injected", "name": binding.name, "host": host, "place": where})
        return None

    @staticmethod
    def why_not_bound(flow: Any, binding: Binding, host: str | None) -> str:
        if flow.request.scheme != "https":
            return "plain HTTP: a secret goes only over TLS"
        if host is None:
            return "the TLS server name, the CONNECT authority and the Host header differ"
        if not binding.bound_to(host):
            return f"{host} is not a host {binding.name} is bound to"
        return ""

    def inject(self, flow: Any, binding: Binding, places: list[str]) -> None:
        request, ph, value = flow.request, binding.placeholder, binding.value
        for name in {p.split(":", 1)[1] for p in places if p.startswith("header:")}:
            values = []
            for item in request.headers.get_all(name):
                basic = basic_value(item) if name.lower() == "authorization" else None
                if basic is not None and ph in basic:
                    token = base64.b64encode(basic.replace(ph, value).encode("latin-1"))
                    item = f"{item.partition(' ')[0]} {token.decode()}"
                values.append(item.replace(ph, value))
            request.headers.set_all(name, values)
        if "query" in places:
            path, _, query = request.path.partition("?")
            request.path = f"{path}?{query.replace(ph, quote(value, safe=''))}"
        if "body" in places:
            form = "application/x-www-form-urlencoded" in request.headers.get("content-type", "")
            new = quote_plus(value, safe="") if form else value
            request.set_content(
                request.get_content(strict=False).replace(ph.encode(), new.encode())
            )

    def leftover(self, flow: Any, binding: Binding) -> str | None:
        """Where a placeholder is still found after injection (an encoded one), or None."""
        find, request = self.finders[binding.name], flow.request
        for name, value in request.headers.items(multi=True):
            if find(name) or find(value) or find(basic_value(value) or ""):
                return f"header:{name}"
        if find(request.path):
            return "query"
        body = request.get_content(strict=False) or b""
        return "body" if body and find(body.decode("latin-1")) else None

    def refuse(self, flow: Any, binding: Binding, place: str, why: str) -> None:
        from mitmproxy import http

        host = flow.request.pretty_host
        emit(
            {
                "verdict": "refused",
                "reason": REASON,
                "name": binding.name,
                "host": host,
                "place": place,
                "method": flow.request.method,
                "why": why,
            }
        )
        flow.metadata["orchestrator_refused"] = True
        flow.response = http.Response.make(
            403,
            f"Refused by the orchestrator: the placeholder of {binding.name} in {place} of a "
            f"request to {host} ({why}); it is bound to {', '.join(binding.hosts)} "
            f"({', '.join(binding.places)}).\n",
            {"content-type": "text/plain", "x-orchestrator-refused": REASON},
        )

    def refuse_message(self, flow: Any, message: Any, kind: str) -> None:
        text = message.content.decode("latin-1")
        for binding in self.bindings:
            if self.finders[binding.name](text):
                emit(
                    {
                        "verdict": "refused",
                        "reason": REASON,
                        "name": binding.name,
                        "host": flow.client_conn.sni,
                        "place": kind,
                        "why": f"a {kind} message is never a place for a secret",
                    }
                )
                if kind == "tcp":
                    message.content = b""  # what the hook leaves is what is sent
                else:
                    message.drop()
                flow.kill()
                return


class Ready:
    """Says where the proxy listens, and the run's CA certificate, once its servers are up."""

    def running(self) -> None:
        from mitmproxy import ctx

        pem = ctx.master.addons.get("tlsconfig").certstore.default_ca.to_pem()
        cert = base64.b64encode(pem).decode()
        for address in ctx.master.addons.get("proxyserver").listen_addrs():
            print(f"{READY_PREFIX}\t{address[0]}:{address[1]}\t{cert}", flush=True)


async def serve(config: dict[str, Any]) -> None:
    from mitmproxy import options
    from mitmproxy.tools.dump import DumpMaster

    bindings = [Binding.parse(b) for b in config["bindings"]]
    confdir = Path(config["confdir"])
    confdir.mkdir(mode=0o700, parents=True)  # a fresh one: a CA found there is never reused
    host, port = config["listen"]
    opts = options.Options(listen_host=host, listen_port=int(port), confdir=str(confdir))
    master = DumpMaster(opts, with_termlog=False, with_dumper=False)
    settings: dict[str, Any] = {
        "connection_strategy": "lazy",  # no upstream connection before a request is let through
        "ssl_insecure": False,  # upstream certificates verified
        "upstream_cert": False,  # certificates from the SNI: no upstream connection for them
        "http2": True,
        "rawtcp": False,  # what is not HTTP inside a tunnel is refused, never relayed unread
    }
    if config.get("upstream_proxy"):
        settings["mode"] = [f"upstream:{config['upstream_proxy']}"]
    if config.get("upstream_ca_pem"):
        (confdir / "upstream-ca.pem").write_text(config["upstream_ca_pem"])
        config["upstream_ca"] = str(confdir / "upstream-ca.pem")
    if config.get("upstream_ca"):
        settings["ssl_verify_upstream_trusted_ca"] = config["upstream_ca"]
    opts.update(**settings)
    master.addons.add(SecretBinder(bindings, passthrough_list(config, bindings)), Ready())
    await master.run()


def main() -> None:
    # mitmproxy's import (most of its start-up) needs nothing of the run: done before the
    # configuration arrives, it overlaps the sandbox's own start instead of following it.
    from mitmproxy.tools.dump import DumpMaster  # noqa: F401

    config = json.loads(sys.stdin.readline())  # one line: an attached stdin stays open
    sys.stdin.close()
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
