"""Real TLS for the interceptor's tests, on 127.0.0.1 (or an address of this host a container
reaches): certificate authorities made with
`openssl`, an HTTPS server that records every request it receives (and can echo a header or
redirect), and a CONNECT proxy standing in for squid that sends every tunnel to that server,
whatever name it was asked for (so that `api.example.com` is this host without DNS)."""

from __future__ import annotations

import base64
import http.server
import json
import socket
import socketserver
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote


def make_ca(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA: (key, certificate), PEM files in `folder`."""
    key, cert = folder / f"{name}.key", folder / f"{name}.crt"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            f"/CN={name}",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
        check=True,
        capture_output=True,
    )
    return key, cert


def make_leaf(folder: Path, ca: tuple[Path, Path], names: list[str]) -> tuple[Path, Path]:
    """A server certificate for `names`, signed by `ca`: (key, certificate)."""
    key, csr, cert = folder / "leaf.key", folder / "leaf.csr", folder / "leaf.crt"
    subprocess.run(
        [
            "openssl",
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={names[0]}",
            "-keyout",
            str(key),
            "-out",
            str(csr),
        ],
        check=True,
        capture_output=True,
    )
    ext = folder / "leaf.ext"
    ext.write_text("subjectAltName=" + ",".join(f"DNS:{n}" for n in names) + "\n")
    subprocess.run(
        [
            "openssl",
            "x509",
            "-req",
            "-in",
            str(csr),
            "-CA",
            str(ca[1]),
            "-CAkey",
            str(ca[0]),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            str(ext),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return key, cert


@dataclass
class Upstream:
    """What the HTTPS server received: one dict per request (method, host, path, headers,
    body), and the tunnels the stand-in for squid was asked for."""

    port: int = 0
    address: str = "127.0.0.1"  # where the server and the stand-in listen
    requests: list[dict[str, Any]] = field(default_factory=list)
    tunnels: list[str] = field(default_factory=list)
    proxy_port: int = 0
    ca: Path = Path()  # the server's CA certificate
    #: Set to end the event stream `/events` holds open after its first event.
    release: threading.Event = field(default_factory=threading.Event)

    def holding(self, text: str) -> list[dict[str, Any]]:
        """The requests that arrived with `text` anywhere in them."""
        return [r for r in self.requests if text in json.dumps(r)]


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    upstream: Upstream
    # One write per response, no Nagle: else each answer waits out a delayed ACK (40 ms).
    disable_nagle_algorithm = True
    wbufsize = 1 << 16

    def log_message(self, *args: Any) -> None:
        pass

    def _any(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length).decode("latin-1") if length else ""
        record = {
            "method": self.command,
            "host": self.headers.get("host"),
            "path": self.path,
            "headers": dict(self.headers.items()),
            "body": body,
        }
        self.upstream.requests.append(record)
        if self.path.startswith("/events"):
            self._events()
            return
        if self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("location", self.path.split("to=", 1)[1])
            self.send_header("content-length", "0")
            self.end_headers()
            return
        payload = json.dumps(record).encode()  # the request echoed back, headers and all
        if self.path.startswith("/encoded"):  # the header echoed as base64, hex, percent
            key = (self.headers.get("x-api-key") or "").encode()
            forms = [base64.b64encode(key), key.hex().encode(), quote(key, safe="").encode()]
            payload = b"\n".join(forms)
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("x-echo-authorization", self.headers.get("authorization") or "")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _events(self) -> None:
        """An event stream (Server-Sent Events, chunked): a first event echoing the request's
        X-Api-Key, sent in two chunks split inside the value, then held open until the test
        sets `release`, then a last event."""
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        key = self.headers.get("x-api-key") or ""
        half = len(key) // 2
        first = f"event: echo\ndata: {key[:half]}".encode(), f"{key[half:]}\n\n".encode()
        for index, part in enumerate(first):
            self._chunk(part)
            if index == 0:  # the halves in separate reads at the proxy, not one
                time.sleep(0.2)
        self.upstream.release.wait(timeout=120)
        self._chunk(b"event: end\ndata: bye\n\n")
        self._chunk(b"")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    do_GET = do_POST = do_PUT = _any


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


def _tunnel(client: socket.socket, upstream: Upstream) -> None:
    """One CONNECT: recorded, then joined to the HTTPS server byte for byte."""
    with client:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = client.recv(4096)
            if not chunk:
                return
            data += chunk
        line = data.split(b"\r\n", 1)[0].decode("latin-1")
        method, target, _ = line.split(" ", 2)
        if method != "CONNECT":
            upstream.tunnels.append(f"{method} {target}")
            client.sendall(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n")
            return
        upstream.tunnels.append(target)
        with socket.create_connection((upstream.address, upstream.port)) as server:
            for end in (client, server):
                end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            rest = data.split(b"\r\n\r\n", 1)[1]
            if rest:
                server.sendall(rest)

            def pump(src: socket.socket, dst: socket.socket) -> None:
                with suppress(OSError):
                    while chunk := src.recv(65536):
                        dst.sendall(chunk)
                with suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)

            back = threading.Thread(target=pump, args=(server, client), daemon=True)
            back.start()
            pump(client, server)
            back.join()


@contextmanager
def https_upstream(
    folder: Path, names: list[str], address: str = "127.0.0.1"
) -> Iterator[tuple[Upstream, Path]]:
    """An HTTPS server with its own CA for `names`, and the CONNECT stand-in in front of it,
    both on `address` (a container reaches this host at its network's gateway); yields the
    record and the CA certificate (what the proxy must trust upstream)."""
    ca = make_ca(folder, "upstream-ca")
    key, cert = make_leaf(folder, ca, names)
    upstream = Upstream(ca=ca[1], address=address)
    handler = type("Handler", (_Handler,), {"upstream": upstream})
    server = _Server((address, 0), handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    upstream.port = server.server_address[1]
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    try:
        with stand_in(upstream):
            yield upstream, ca[1]
    finally:
        upstream.release.set()  # an event stream still held open ends
        server.shutdown()
        server.server_close()


@contextmanager
def stand_in(upstream: Upstream) -> Iterator[None]:
    """The CONNECT stand-in for squid on `upstream.address` (its port: `proxy_port`): every
    tunnel, whatever name it asks for, joined to the server at `upstream.port`."""
    listener = socket.create_server((upstream.address, 0))
    upstream.proxy_port = listener.getsockname()[1]

    def accept() -> None:
        with suppress(OSError):
            while True:
                client, _ = listener.accept()
                threading.Thread(target=_tunnel, args=(client, upstream), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield
    finally:
        with suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        listener.close()
