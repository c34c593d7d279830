"""Network policy, backend-neutral: which hosts a run may reach, and how a user reads it.

Each backend renders a `NetworkPolicy` into its own options (Docker: a private network and
an egress proxy; E2B: its allow/deny lists).
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from .errors import ConfigError
from .spec import NetworkPolicy

if TYPE_CHECKING:
    from .models import ModelSpec

HOST_NAME_RE = re.compile(
    r"^(\*\.)?([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
)


#: The name under which a sandbox reaches a model endpoint on the Docker host.
HOST_ALIAS = "host.orchestrator.internal"


#: Names that mean "this machine" in an --api-base.
LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "host.docker.internal", HOST_ALIAS})


def resolve_policy(mode: str | None, *, model: ModelSpec, hosts: tuple[str, ...]) -> NetworkPolicy:
    """The network policy of a run: `none` unless it needs network, else `allowlist`;
    `open` only when asked for by name.

    The allowlist is the model provider's host, the payload's hosts and `--allow-host`. A
    model endpoint on the Docker host becomes `HOST_ALIAS:port`, the only way to it.
    """
    hosts = tuple(dict.fromkeys(h.lower() for h in hosts))
    needs_network = model.needs_network or bool(hosts)
    mode = mode or ("allowlist" if needs_network else "none")
    if mode not in ("none", "allowlist", "open"):
        raise ConfigError(
            f"Unknown network policy {mode!r}.",
            "Use --network none, --network allowlist or --network open.",
        )
    if mode == "none":
        return NetworkPolicy(mode="none")
    endpoints: tuple[tuple[str, int], ...] = ()
    host_endpoints: tuple[tuple[str, int], ...] = ()
    hosts = tuple(dict.fromkeys([*model.hosts, *hosts]))
    endpoint = model.endpoint if model.needs_network else None
    if endpoint is not None:
        name, port = endpoint
        if is_docker_host(name):
            host_endpoints = ((HOST_ALIAS, port),)
        else:
            hosts = tuple(dict.fromkeys([name.lower(), *hosts]))
            if port not in (80, 443):
                endpoints = ((name.lower(), port),)
    return NetworkPolicy(
        mode=mode,  # type: ignore[arg-type]
        hosts=hosts,
        host_endpoints=host_endpoints,
        endpoints=endpoints,
    )


def describe_allowlist(policy: NetworkPolicy) -> list[str]:
    """The effective allowlist as a user reads it (for the run record)."""
    if policy.mode != "allowlist":
        return []
    items = [*policy.hosts]
    items += [f"{host}:{port}" for host, port in policy.endpoints]
    items += [f"{host}:{port} (the Docker host)" for host, port in policy.host_endpoints]
    return items


def sandbox_api_base(api_base: str | None, policy: NetworkPolicy) -> str | None:
    """`api_base` as the sandbox must use it: a model server on the Docker host is reached as
    `HOST_ALIAS` (the sandbox's own localhost is not the host's)."""
    if not api_base or not policy.host_endpoints or policy.mode == "none":
        return api_base
    parts = urlsplit(api_base)
    if not is_docker_host(parts.hostname or ""):
        return api_base
    port = parts.port or (443 if parts.scheme == "https" else 80)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = (f"{userinfo}@" if userinfo else "") + f"{HOST_ALIAS}:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


def is_docker_host(name: str) -> bool:
    """True for names and addresses that mean the machine Docker runs on (this machine)."""
    name = name.lower().strip("[]").rstrip(".")
    if name in LOCAL_NAMES:
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    if address.is_loopback or address.is_unspecified:
        return True
    return any(address in network for network in host_networks(prefix_length=32))


def host_networks(*, prefix_length: int | None = None) -> list[ipaddress.IPv4Network]:
    """This machine's own IPv4 addresses (as /32 networks), from the kernel's routing trie.

    Read from `/proc/net/fib_trie` (no tools, no privileges). Empty where that is missing.
    """
    try:
        lines = Path("/proc/net/fib_trie").read_text().splitlines()
    except OSError:
        return []
    found: dict[str, None] = {}
    for previous, line in zip(lines, lines[1:], strict=False):
        if line.strip() == "/32 host LOCAL":
            found[previous.split()[-1]] = None
    return [ipaddress.ip_network(f"{a}/{prefix_length or 32}", strict=False) for a in found]
