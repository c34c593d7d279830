"""The in-sandbox egress audit reports what the network blocked, and nothing else: the run's
own helpers (the egress proxy, the model gateway that NO_PROXY names, loopback) are never
reported as blocked egress. In-process: a real audit hook writing real events to a
pipe; tests/test_gateway.py checks the same end to end in a sandbox."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator

import pytest

from orchestrator_runtime.egress_audit import EgressAudit, direct_hosts, proxy_addresses
from orchestrator_runtime.egress_audit import install as install_audit
from orchestrator_runtime.events import EventStream

PROXY = "http://10.9.0.2:3128"
GATEWAY = "10.9.0.3"


@pytest.fixture
def sandbox_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy variables as the Docker backend sets them for a run with a gateway."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.setenv(name, PROXY)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.setenv(name, f"localhost,127.0.0.1,{GATEWAY}")


@pytest.fixture
def audit(sandbox_env: None) -> Iterator[tuple[EgressAudit, int]]:
    read_end, write_end = os.pipe()
    audit = EgressAudit(EventStream(write_end), proxy_addresses(), direct_hosts())
    yield audit, read_end
    os.close(write_end)
    os.close(read_end)


def reported(audit: EgressAudit, read_end: int, attempts: list[tuple[str, tuple]]) -> list[dict]:
    with socket.socket() as sock:
        for event, args in attempts:
            audit(event, (sock, *args) if event == "socket.connect" else args)
    os.set_blocking(read_end, False)
    try:
        data = os.read(read_end, 65536)
    except BlockingIOError:
        data = b""
    return [json.loads(line) for line in data.decode().splitlines()]


def test_the_gateway_the_proxy_and_loopback_are_not_blocked_egress(audit) -> None:
    events = reported(
        *audit,
        [
            ("socket.connect", ((GATEWAY, 8000),)),  # the model gateway, by design
            ("socket.connect", (("10.9.0.2", 3128),)),  # the egress proxy
            ("socket.connect", (("127.0.0.1", 9000),)),
            ("socket.getaddrinfo", ("localhost", 80, 0, 0, 0, 0)),
        ],
    )
    assert events == []


def test_a_direct_connection_and_a_lookup_are_reported_once_each(audit) -> None:
    events = reported(
        *audit,
        [
            ("socket.connect", (("93.184.215.14", 443),)),
            ("socket.connect", (("93.184.215.14", 443),)),  # the same: once
            ("socket.getaddrinfo", ("example.com", 443, 0, 0, 0, 0)),
            (
                "socket.connect",
                ((GATEWAY, 8001),),
            ),  # the gateway's host: the run's network, not egress
        ],
    )
    assert [(e["kind"], e["host"], e["port"]) for e in events] == [
        ("connect", "93.184.215.14", 443),
        ("dns", "example.com", 443),
    ]
    assert all(e["type"] == "egress_blocked" and e["source"] == "sandbox" for e in events)


def test_under_network_none_every_attempt_is_reported_with_its_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`none` (no proxy at all): a lookup and a connection are each refused, said so, and tied
    to the agent and step the runtime's recorder says are running."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    read_end, write_end = os.pipe()
    try:
        # As `install(events, "none")` makes it (install would also hook this test process).
        audit = EgressAudit(EventStream(write_end), proxy_addresses(), direct_hosts(), offline=True)
        audit.where = lambda: {"agent": "web_search_agent", "step_number": 2}
        events = reported(
            audit,
            read_end,
            [
                ("socket.getaddrinfo", ("epoch.ai", 443, 0, 0, 0, 0)),
                ("socket.connect", (("93.184.215.14", 80),)),
                ("socket.connect", (("127.0.0.1", 9000),)),  # loopback: the sandbox's own
            ],
        )
    finally:
        os.close(write_end)
        os.close(read_end)
    assert [(e["kind"], e["host"], e["port"]) for e in events] == [
        ("dns", "epoch.ai", 443),
        ("connect", "93.184.215.14", 80),
    ]
    for event in events:
        assert event["verdict"] == "denied" and "no network" in event["reason"]
        assert (event["agent"], event["step_number"]) == ("web_search_agent", 2)


def test_the_audit_is_off_without_a_proxy_unless_the_run_has_no_network(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """(Only the cases that add no hook to this process: a hook stays for good.)"""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert install_audit(EventStream(1), "open") is None
    assert install_audit(EventStream(1), "") is None  # an older request, no proxy: off
    # An allowlist without a proxy (E2B's lists; a Docker network holding only the gateway):
    # a direct connection may be allowed there, so it is not reported as blocked.
    assert install_audit(EventStream(1), "allowlist") is None
