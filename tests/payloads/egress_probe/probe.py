"""The egress tests' probe: network attempts from inside the sandbox, outcomes as JSON.

Each attempt is a dict with a `kind`:
- `http`: GET `url` with urllib (which uses the proxy variables, like most clients);
- `proxied`: GET `url` through the proxy whatever NO_PROXY says (a raw request to it), with
  the `Host` header `host` (default: the URL's);
- `connect`: a raw `CONNECT host:port` to the proxy, then a TLS handshake with `sni`
  (default: host) and a HEAD request;
- `tcp`: a direct TCP connection to `host:port` (no proxy);
- `dns`: resolve `name`;
- `listen`: accept TCP connections on `port` for `seconds`, and count them (the count so far
  to stderr every half second, with its time: `listened TIME: COUNT`);
- `poll`: GET `url` every `interval` seconds for `seconds`, printing each outcome to stderr
  as it happens (for watching the network go away mid-run).
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import sys
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from smolagents import CodeAgent, tool


def _http(url: str, timeout: float = 10) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return {"ok": True, "status": response.status}
    except urllib.error.HTTPError as exc:
        return {"ok": False, "status": exc.code, "error": f"HTTP {exc.code}"}
    except Exception as exc:
        return {"ok": False, "status": None, "error": f"{type(exc).__name__}: {exc}"}


def _proxied(url: str, host: str | None) -> dict[str, Any]:
    proxy = urlsplit(os.environ["HTTP_PROXY"])
    host = host or urlsplit(url).netloc
    try:
        with socket.create_connection((proxy.hostname, proxy.port), timeout=10) as sock:
            request = f"GET {url} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
            sock.sendall(request.encode())
            head = sock.recv(4096).decode("latin-1").split("\r\n")[0]
    except OSError as exc:
        return {"ok": False, "status": None, "error": f"{type(exc).__name__}: {exc}"}
    status = int(head.split()[1]) if len(head.split()) > 1 else None
    return {"ok": status == 200, "status": status, "reply": head}


def _connect(host: str, port: int, sni: str | None) -> dict[str, Any]:
    proxy = urlsplit(os.environ["HTTPS_PROXY"])
    try:
        sock = socket.create_connection((proxy.hostname, proxy.port), timeout=10)
    except OSError as exc:
        return {"ok": False, "status": None, "error": f"proxy: {type(exc).__name__}: {exc}"}
    with sock:
        sock.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        head = sock.recv(4096).decode("latin-1").split("\r\n")[0]
        status = int(head.split()[1]) if len(head.split()) > 1 else None
        if status != 200:
            return {"ok": False, "status": status, "error": head}
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # the tunnel is what is tested, not the server
        try:
            with context.wrap_socket(sock, server_hostname=sni or host) as tls:
                tls.sendall(
                    f"HEAD / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
                )
                reply = tls.recv(4096).decode("latin-1").split("\r\n")[0]
        except (OSError, ssl.SSLError) as exc:
            return {"ok": False, "status": status, "error": f"TLS: {type(exc).__name__}: {exc}"}
        return {"ok": True, "status": status, "reply": reply}


def _tcp(host: str, port: int, timeout: float = 3) -> dict[str, Any]:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return {"ok": True}
    except OSError as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def _dns(name: str) -> dict[str, Any]:
    try:
        addresses = sorted({info[4][0] for info in socket.getaddrinfo(name, 80)})
        return {"ok": True, "addresses": addresses}
    except OSError as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def _listen(port: int, seconds: float) -> dict[str, Any]:
    server = socket.create_server(("0.0.0.0", port))
    server.settimeout(0.2)
    print(f"listening on {port}", file=sys.stderr, flush=True)
    connections, deadline, told = 0, time.monotonic() + seconds, 0.0
    with server:
        while time.monotonic() < deadline:
            if time.monotonic() - told >= 0.5:  # the count so far, with the time it was taken
                print(f"listened {time.time():.3f}: {connections}", file=sys.stderr, flush=True)
                told = time.monotonic()
            try:
                client, _ = server.accept()
                client.close()
                connections += 1
            except TimeoutError:
                continue
    return {"ok": True, "connections": connections}


def _poll(url: str, seconds: float, interval: float) -> dict[str, Any]:
    print("polling", file=sys.stderr, flush=True)
    outcomes, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        sent = time.time()  # when the request left: one sent before a cut may still succeed
        outcome = _http(url, timeout=interval)
        print(f"poll {sent:.3f} {'ok' if outcome['ok'] else 'failed'}", file=sys.stderr)
        outcomes.append(outcome["ok"])
        time.sleep(interval)
    return {"ok": all(outcomes), "outcomes": outcomes}


def attempt(spec: dict[str, Any]) -> dict[str, Any]:
    kind = spec["kind"]
    if kind == "http":
        return _http(spec["url"])
    if kind == "proxied":
        return _proxied(spec["url"], spec.get("host"))
    if kind == "connect":
        return _connect(spec["host"], int(spec["port"]), spec.get("sni"))
    if kind == "tcp":
        return _tcp(spec["host"], int(spec["port"]))
    if kind == "dns":
        return _dns(spec["name"])
    if kind == "listen":
        return _listen(int(spec["port"]), float(spec["seconds"]))
    if kind == "poll":
        return _poll(spec["url"], float(spec["seconds"]), float(spec.get("interval", 0.1)))
    return {"ok": False, "error": f"unknown kind {kind!r}"}


@tool
def probe(attempts: str) -> str:
    """Make network attempts and report their outcomes.

    Args:
        attempts: a JSON list of attempts, each a dict with a `kind` and its parameters.
    """
    return json.dumps([{**spec, **attempt(spec)} for spec in json.loads(attempts)])


def build(model):
    return CodeAgent(tools=[probe], model=model, max_steps=2)
