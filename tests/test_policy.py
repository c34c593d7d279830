"""Network policy, backend-neutral, and how each backend renders it (no engine needed)."""

from __future__ import annotations

import pytest

from orchestrator import RunSpec
from orchestrator.backends.e2b.sandbox import network_options
from orchestrator.errors import ConfigError
from orchestrator.lifecycle.runner import prepare
from orchestrator.models import parse_model
from orchestrator.policy import (
    HOST_ALIAS,
    hosts_line,
    is_this_host,
    resolve_policy,
    sandbox_api_base,
)
from orchestrator.spec import NetworkPolicy

from .conftest import PAYLOADS
from .model_server import docker_bridge_address, host_address

RESEARCH = PAYLOADS / "research_team"


def test_policy_defaults_and_allowlist() -> None:
    mock = parse_model("mock")
    assert resolve_policy(None, model=mock, hosts=()).mode == "none"
    policy = resolve_policy(None, model=mock, hosts=("API.example.com", "*.example.org"))
    assert policy.mode == "allowlist"
    assert policy.hosts == ("api.example.com", "*.example.org")
    hosted = resolve_policy(None, model=parse_model("openai"), hosts=())
    assert hosted.mode == "allowlist" and hosted.hosts == ("api.openai.com",)
    hf = resolve_policy(None, model=parse_model("hf"), hosts=("x.example.com",))
    assert hf.hosts == ("router.huggingface.co", "huggingface.co", "x.example.com")
    odd_port = parse_model("openai", api_base="https://llm.example.net:8443/v1")
    assert resolve_policy(None, model=odd_port, hosts=()).endpoints == (("llm.example.net", 8443),)
    local = parse_model("openai", api_base="http://127.0.0.1:8080/v1")
    policy = resolve_policy(None, model=local, hosts=())
    assert policy.hosts == () and policy.host_endpoints == ((HOST_ALIAS, 8080),)
    assert sandbox_api_base(local.api_base, policy) == f"http://{HOST_ALIAS}:8080/v1"
    assert sandbox_api_base(local.api_base, NetworkPolicy("none")) == local.api_base
    assert resolve_policy("open", model=mock, hosts=()).mode == "open"
    with pytest.raises(ConfigError, match="Unknown network policy"):
        resolve_policy("wide-open", model=mock, hosts=())


def test_a_long_allowlist_is_named_in_short_on_a_line_of_output() -> None:
    from orchestrator.cli.display import network_of

    hosts = [f"h{i:04d}.example.test" for i in range(5000)]
    assert hosts_line(hosts[:3]) == "h0000.example.test, h0001.example.test, h0002.example.test"
    assert hosts_line(hosts) == ", ".join(hosts[:8]) + " and 4,992 more"
    line = network_of({"network": "allowlist", "allowlist": hosts})
    assert line == f"allowlist ({', '.join(hosts[:8])} and 4,992 more)"


def test_open_is_never_a_default(openai_key: str) -> None:
    for model, hosts in (("mock", ()), ("openai", ()), ("mock", ("*.example.com",))):
        prepared = prepare(RunSpec(payload=RESEARCH, model=model, allow_hosts=hosts))
        assert prepared.network.mode in ("none", "allowlist")
    with pytest.raises(ConfigError, match="allow-host"):
        prepare(RunSpec(payload=RESEARCH, allow_hosts=("http://x.example.com/",)))


@pytest.mark.docker
def test_docker_host_addresses() -> None:
    for name in ("localhost", "127.0.0.1", "0.0.0.0", "[::1]", docker_bridge_address()):
        assert is_this_host(name), name
    assert is_this_host(host_address())
    assert not is_this_host("api.openai.com") and not is_this_host("203.0.113.80")


def test_network_policies_map_onto_e2b_controls() -> None:
    assert network_options(NetworkPolicy("none")) == {"allow_internet_access": False}
    assert network_options(NetworkPolicy("open")) == {"allow_internet_access": True}
    allow = NetworkPolicy(
        "allowlist", hosts=("api.example.com", "*.example.org"), endpoints=(("llm.io", 8443),)
    )
    assert network_options(allow) == {
        "network": {
            "deny_out": ["0.0.0.0/0"],
            "allow_out": ["*.example.org", "api.example.com", "llm.io"],
        }
    }
    with pytest.raises(ConfigError, match="cannot reach"):
        network_options(NetworkPolicy("allowlist", host_endpoints=(("host", 8080),)))
