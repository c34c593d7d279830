"""The secret interceptor (images/interceptor/interceptor.py): a real mitmproxy, run as a
process of its own on 127.0.0.1 from its own interpreter (.venv-mitmproxy, as in its image),
between real clients (requests, httpx over HTTP/1.1 and HTTP/2, urllib) and a real HTTPS
server with its own CA. The value goes only to its bound host in its declared places;
everything else is refused with 403 and never arrives at the server.

`TEST_MITMPROXY_PYTHON` names another mitmproxy's interpreter to run the same tests against
(the image's version may differ from the one Python 3.11 can run here).
"""

from __future__ import annotations

import base64
import json
import shutil
import ssl
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import requests

from orchestrator.backends.docker.interceptor import (
    Ready,
    injections,
    read_ready,
    refusals,
)
from orchestrator.cli.display import describe_event
from orchestrator.payloads.binding import BoundSecret, SecretBinding
from tests.conftest import REPO, beside_interpreter, wait_for
from tests.https_upstream import Upstream, https_upstream
from tests.mcp_upstream import mcp_server

MITMPROXY_PYTHON = beside_interpreter(".venv-mitmproxy", "python", "TEST_MITMPROXY_PYTHON")
VALUE = "real-secret-value-7f3a9c"
PLACEHOLDER = "orchestrator-placeholder-ANALYTICS_TOKEN-5b1e0d2c9a"
QUERY_VALUE = "query-secret-value-11aa22"
QUERY_PLACEHOLDER = "orchestrator-placeholder-QUERY_TOKEN-8c7d6e5f4a"
NAMES = ["api.example.com", "other.example.net", "q.example.org", "pinned.example.net"]

pytestmark = pytest.mark.skipif(
    not MITMPROXY_PYTHON.exists(), reason="mitmproxy's virtualenv: run scripts/setup.sh"
)


@dataclass
class Interceptor:
    """The running proxy: its URL, the CA its clients must trust, what it logged."""

    url: str
    ca_cert: Path
    upstream: Upstream
    process: subprocess.Popen[str]
    records: list[dict[str, Any]] = field(default_factory=list)
    output: list[str] = field(default_factory=list)  # every line it wrote (since `fresh`)
    startup: str = ""  # what it wrote up to its ready line

    def decisions(self, verdict: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["verdict"] == verdict]


def start_interceptor(folder: Path, upstream: Upstream, upstream_ca: Path) -> Interceptor:
    """The interceptor's files as its image lays them out (itself and masking.py side by
    side), started with its configuration on stdin; returns once it says it listens."""
    app = folder / "app"
    app.mkdir()
    shutil.copy(REPO / "images" / "interceptor" / "interceptor.py", app)
    shutil.copy(REPO / "orchestrator_runtime" / "masking.py", app)
    config = {
        "listen": ["127.0.0.1", 0],
        "confdir": str(folder / "confdir"),
        "upstream_proxy": f"http://127.0.0.1:{upstream.proxy_port}",
        "upstream_ca": str(upstream_ca),
        "bindings": [  # as the host hands them over (BoundSecret: its one shape)
            BoundSecret(SecretBinding("ANALYTICS_TOKEN", ("api.example.com",)), PLACEHOLDER, VALUE),
            BoundSecret(
                SecretBinding("QUERY_TOKEN", ("*.example.org",), ("query", "body")),
                QUERY_PLACEHOLDER,
                QUERY_VALUE,
            ),
        ],
        "passthrough": ["pinned.example.net"],
    }
    process = subprocess.Popen(
        [str(MITMPROXY_PYTHON), "-I", str(app / "interceptor.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdin and process.stdout
    config["bindings"] = [b.interceptor_config() for b in config["bindings"]]
    process.stdin.write(json.dumps(config) + "\n")
    process.stdin.flush()  # left open, as an attached container's stdin is
    lines: list[str] = []
    for line in process.stdout:  # until it listens (or ends: then its output says why)
        lines.append(line)
        if line.startswith("ORCH-INTERCEPTOR-READY\t"):
            break
    else:
        raise AssertionError("the interceptor ended before listening:\n" + "".join(lines))
    _, address, cert = line.strip().split("\t")
    ca_cert = folder / "run-ca.crt"  # what the sandbox gets: the certificate, never the key
    ca_cert.write_bytes(base64.b64decode(cert))
    proxy = Interceptor(f"http://{address}", ca_cert, upstream, process, startup="".join(lines))

    def read() -> None:
        assert process.stdout
        for line in process.stdout:
            proxy.output.append(line)
            if line.startswith("ORCH-SECRET\t"):
                proxy.records.append(json.loads(line.split("\t", 1)[1]))

    threading.Thread(target=read, daemon=True).start()
    return proxy


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Interceptor]:
    folder = tmp_path_factory.mktemp("interceptor")
    with https_upstream(folder, NAMES) as (upstream, upstream_ca):
        interceptor = start_interceptor(folder, upstream, upstream_ca)
        try:
            yield interceptor
        finally:
            interceptor.process.terminate()
            interceptor.process.wait(timeout=30)


@pytest.fixture
def fresh(proxy: Interceptor) -> Interceptor:
    """The proxy with nothing recorded yet by this test."""
    proxy.records.clear()
    proxy.output.clear()
    proxy.upstream.requests.clear()
    proxy.upstream.tunnels.clear()
    proxy.upstream.release.clear()
    return proxy


def session(proxy: Interceptor) -> requests.Session:
    s = requests.Session()
    s.proxies = {"https": proxy.url, "http": proxy.url}
    s.verify = str(proxy.ca_cert)
    s.trust_env = False
    return s


def refused(proxy: Interceptor, response: Any, name: str, place: str) -> None:
    """`response` is the interceptor's 403, logged as `secret_not_bound`, and nothing of the
    request reached the server."""
    assert response.status_code == 403, response.text
    assert response.headers["x-orchestrator-refused"] == "secret_not_bound"
    assert VALUE not in response.text and QUERY_VALUE not in response.text
    (record,) = wait_for(lambda: proxy.decisions("refused"), timeout=10)
    assert record["reason"] == "secret_not_bound" and record["name"] == name
    assert record["place"] == place, record
    assert proxy.upstream.requests == [] and proxy.upstream.tunnels == []  # not even a tunnel


# ---- the value goes where it is bound --------------------------------------------------------


def test_requests_gets_the_value_to_its_host_in_a_header(fresh: Interceptor) -> None:
    response = session(fresh).get(
        "https://api.example.com/v1/track", headers={"X-Api-Key": PLACEHOLDER}
    )
    assert response.status_code == 200, response.text
    (arrived,) = fresh.upstream.requests
    assert arrived["headers"]["X-Api-Key"] == VALUE and arrived["host"] == "api.example.com"
    assert VALUE not in response.text and PLACEHOLDER in response.text  # the echo, scrubbed
    (record,) = wait_for(lambda: fresh.decisions("injected"), timeout=10)
    assert record == {
        "ts": record["ts"],
        "verdict": "injected",
        "name": "ANALYTICS_TOKEN",
        "host": "api.example.com",
        "place": "header:X-Api-Key",
    }


def test_an_echoed_value_never_comes_back_encoded_either(fresh: Interceptor) -> None:
    response = session(fresh).get(
        "https://api.example.com/encoded", headers={"X-Api-Key": PLACEHOLDER}
    )
    assert response.status_code == 200 and fresh.upstream.requests[0]["headers"]["X-Api-Key"]
    encoded = [base64.b64encode(VALUE.encode()).decode(), VALUE.encode().hex(), VALUE]
    assert not any(form in response.text for form in encoded), response.text
    # base64 and hex masked; the percent form of this value is the value itself: put back
    assert response.text.split("\n") == ["***", "***", PLACEHOLDER], response.text


def test_bearer_and_basic_credentials_are_headers(fresh: Interceptor) -> None:
    s = session(fresh)
    bearer = s.get("https://api.example.com/a", headers={"Authorization": f"Bearer {PLACEHOLDER}"})
    basic = s.get("https://api.example.com/b", auth=("user", PLACEHOLDER))
    assert bearer.status_code == basic.status_code == 200
    first, second = fresh.upstream.requests
    assert first["headers"]["Authorization"] == f"Bearer {VALUE}"
    assert (
        second["headers"]["Authorization"]
        == "Basic " + base64.b64encode(f"user:{VALUE}".encode()).decode()
    )
    assert VALUE not in bearer.headers["x-echo-authorization"]  # response headers scrubbed
    assert PLACEHOLDER in bearer.headers["x-echo-authorization"]


def test_a_declared_query_and_body_under_a_wildcard(fresh: Interceptor) -> None:
    s = session(fresh)
    got = s.get(f"https://q.example.org/s?key={QUERY_PLACEHOLDER}")
    posted = s.post("https://q.example.org/p", data={"key": QUERY_PLACEHOLDER})
    assert got.status_code == posted.status_code == 200
    first, second = fresh.upstream.requests
    assert first["path"] == f"/s?key={QUERY_VALUE}" and second["body"] == f"key={QUERY_VALUE}"
    assert QUERY_VALUE not in got.text + posted.text


@pytest.mark.parametrize("http2", [False, True])
def test_httpx_over_http1_and_http2(fresh: Interceptor, http2: bool) -> None:
    context = ssl.create_default_context(cafile=str(fresh.ca_cert))
    with httpx.Client(proxy=fresh.url, verify=context, http2=http2, trust_env=False) as client:
        response = client.get("https://api.example.com/h", headers={"x-api-key": PLACEHOLDER})
        assert response.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
        assert response.status_code == 200, response.text
        assert VALUE not in response.text
        elsewhere = client.get("https://other.example.net/h", headers={"x-api-key": PLACEHOLDER})
    assert elsewhere.status_code == 403
    wait_for(lambda: fresh.decisions("refused"), timeout=10)  # its record, not the next test's
    (arrived,) = fresh.upstream.requests
    assert arrived["headers"]["x-api-key"] == VALUE


def test_an_event_stream_is_relayed_as_it_comes_each_event_scrubbed(fresh: Interceptor) -> None:
    """Server-Sent Events (MCP's streamable HTTP and SSE transports): the first event reaches
    the client while the server still holds the stream open (a proxy that waited for the
    body's end would never deliver it), with the value the server echoed, sent in two chunks
    split inside it, back as the placeholder; the last event follows when the server ends."""
    context = ssl.create_default_context(cafile=str(fresh.ca_cert))
    timeout = httpx.Timeout(30.0)  # a proxy holding the stream back fails here, not forever
    with httpx.Client(proxy=fresh.url, verify=context, trust_env=False, timeout=timeout) as client:
        headers = {"x-api-key": PLACEHOLDER}
        with client.stream("GET", "https://api.example.com/events", headers=headers) as stream:
            assert stream.status_code == 200
            assert stream.headers["content-type"] == "text/event-stream"
            lines = stream.iter_lines()
            first = [next(lines) for _ in range(3)]
            assert first == ["event: echo", f"data: {PLACEHOLDER}", ""], first
            assert not fresh.upstream.release.is_set()  # the server still holds it open
            fresh.upstream.release.set()
            assert list(lines) == ["event: end", "data: bye", ""]
    (arrived,) = fresh.upstream.requests
    assert arrived["headers"]["x-api-key"] == VALUE


@pytest.mark.parametrize("transport", ["streamable-http", "sse"])
def test_an_mcp_client_gets_its_bound_token_to_a_remote_server(
    tmp_path: Path, transport: str
) -> None:
    """The `mcp` package's own client, over streamable HTTP and over SSE, through the
    interceptor to a FastMCP server that wants the real bearer token: its session opens,
    lists and calls the tool, and every request the server saw carried the value, none the
    placeholder (SSE's answers come on an event stream held open for the whole session)."""
    with mcp_server(tmp_path, "api.example.com", VALUE, "127.0.0.1") as server:
        proxy = start_interceptor(tmp_path, server.upstream, server.upstream.ca)
        try:
            answer = anyio.run(mcp_session, proxy, transport)
        finally:
            proxy.process.terminate()
            proxy.process.wait(timeout=30)
    assert answer == server.facts("Dune")
    seen = server.upstream.requests
    assert len(seen) >= 4 and server.upstream.holding(PLACEHOLDER) == []
    assert {r["headers"]["authorization"] for r in seen} == {f"Bearer {VALUE}"}


async def mcp_session(proxy: Interceptor, transport: str) -> str:
    """Open a session to the almanac through `proxy`, call its tool; the tool's answer."""
    from mcp import ClientSession
    from mcp.client.sse import sse_client
    from mcp.client.streamable_http import streamable_http_client

    context = ssl.create_default_context(cafile=str(proxy.ca_cert))

    def client(**kwargs: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(proxy=proxy.url, verify=context, trust_env=False, **kwargs)

    headers = {"Authorization": f"Bearer {PLACEHOLDER}"}
    if transport == "sse":
        url = "https://api.example.com/sse"
        opened = sse_client(url, headers=headers, httpx_client_factory=client)
    else:
        url = "https://api.example.com/mcp"
        opened = streamable_http_client(url, http_client=client(headers=headers))
    with anyio.fail_after(60):  # a proxy holding an event stream back fails here
        async with opened as streams, ClientSession(streams[0], streams[1]) as session:
            await session.initialize()
            assert [t.name for t in (await session.list_tools()).tools] == ["book_facts"]
            result = await session.call_tool("book_facts", {"title": "Dune"})
    return str(result.content[0].text)  # type: ignore[union-attr]


def test_urllib(fresh: Interceptor) -> None:
    context = ssl.create_default_context(cafile=str(fresh.ca_cert))
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({"https": fresh.url}),
        urllib.request.HTTPSHandler(context=context),
    )
    request = urllib.request.Request(
        "https://api.example.com/u", headers={"X-Api-Key": PLACEHOLDER}
    )
    with opener.open(request, timeout=30) as response:
        assert VALUE not in response.read().decode()
    assert fresh.upstream.requests[0]["headers"]["X-Api-Key"] == VALUE
    with pytest.raises(urllib.error.HTTPError) as info:
        opener.open(f"https://other.example.net/u?k={PLACEHOLDER}", timeout=30)
    assert info.value.code == 403 and len(fresh.upstream.requests) == 1
    wait_for(lambda: fresh.decisions("refused"), timeout=10)  # its record, not the next test's


def test_the_host_reads_back_what_was_injected_and_refused(fresh: Interceptor) -> None:
    """The proxy's own output, read as the host reads it: where the value went, what was
    refused (as `egress_blocked` attempts), never a value."""
    s = session(fresh)
    for path in ("/one", "/two"):
        s.get(f"https://api.example.com{path}", headers={"X-Api-Key": PLACEHOLDER})
    s.get(f"https://other.example.net/x?k={PLACEHOLDER}")
    wait_for(lambda: len(fresh.records) == 3, timeout=10)
    text = "".join(fresh.output)
    assert VALUE not in text and QUERY_VALUE not in text
    assert read_ready(text) is None and read_ready(fresh.startup) == Ready(
        fresh.url.removeprefix("http://"), fresh.ca_cert.read_text()
    )
    (entry,) = injections(text)  # its line: describe_event below
    (refusal,) = refusals(text)
    assert refusal["verdict"] == "denied" and refusal["reason"] == "secret_not_bound"
    assert (refusal["secret"], refusal["host"], refusal["place"]) == (
        "ANALYTICS_TOKEN",
        "other.example.net",
        "query",
    )
    assert "not a host ANALYTICS_TOKEN is bound to" in refusal["detail"]
    shown = describe_event({"type": "egress_blocked", **refusal, "agent": "manager"})
    assert shown == (
        "  ⛔ [manager] refused ANALYTICS_TOKEN to other.example.net query: secret_not_bound "
        "(other.example.net is not a host ANALYTICS_TOKEN is bound to)"
    )
    shown = describe_event({"type": "secret_injected", **entry})
    assert shown == "  🔑 injected ANALYTICS_TOKEN api.example.com header:X-Api-Key (2 requests)"


def test_a_request_without_placeholder_goes_through_untouched(fresh: Interceptor) -> None:
    response = session(fresh).get("https://other.example.net/plain", headers={"X-A": "b"})
    assert response.status_code == 200 and fresh.upstream.requests[0]["headers"]["X-A"] == "b"
    assert fresh.records == []


# ---- everywhere else it is refused, and nothing arrives ---------------------------------------

B64 = base64.b64encode(PLACEHOLDER.encode()).decode()
PERCENT = "".join(f"%{b:02X}" for b in PLACEHOLDER.encode())


@pytest.mark.parametrize(
    ("url", "kwargs", "place"),
    [
        (
            "https://other.example.net/x",
            {"headers": {"X-Api-Key": PLACEHOLDER}},
            "header:X-Api-Key",
        ),
        ("https://other.example.net/x", {"auth": ("u", PLACEHOLDER)}, "header:Authorization"),
        (f"https://other.example.net/x?k={PLACEHOLDER}", {}, "query"),
        ("https://other.example.net/x", {"data": {"k": PLACEHOLDER}}, "body"),
        (f"https://other.example.net/x?k={PERCENT}", {}, "query"),
        ("https://other.example.net/x", {"data": B64}, "body"),
        (
            "https://other.example.net/x",
            {"headers": {"X-B": PLACEHOLDER.encode().hex()}},
            "header:X-B",
        ),
        (f"https://api.example.com/x?k={PLACEHOLDER}", {}, "query"),  # bound, not in the query
        ("https://api.example.com/x", {"json": {"k": PLACEHOLDER}}, "body"),
        (f"https://api.example.com/{PLACEHOLDER}", {}, "path"),
        ("http://api.example.com/x", {"headers": {"X-Api-Key": PLACEHOLDER}}, "header:X-Api-Key"),
        ("https://api.example.com/x", {"headers": {"X-Api-Key": B64}}, "header:X-Api-Key"),
    ],
)
def test_the_placeholder_anywhere_else_is_refused(
    fresh: Interceptor, url: str, kwargs: dict[str, Any], place: str
) -> None:
    response = (
        session(fresh).post(url, **kwargs)
        if "data" in kwargs or "json" in kwargs
        else (session(fresh).get(url, **kwargs))
    )
    name = "ANALYTICS_TOKEN"
    refused(fresh, response, name, place)


def test_a_host_header_that_differs_from_the_sni_is_refused(fresh: Interceptor) -> None:
    """The tunnel and the TLS name say api.example.com, the Host header another host."""
    response = session(fresh).get(
        "https://api.example.com/x",
        headers={"Host": "other.example.net", "X-Api-Key": PLACEHOLDER},
    )
    refused(fresh, response, "ANALYTICS_TOKEN", "header:X-Api-Key")
    assert "differ" in fresh.decisions("refused")[0]["why"]


def test_a_redirect_to_another_host_does_not_carry_the_value(fresh: Interceptor) -> None:
    """requests keeps a custom header across hosts: the placeholder, not the value, goes
    there, and is refused."""
    response = session(fresh).get(
        "https://api.example.com/redirect?to=https://other.example.net/landing",
        headers={"X-Api-Key": PLACEHOLDER},
    )
    assert response.status_code == 403
    (first,) = fresh.upstream.requests  # only the bound host's, with the value
    assert first["host"] == "api.example.com" and first["headers"]["X-Api-Key"] == VALUE
    refusals = wait_for(lambda: fresh.decisions("refused"), timeout=10)
    assert [(r["host"], r["place"]) for r in refusals] == [
        ("other.example.net", "header:X-Api-Key")
    ]


def test_a_client_that_does_not_trust_the_run_ca_fails_closed(fresh: Interceptor) -> None:
    """A client with its own CA store (as a pinning client) refuses the interception's
    certificate: no request reaches the server, and the proxy says why."""
    with pytest.raises(requests.exceptions.SSLError):
        s = session(fresh)
        s.verify = True  # certifi's bundle: not the run's CA
        s.get("https://api.example.com/x", headers={"X-Api-Key": PLACEHOLDER})
    assert fresh.upstream.requests == []
    (failed,) = wait_for(lambda: fresh.decisions("tls_failed"), timeout=10)
    assert failed["host"] == "api.example.com"
    (attempt,) = refusals("".join(fresh.output))
    assert attempt["verdict"] == "allowed" and "pins certificates" in attempt["reason"]


def test_an_upstream_certificate_that_does_not_verify_is_refused(
    fresh: Interceptor, tmp_path: Path
) -> None:
    """unlisted.example.net is not on the server's certificate: the proxy does not connect
    the client to it (502), whatever it carries, and the host reads why."""
    response = session(fresh).get("https://unlisted.example.net/x")
    assert response.status_code == 502
    assert fresh.upstream.requests == []
    (failed,) = wait_for(lambda: fresh.decisions("upstream_tls_failed"), timeout=10)
    assert failed["host"] == "unlisted.example.net" and failed["why"]
    (attempt,) = refusals("".join(fresh.output))
    assert attempt["verdict"] == "allowed" and "did not verify" in attempt["reason"]
    assert attempt["host"] == "unlisted.example.net"


def test_each_run_has_its_own_ca_and_only_the_proxy_holds_its_key(
    proxy: Interceptor, tmp_path: Path
) -> None:
    other = start_interceptor(tmp_path, proxy.upstream, proxy.upstream.ca)
    try:
        assert other.ca_cert.read_bytes() != proxy.ca_cert.read_bytes()
        assert b"PRIVATE KEY" not in other.ca_cert.read_bytes()
        shown = subprocess.run(
            ["openssl", "x509", "-noout", "-text", "-in", str(other.ca_cert)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "CA:TRUE" in shown
        key = tmp_path / "confdir" / "mitmproxy-ca.pem"  # tmpfs in the container
        assert key.stat().st_mode & 0o077 == 0 and b"PRIVATE KEY" in key.read_bytes()
        assert "PRIVATE KEY" not in other.startup + "".join(other.output)
    finally:
        other.process.terminate()
        other.process.wait(timeout=30)


def test_what_is_not_http_inside_a_tunnel_is_never_relayed(fresh: Interceptor) -> None:
    """A stream the proxy cannot read as HTTP (a placeholder could hide in any protocol) is
    answered with an error and closed; nothing of it goes upstream, not even a tunnel."""
    import socket

    host, port = fresh.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as raw:
        raw.sendall(b"CONNECT api.example.com:443 HTTP/1.1\r\nHost: api.example.com:443\r\n\r\n")
        assert raw.recv(1024).startswith(b"HTTP/1.1 200")
        context = ssl.create_default_context(cafile=str(fresh.ca_cert))
        with context.wrap_socket(raw, server_hostname="api.example.com") as tls:
            tls.sendall(b"\x00\x01binary hello " + PLACEHOLDER.encode() + b"\r\n\r\n")
            answer = b""
            while chunk := tls.recv(4096):
                answer += chunk
    assert answer.startswith(b"HTTP/1.1 400"), answer
    assert fresh.upstream.requests == [] and fresh.upstream.tunnels == []


TRUSTING_CLIENTS = """
import json, os, sys, urllib.request
from orchestrator_runtime.trust import trust_ca
trust_ca(sys.stdin.read())  # what the runtime does before the payload, nothing else
import httpx, requests
headers = {"X-Api-Key": os.environ["ANALYTICS_TOKEN"]}
got = {
    "requests": requests.get("https://api.example.com/r", headers=headers).status_code,
    "httpx": httpx.get("https://api.example.com/h", headers=headers).status_code,
    "urllib": urllib.request.urlopen(
        urllib.request.Request("https://api.example.com/u", headers=headers)
    ).status,
}
print(json.dumps(got))
"""


def test_the_runtime_makes_plain_clients_trust_the_runs_ca(fresh: Interceptor) -> None:
    """The payload's clients, with no CA argument of their own, go through the interception
    once the runtime has trusted the run's CA (`trust_ca`); without it they refuse it."""
    env = {
        "PATH": "/usr/bin:/bin",
        "HTTPS_PROXY": fresh.url,
        "ANALYTICS_TOKEN": PLACEHOLDER,  # what the sandbox holds
        "PYTHONPATH": str(REPO),
    }
    ca = fresh.ca_cert.read_text()
    done = subprocess.run(
        [sys.executable, "-c", TRUSTING_CLIENTS],
        input=ca,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"requests": 200, "httpx": 200, "urllib": 200}
    assert [r["headers"]["X-Api-Key"] for r in fresh.upstream.requests] == [VALUE] * 3
    untrusted = TRUSTING_CLIENTS.replace("trust_ca(sys.stdin.read())", "sys.stdin.read()")
    done = subprocess.run(
        [sys.executable, "-c", untrusted],
        input=ca,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "CERTIFICATE_VERIFY_FAILED" in done.stderr
    assert len(fresh.upstream.requests) == 3


def test_a_passthrough_host_sees_the_client_unread(fresh: Interceptor) -> None:
    """Its TLS is the real server's (a client that pins it works), nothing is read: a
    placeholder goes as it is (never a value), and the proxy says it let the host through."""
    s = session(fresh)
    s.verify = str(fresh.upstream.ca)  # trusts the server's own CA only: as a pinning client
    response = s.get("https://pinned.example.net/p", headers={"X-Api-Key": PLACEHOLDER})
    assert response.status_code == 200
    (arrived,) = fresh.upstream.requests
    assert arrived["headers"]["X-Api-Key"] == PLACEHOLDER  # unread: not replaced, not refused
    passed = wait_for(lambda: fresh.decisions("passthrough"), timeout=10)
    assert passed[0]["host"] == "pinned.example.net"
    with pytest.raises(requests.exceptions.SSLError):
        session(fresh).get("https://pinned.example.net/p")  # the run's CA does not sign it


@pytest.mark.parametrize("passthrough", ["api.example.com", "*.example.com", "bad host"])
def test_a_bound_host_cannot_pass_through(tmp_path: Path, passthrough: str) -> None:
    """A secret bound to a host whose TLS is not read could never be put on the wire: the
    interceptor refuses to start (fail closed)."""
    app = tmp_path / "app"
    app.mkdir()
    shutil.copy(REPO / "images" / "interceptor" / "interceptor.py", app)
    shutil.copy(REPO / "orchestrator_runtime" / "masking.py", app)
    bound = BoundSecret(SecretBinding("ANALYTICS_TOKEN", ("api.example.com",)), PLACEHOLDER, VALUE)
    config = {
        "listen": ["127.0.0.1", 0],
        "confdir": str(tmp_path / "confdir"),
        "bindings": [bound.interceptor_config()],
        "passthrough": [passthrough],
    }
    done = subprocess.run(
        [str(MITMPROXY_PYTHON), "-I", str(app / "interceptor.py")],
        input=json.dumps(config) + "\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "ORCH-INTERCEPTOR-READY" not in done.stdout
    assert "passthrough" in done.stderr and VALUE not in done.stderr + done.stdout


def test_a_placeholder_in_a_trailer_is_refused(fresh: Interceptor) -> None:
    """HTTP/2 trailers (which the usual clients never send) are never a place: refused.
    (mitmproxy relays no HTTP/1 request trailers at all.)"""
    import socket

    import h2.config
    import h2.connection
    import h2.events

    host, port = fresh.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as raw:
        raw.sendall(b"CONNECT api.example.com:443 HTTP/1.1\r\nHost: api.example.com:443\r\n\r\n")
        assert raw.recv(1024).startswith(b"HTTP/1.1 200")
        context = ssl.create_default_context(cafile=str(fresh.ca_cert))
        context.set_alpn_protocols(["h2"])
        with context.wrap_socket(raw, server_hostname="api.example.com") as tls:
            assert tls.selected_alpn_protocol() == "h2"
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
            conn.initiate_connection()
            stream = conn.get_next_available_stream_id()
            request = [(":method", "POST"), (":path", "/t"), (":scheme", "https")]
            conn.send_headers(stream, [*request, (":authority", "api.example.com")])
            conn.send_data(stream, b"hi")
            conn.send_headers(stream, [("x-late", PLACEHOLDER)], end_stream=True)
            tls.sendall(conn.data_to_send())
            status = None
            while status is None:
                data = tls.recv(65536)
                assert data, "closed before an answer"
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.ResponseReceived):
                        status = dict(event.headers)[b":status"]
                tls.sendall(conn.data_to_send())
    assert status == b"403"
    (record,) = wait_for(lambda: fresh.decisions("refused"), timeout=10)
    assert record["place"] == "trailer:x-late" and fresh.upstream.requests == []
