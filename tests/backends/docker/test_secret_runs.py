"""Runs with bound secrets (`[secrets.bind]`) on the real Docker engine, under runc and
gVisor: the sandbox holds a placeholder, the run's secret interceptor (mitmproxy, in front of
squid) puts the value on the wire only for the bound host, in the declared place.

The upstream is tests/https_upstream.py's HTTPS server, with its own CA, for names no
resolver knows (api.example.com, other.example.net): the interceptor reaches it through the
stand-in for squid there (`InterceptorRoute`, the one test seam). That squid is the
interceptor's upstream in every other run, so the allowlist still applies, is checked
without the seam.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker.errors
import pytest

from orchestrator import RunSpec, run
from orchestrator.backends.docker.backend import DockerBackend
from orchestrator.backends.docker.interceptor import (
    KIND_INTERCEPTOR,
    InterceptorRoute,
    ensure_interceptor_image,
)
from orchestrator.execution.pool import Pool
from orchestrator.labels import LABEL_KIND, LABEL_RUN_ID
from orchestrator.records.store import Store
from tests.conftest import TEST_PAYLOADS, cli, events_of, files_holding, wait_for
from tests.https_upstream import Upstream, https_upstream
from tests.model_server import docker_bridge_address
from tests.otlp_receiver import OtlpReceiver

PROBE = TEST_PAYLOADS / "secret_probe"
VALUE = "real-analytics-value-7f3a9c1e"
BOUND, OTHER = "api.example.com", "other.example.net"
PREFIX = "orchestrator-bound-ANALYTICS_TOKEN-"

pytestmark = [pytest.mark.docker, pytest.mark.gvisor]


@pytest.fixture(scope="module")
def interceptor_image(docker_client: docker.DockerClient) -> str:
    return ensure_interceptor_image(docker_client, print)


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("ANALYTICS_TOKEN", VALUE)
    return VALUE


@pytest.fixture
def upstream(
    tmp_path: Path, docker_client: docker.DockerClient
) -> Iterator[tuple[Upstream, DockerBackend]]:
    """The test's HTTPS server (both names) and a backend whose interceptors reach it."""
    address = docker_bridge_address()
    with https_upstream(tmp_path, [BOUND, OTHER], address=address) as (server, ca):
        route = InterceptorRoute(f"http://{address}:{server.proxy_port}", ca.read_text())
        yield server, DockerBackend(docker_client, interceptor_route=route)


def probe(backend: DockerBackend, attempts: list[dict[str, Any]], **kwargs: Any) -> Any:
    spec = RunSpec(payload=PROBE, additional_args={"attempts": json.dumps(attempts)}, **kwargs)
    return run(spec, backend=backend)


def found(result: Any) -> dict[str, Any]:
    assert result.status == "succeeded", (result.status, result.error)
    return json.loads(result.answer[::-1])  # reversed by the probe, past the maskers


def test_the_sandbox_holds_a_placeholder_and_the_value_goes_only_to_its_host(
    agent_image: str,
    interceptor_image: str,
    token: str,
    upstream: tuple[Upstream, DockerBackend],
    nothing_left: None,
) -> None:
    """Acceptance 1-4: the placeholder alone is inside (environment, every process's
    environ, /tmp); the bound host gets the value in the declared header (Basic credentials
    too) and an echo of it comes back as the placeholder; the placeholder to another allowed
    host (header, query, body, Basic, base64- and percent-encoded), over plain HTTP, in an
    undeclared place, after a redirect from the bound host to another, or with a Host that
    is not the TLS server name, is refused with nothing arriving; a server whose certificate
    does not verify is not reached (`egress_failed`); the record says where the value went,
    never the value."""
    server, backend = upstream
    refused = [
        {"url": f"https://{OTHER}/header"},
        {"url": f"https://{OTHER}/query", "query": True},
        {"url": f"https://{OTHER}/body", "body": True},
        {"url": f"https://{OTHER}/basic", "basic": True},
        {"url": f"https://{OTHER}/base64", "encode": "base64"},
        {"url": f"https://{OTHER}/percent", "encode": "percent"},
        {"url": f"http://{BOUND}/plain"},
        {"url": f"https://{BOUND}/undeclared", "query": True},
        {"url": f"https://{BOUND}/redirect?to=https://{OTHER}/redirected"},
        {"url": f"https://{BOUND}/host", "host": OTHER},
    ]
    attempts = [
        {"url": f"https://{BOUND}/data", "header": "X-Api-Key"},
        {"url": f"https://{BOUND}/auth", "basic": True},
        *refused,
        {"url": "https://unverified.example.org/", "plain": True},  # not on its certificate
    ]
    result = probe(backend, attempts)
    seen = found(result)
    placeholder = seen["env"]
    assert placeholder.startswith(PREFIX) and VALUE not in json.dumps(seen)
    assert set(seen["environ"]) <= {f"ANALYTICS_TOKEN={placeholder}"}  # a child's, if any
    assert not [path for path, text in seen["tmp"].items() if "PRIVATE KEY-----" in text]
    assert [t for t in seen["tmp"].values() if "certificates, key: False" in t]  # the bundle

    injected, basic, *blocked, unverified = seen["outcomes"]
    assert unverified["status"] == 502, unverified
    assert injected["status"] == 200 and basic["status"] == 200, seen["outcomes"]
    arrived = {r["path"].split("?")[0]: r["headers"] for r in server.requests}
    assert sorted(arrived) == ["/auth", "/data", "/redirect"]  # nothing refused arrived
    assert arrived["/data"]["X-Api-Key"] == VALUE
    assert arrived["/auth"]["Authorization"].startswith("Basic ")
    assert server.holding(placeholder) == []  # the bound host never saw the placeholder
    assert VALUE not in injected["body"] and placeholder in injected["body"]  # echo scrubbed
    assert [b["status"] for b in blocked] == [403] * len(refused), blocked

    events = events_of(result)
    shown = [(e["secret"], e["host"], e["place"]) for e in events if e["type"] == "secret_injected"]
    assert shown == [
        ("ANALYTICS_TOKEN", BOUND, "header:X-Api-Key"),
        ("ANALYTICS_TOKEN", BOUND, "header:Authorization"),
    ]
    assert [e["count"] for e in events if e["type"] == "secret_injected"] == [2, 1]
    not_bound = [e for e in events if e.get("reason") == "secret_not_bound"]
    assert [e["type"] for e in not_bound] == ["egress_blocked"] * len(refused)
    assert [e["host"] for e in not_bound] == [OTHER] * 6 + [BOUND] * 2 + [OTHER] * 2
    assert all(e["secret"] == "ANALYTICS_TOKEN" and e.get("agent") for e in not_bound)
    (failed,) = [e for e in events if e["type"] == "egress_failed"]
    assert failed["host"] == "unverified.example.org" and "did not verify" in failed["reason"]
    created = next(e for e in events if e["type"] == "sandbox_created")
    assert created["secrets_inside"] == [] and created["secrets_bound"]
    assert result.egress_blocked == len(refused)

    shown_run = cli("runs", "show", result.run_id)
    assert shown_run.returncode == 0, shown_run.stderr
    assert f"injected ANALYTICS_TOKEN {BOUND} header:X-Api-Key" in shown_run.stdout
    assert files_holding(VALUE, Path(result.record_dir)) == []


def test_the_ca_is_the_runs_own_and_killing_the_interceptor_ends_the_run(
    agent_image: str,
    interceptor_image: str,
    token: str,
    upstream: tuple[Upstream, DockerBackend],
    docker_client: docker.DockerClient,
    nothing_left: None,
) -> None:
    """Acceptance 6: each run trusts a CA of its own (no key in the sandbox); while a run
    goes on, no container's configuration (`docker inspect`) nor squid's log holds the
    value; killing the interceptor ends the run `infra_error` (no way out is left open)."""
    _, backend = upstream
    first, second = (found(probe(backend, [])) for _ in range(2))
    assert first["ca"].startswith("-----BEGIN CERTIFICATE-----")
    cas = [seen["ca"].split("-----END CERTIFICATE-----")[0] for seen in (first, second)]
    assert cas[0] != cas[1]
    assert first["env"] != second["env"]  # a fresh placeholder per run too

    box: dict[str, Any] = {}
    spec = RunSpec(payload=PROBE, additional_args={"attempts": json.dumps([{"sleep": 60}])})
    thread = threading.Thread(target=lambda: box.update(result=run(spec, backend=backend)))
    thread.start()
    try:
        interceptor = wait_for(lambda: _running(docker_client, KIND_INTERCEPTOR), timeout=120)
        run_id = interceptor["Labels"][LABEL_RUN_ID]
        wait_for(lambda: (Store().get_run(run_id) or {}).get("status") == "running", 120)
        ours = docker_client.api.containers(filters={"label": f"{LABEL_RUN_ID}={run_id}"})
        assert {c["Labels"][LABEL_KIND] for c in ours} >= {"sandbox", "egress", KIND_INTERCEPTOR}
        for container in ours:
            inspected = json.dumps(docker_client.api.inspect_container(container["Id"]))
            assert VALUE not in inspected, container["Labels"][LABEL_KIND]
            if container["Labels"][LABEL_KIND] == "egress":
                assert VALUE.encode() not in docker_client.api.logs(container["Id"])
        docker_client.api.kill(interceptor["Id"])
    finally:
        thread.join(timeout=120)
    result = box["result"]
    assert result.status == "infra_error", result.error
    assert "secret interceptor" in result.error.message
    assert result.timings["duration"] < 60  # ended by the host, not by the payload's sleep


def _running(client: docker.DockerClient, kind: str) -> dict[str, Any] | None:
    found = client.api.containers(filters={"label": f"{LABEL_KIND}={kind}"})
    return found[0] if found else None


def test_a_warm_sandbox_gets_its_interceptor_and_its_runs_secrets(
    agent_image: str,
    interceptor_image: str,
    token: str,
    upstream: tuple[Upstream, DockerBackend],
    nothing_left: None,
) -> None:
    """A pool's sandbox is made with its interceptor before its run; the run hands it the
    values at its start: each run, warm or cold, holds its own placeholder and the bound
    host gets the value."""
    server, backend = upstream
    spec = RunSpec(
        payload=PROBE,
        additional_args={"attempts": json.dumps([{"url": f"https://{BOUND}/data"}])},
    )
    with Pool(size=1, ttl=60, backend=backend) as pool:
        results = [pool.run(spec) for _ in range(2)]
    assert any(r.warm for r in results), [r.warm for r in results]
    seen = [found(r) for r in results]
    assert [s["outcomes"][0]["status"] for s in seen] == [200, 200]
    assert seen[0]["env"] != seen[1]["env"] and all(s["env"].startswith(PREFIX) for s in seen)
    assert [r["headers"]["X-Api-Key"] for r in server.requests] == [VALUE, VALUE]


def test_the_interceptor_sends_what_it_lets_through_to_squid(
    agent_image: str,
    interceptor_image: str,
    token: str,
    docker_client: docker.DockerClient,
    nothing_left: None,
) -> None:
    """Without the test seam, the interceptor's upstream is the run's squid: a host off the
    allowlist is refused there (recorded as squid's `egress_blocked`), an allowed one is
    reached (Debian's mirror over HTTP, reachable from this machine's containers)."""
    attempts = [
        {"url": "https://unlisted.example.org/", "plain": True},
        {"url": "http://deb.debian.org/debian/", "plain": True},
    ]
    result = probe(DockerBackend(docker_client), attempts, allow_hosts=("deb.debian.org",))
    unlisted, allowed = found(result)["outcomes"]
    assert unlisted["status"] != 200 and allowed["status"] == 200, (unlisted, allowed)
    squid = [e for e in events_of(result) if e["type"] == "egress_blocked"]
    assert [(e["source"], e["host"], e["reason"]) for e in squid] == [
        ("egress", "unlisted.example.org", "not on the allowlist")
    ]


def test_requests_httpx_and_urllib_get_the_value_and_a_pinning_client_fails_closed(
    agent_image: str,
    interceptor_image: str,
    token: str,
    upstream: tuple[Upstream, DockerBackend],
    nothing_left: None,
    tmp_path: Path,
) -> None:
    """Acceptance 5: requests, httpx and urllib, each with its own proxy and CA settings,
    get the value put on the wire for the bound host (and refused elsewhere); httpx speaks
    HTTP/1.1 here (the agent image has no `h2`; HTTP/2: the test below). A client that
    trusts only the server's own CA (as one that pins certificates) fails closed: nothing
    arrives, and the record says the client refused the interception's certificate. The
    viewer's page and the run's trace (root span events) show where the value went and
    what was refused, never the value."""
    server, backend = upstream
    pin = server.ca.read_text()
    clients = ("requests", "httpx", "urllib")
    attempts = [
        *({"url": f"https://{BOUND}/{c}", "client": c} for c in clients),
        *({"url": f"https://{OTHER}/{c}", "client": c} for c in clients),
        {"url": f"https://{BOUND}/pinned", "pin": pin},
    ]
    with OtlpReceiver() as receiver:
        result = probe(backend, attempts, traces_to=receiver.url)
        received = list(receiver.spans)
    seen = found(result)
    placeholder = seen["env"]
    outcomes = seen["outcomes"]
    bound, other, (pinned,) = outcomes[:3], outcomes[3:6], outcomes[6:]
    assert [o["status"] for o in bound] == [200] * 3, bound
    assert all(placeholder in o["body"] and VALUE not in o["body"] for o in bound)
    assert bound[1]["version"] == "HTTP/1.1"
    assert [o["status"] for o in other] == [403] * 3, other
    assert pinned["status"] is None and "CERTIFICATE_VERIFY_FAILED" in pinned["error"], pinned
    arrived = {r["path"]: r["headers"].get("X-Api-Key") for r in server.requests}
    assert arrived == {f"/{c}": VALUE for c in clients}  # the refused and the pinned: none

    events = events_of(result)
    (injected,) = [e for e in events if e["type"] == "secret_injected"]
    assert (injected["host"], injected["place"], injected["count"]) == (
        BOUND,
        "header:X-Api-Key",
        3,
    )
    not_bound = [e for e in events if e.get("reason") == "secret_not_bound"]
    assert [e["host"] for e in not_bound] == [OTHER] * 3
    (failed,) = [e for e in events if e["type"] == "egress_failed"]
    assert failed["host"] == BOUND and "pins certificates" in failed["reason"], failed
    logged = cli("runs", "logs", result.run_id)
    assert f"egress failed: {BOUND}: the client refused the interception's" in logged.stdout
    assert files_holding(VALUE, Path(result.record_dir)) == []

    (root,) = [s for s in received if s["parent_span_id"] is None]
    traced = [(e["name"], e["attributes"].get("orchestrator.egress.host")) for e in root["events"]]
    assert sorted(traced) == sorted(
        [("secret_injected", BOUND), ("egress_failed", BOUND)] + [("egress_blocked", OTHER)] * 3
    )
    assert {
        e["attributes"]["orchestrator.egress.place"]
        for e in root["events"]
        if e["name"] != "egress_failed"
    } == {"header:X-Api-Key"}
    assert VALUE not in json.dumps(received)

    exported = cli("view", "--export", str(tmp_path / "pages"), result.run_id)
    assert exported.returncode == 0, exported.stderr
    page = " ".join((tmp_path / "pages" / f"run-{result.run_id}.html").read_text().split())
    assert f"injected <code>ANALYTICS_TOKEN</code> <code>{BOUND}</code> header:X-Api-Key" in page
    assert f"refused <code>ANALYTICS_TOKEN</code> to <code>{OTHER}</code>" in page
    assert VALUE not in page


def test_a_passthrough_host_is_relayed_unread_and_recorded(
    agent_image: str,
    interceptor_image: str,
    token: str,
    upstream: tuple[Upstream, DockerBackend],
    nothing_left: None,
    tmp_path: Path,
) -> None:
    """`[network] passthrough`: the interceptor relays that host's TLS unread, so a client
    that pins the server's own CA reaches it; it still fails closed at the bound host, whose
    TLS is read; the record names the passthrough hosts."""
    server, backend = upstream
    payload = tmp_path / "passthrough_probe"
    payload.mkdir()
    (payload / "probe.py").write_text((PROBE / "probe.py").read_text())
    manifest = (PROBE / "manifest.toml").read_text()
    listed = 'hosts = ["api.example.com", "other.example.net"]\n'
    assert listed in manifest
    (payload / "manifest.toml").write_text(
        manifest.replace(listed, listed + f'passthrough = ["{OTHER}"]\n')
    )
    pin = server.ca.read_text()
    attempts = [
        {"url": f"https://{OTHER}/pinned", "plain": True, "pin": pin},
        {"url": f"https://{BOUND}/pinned", "plain": True, "pin": pin},
    ]
    spec = RunSpec(payload=payload, additional_args={"attempts": json.dumps(attempts)})
    result = run(spec, backend=backend)
    relayed, intercepted = found(result)["outcomes"]
    assert relayed["status"] == 200, relayed
    assert intercepted["status"] is None and "CERTIFICATE_VERIFY_FAILED" in intercepted["error"]
    assert [r["path"] for r in server.requests] == ["/pinned"]
    assert server.requests[0]["host"] == OTHER
    events = events_of(result)
    created = next(e for e in events if e["type"] == "sandbox_created")
    assert created["passthrough"] == [OTHER]
    (failed,) = [e for e in events if e["type"] == "egress_failed"]
    assert failed["host"] == BOUND


def test_httpx_over_http2_gets_the_value_through_the_interception(
    agent_image: str,
    interceptor_image: str,
    token: str,
    upstream: tuple[Upstream, DockerBackend],
    nothing_left: None,
    tmp_path: Path,
) -> None:
    """Acceptance 5, HTTP/2: the probe with `h2` in its requirements (a payload image adds it)
    speaks HTTP/2 to the interceptor, which puts the value into the bound host's header (and
    on to the upstream, which speaks HTTP/1.1) and refuses the placeholder elsewhere."""
    server, backend = upstream
    payload = tmp_path / "secret_probe_h2"
    shutil.copytree(PROBE, payload)
    manifest = payload / "manifest.toml"
    manifest.write_text(
        manifest.read_text().replace("[python]\n", '[python]\nrequirements = ["h2"]\n', 1)
    )
    attempts = [
        {"url": f"https://{BOUND}/h2", "client": "httpx2"},
        {"url": f"https://{OTHER}/h2", "client": "httpx2"},
    ]
    spec = RunSpec(payload=payload, additional_args={"attempts": json.dumps(attempts)})
    seen = found(run(spec, backend=backend))
    bound, other = seen["outcomes"]
    assert (bound["status"], bound["version"]) == (200, "HTTP/2"), bound
    assert seen["env"] in bound["body"] and VALUE not in bound["body"]
    assert (other["status"], other["version"]) == (403, "HTTP/2"), other
    # HTTP/2 names its headers in lower case, and so they go on upstream.
    arrived = {r["path"]: r["headers"].get("x-api-key") for r in server.requests}
    assert arrived == {"/h2": VALUE}
