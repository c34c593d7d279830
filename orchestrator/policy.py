"""Network policy, backend-neutral: which hosts a run may reach, and how a user reads it.

Each backend renders a `NetworkPolicy` into its own options (Docker: a private network and
an egress proxy; E2B: its allow/deny lists). Also the two rules on what a payload may ask the
network for: allowlisted hosts are DNS names (`check_host_name`), and requirements are
package specifications (`check_requirement`), since the host's pip fetches them.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from .errors import ConfigError
from .registry import DEFAULT_BACKEND
from .schema import Field
from .spec import NetworkPolicy

if TYPE_CHECKING:
    from .models import ModelSpec

#: The shape of an allowlist entry; `check_host_name` adds what a pattern cannot say.
HOST_NAME_RE = re.compile(
    r"^(\*\.)?([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
)


#: What to do about a refused host (the error's fix, wherever the host was listed).
HOST_NAME_HELP = (
    "Use exact DNS names (api.example.com) or one leading wildcard (*.example.com): no "
    "schemes, ports, paths, IP addresses or localhost. For a model server on this machine, "
    "pass --api-base http://127.0.0.1:PORT/v1 instead: the sandbox then reaches that one port."
)


#: The most hosts a run's allowlist may list: the payload's `[network] hosts` (or a program's
#: `[tool.orchestrator.network]`), a schedule's `allow_hosts` and `--allow-host` together
#: (the model's own hosts come on top). The egress proxy reads them at its start: its start
#: time grows with them, and its memory with wildcards (each a compiled pattern), which at
#: twice this many come near its limit (`benchmarks/egress_hosts.py`).
MAX_HOSTS = 10_000


#: What to do about too long an allowlist (the error's fix, wherever the hosts were listed).
MAX_HOSTS_HELP = (
    f"List at most {MAX_HOSTS:,} hosts; a wildcard (*.example.com) covers every name under "
    "one domain."
)


def hosts_field(fix: str = HOST_NAME_HELP) -> Field:
    """The schema of a list of hosts in a user's file (a manifest's `[network] hosts`, a
    schedule's `allow_hosts`): DNS names (`check_host_name`; `fix` for one that is not), at
    most `MAX_HOSTS`."""
    entry = Field(str, check=check_host_name, fix=fix)
    return Field(list, items=entry, max_items=MAX_HOSTS, fix=MAX_HOSTS_HELP)


#: The name under which a sandbox reaches a model endpoint on the host its sandboxes run on
#: (this machine, `Capabilities.sandboxes_run == "this_host"`).
HOST_ALIAS = "host.orchestrator.internal"


#: Names that mean "this machine" in an --api-base.
LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "host.docker.internal", HOST_ALIAS})


def check_host_name(host: str) -> str | None:
    """What is wrong with `host` as an allowlist entry, or None for a DNS name.

    Refused: anything that is not a name (schemes, ports, paths), IP literals (v4, v6, with or
    without brackets, and names whose last label starts with a digit, which resolvers read as
    an address: `127.1`, `2130706433`, `0x7f000001`), and names of this machine (`localhost`,
    `*.localhost`, the sandbox host's aliases, or a wildcard covering one of them).
    """
    name = host.lower()
    try:
        ipaddress.ip_address(name[1:-1] if name.startswith("[") else name)
    except ValueError:
        pass
    else:
        return "is an IP address; hosts are DNS names"
    if not HOST_NAME_RE.match(name):
        return "is not a host name"
    if name.rsplit(".", 1)[-1][0].isdigit():
        return "reads as an IP address (its last label starts with a digit); hosts are DNS names"
    suffix = name[1:] if name.startswith("*.") else None
    local = name in LOCAL_NAMES or f".{name}".endswith(".localhost")
    if local or (suffix and any(n.endswith(suffix) for n in LOCAL_NAMES)):
        return "names this machine"
    return None


def host_covered(host: str, allowlist: Collection[str]) -> bool:
    """True when every name `host` matches is on `allowlist` (names and `*.` patterns, as
    the egress proxy reads them: `*.example.com` is any name under example.com, not
    example.com itself). `host` may be a pattern too: `*.a.example.com` is covered by
    `*.example.com` or by itself, never by a list of names."""
    host = host.lower()
    names = host.removeprefix("*.")  # a pattern: every name under it must be covered
    for entry in (e.lower() for e in allowlist):
        if host == entry or (entry.startswith("*.") and names.endswith(entry[1:])):
            return True
    return False


#: Archive names pip installs as files (relative to its working directory), not as packages.
_ARCHIVE_SUFFIXES = (
    ".whl",
    ".zip",
    ".tar",
    ".tar.gz",
    ".tgz",
    ".tar.bz2",
    ".tbz",
    ".tar.xz",
    ".txz",
    ".tar.lz",
    ".tlz",
    ".tar.lzma",
)


#: What to do about a refused requirement (the error's fix, wherever it was listed).
REQUIREMENT_HELP = (
    "Each requirement must be a package specification: a name with optional extras, version "
    "specifiers and markers (`tabulate==0.9.0`, `pandas[excel]>=2; python_version>='3.10'`). "
    "A `name @ URL` reference is installed only when the run allows exactly that string with "
    "--allow-requirement; pip options, bare URLs and paths never are."
)


class AllowedRequirement(str):
    """A direct reference (`name @ URL`) the user allowed by name (`--allow-requirement`).

    A `str`, so it travels unchanged from the manifest to the image build, where
    `imagedef.normalize_requirements` admits a direct reference only in this type. Rebuilding
    the string drops the mark, and the build then refuses it: the mark can be lost, never
    gained.
    """

    __slots__ = ()


def check_requirement(text: str, allowed: Collection[str] = ()) -> str | None:
    """What is wrong with one requirement string, or None if the host's pip may install it.

    A package specification (name, extras, version specifiers, markers) is fine. A direct
    reference (`name @ URL`: pip fetches the URL, or opens the path of a file: URL, on this
    machine) is fine only when `allowed` names exactly this string (runs of spaces aside).
    Pip options, bare URLs and paths, archive file names and anything else pip reads
    differently from a package name are refused, whatever `allowed` says.
    """
    text = " ".join(text.split())
    if not text:
        return "is empty"
    if text.startswith("-"):
        return "is a pip option, not a package specification"
    # Imported here: a run without requirements never pays for `packaging` (its cost:
    # benchmarks/results/code_figures.md#import-costs-on-the-start-path).
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        requirement = Requirement(text)
    except InvalidRequirement as exc:
        if "/" in text or "\\" in text or ":" in text.split(";")[0]:
            return "is a URL or path, not a package specification"
        return f"is not a package specification ({str(exc).splitlines()[0]})"
    if requirement.name.lower().endswith(_ARCHIVE_SUFFIXES):
        return "is an archive file name (pip would install it as a file), not a package"
    if requirement.url is None:
        return None
    if text in {" ".join(a.split()) for a in allowed}:
        return None
    return (
        f"is a direct reference: pip on this machine would fetch or open {requirement.url} "
        f"while building the image. If you trust it, allow exactly this string with "
        f"--allow-requirement {shlex.quote(text)}"
    )


def resolve_policy(
    mode: str | None,
    *,
    model: ModelSpec,
    hosts: tuple[str, ...],
    allow_hosts: tuple[str, ...] = (),
    host_alias: bool = True,
) -> NetworkPolicy:
    """The network policy of a run: `none` unless it needs network, else `allowlist`;
    `open` only when asked for by name.

    The allowlist is the model provider's host, the payload's `hosts` and `allow_hosts`
    (`--allow-host`, checked here, and the two together against `MAX_HOSTS`). A model
    endpoint on this host becomes `HOST_ALIAS:port`, the only way to it (with `host_alias`:
    sandboxes on this host; a backend whose sandboxes run elsewhere takes the endpoint as
    given, see `check_remote_endpoint`). Raises ConfigError for a bad `--allow-host`, for
    more hosts than `MAX_HOSTS` with it, an unknown mode, and for `none` with a model that
    needs the network (it could only fail, after a sandbox was made: refused before anything
    starts).
    """
    for host in allow_hosts:
        problem = check_host_name(host)
        if problem:
            raise ConfigError(f"--allow-host {host!r} {problem}.", HOST_NAME_HELP)
    hosts = tuple(dict.fromkeys(h.lower() for h in (*hosts, *allow_hosts)))
    if len(hosts) > MAX_HOSTS:
        listed = "`[network] hosts`" + (
            " and --allow-host (or a schedule's `allow_hosts`) together" if allow_hosts else ""
        )
        raise ConfigError(
            f"The allowlist has {len(hosts):,} hosts, from {listed}: more than the maximum "
            f"of {MAX_HOSTS:,}.",
            MAX_HOSTS_HELP,
        )
    needs_network = model.needs_network or bool(hosts)
    mode = mode or ("allowlist" if needs_network else "none")
    if mode not in ("none", "allowlist", "open"):
        raise ConfigError(
            f"Unknown network policy {mode!r}.",
            "Use --network none, --network allowlist or --network open.",
        )
    if mode == "none":
        if model.needs_network:
            raise ConfigError(
                f"The model {model.describe()} needs the network to reach its endpoint, but "
                "the run's network policy is `none` (from --network, $ORCHESTRATOR_NETWORK, "
                "the config file's `network` or the schedule's).",
                "Use --network allowlist (the model's host and the payload's hosts only), or "
                "run with --model mock, which needs no network.",
            )
        return NetworkPolicy(mode="none")
    endpoints: tuple[tuple[str, int], ...] = ()
    host_endpoints: tuple[tuple[str, int], ...] = ()
    hosts = tuple(dict.fromkeys([*model.hosts, *hosts]))
    endpoint = model.endpoint if model.needs_network else None
    if endpoint is not None:
        name, port = endpoint
        if host_alias and is_this_host(name):
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


#: How many hosts a line of output names before it counts the rest.
SHOWN_HOSTS = 8


def hosts_line(items: Sequence[str], shown: int = SHOWN_HOSTS) -> str:
    """`a, b, c`, or for a long allowlist its first `shown` and how many more: for a line of
    output (the record keeps them all)."""
    text = ", ".join(items[:shown])
    if len(items) > shown:
        text += f" and {len(items) - shown:,} more"
    return text


def sandbox_api_base(api_base: str | None, policy: NetworkPolicy) -> str | None:
    """`api_base` as the sandbox must use it: a model server on this host is reached as
    `HOST_ALIAS` (the sandbox's own localhost is not the host's)."""
    if not api_base or not policy.host_endpoints or policy.mode == "none":
        return api_base
    parts = urlsplit(api_base)
    if not is_this_host(parts.hostname or ""):
        return api_base
    port = parts.port or (443 if parts.scheme == "https" else 80)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = (f"{userinfo}@" if userinfo else "") + f"{HOST_ALIAS}:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


def is_this_host(name: str) -> bool:
    """True for names and addresses that mean this machine, the one sandboxes on this host
    run on (its names, loopback, its own addresses, its bridges)."""
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


#: Name endings that resolve on a local network only (RFC 6761, RFC 6762, RFC 8375, and what
#: Docker and cloud providers use), never for a sandbox that runs elsewhere.
LOCAL_SUFFIXES = (".localhost", ".local", ".internal", ".lan", ".home.arpa", ".localdomain")


def unreachable_from_elsewhere(name: str) -> str | None:
    """Why a sandbox running elsewhere (E2B's cloud) cannot reach the host `name`, or None.

    This host (its names, loopback, its own addresses, its Docker bridge), private, link-local
    and reserved addresses, and local-only names are refused. Names are not resolved: a public
    name that resolves to a private address is found out by the run.
    """
    name = name.lower().strip("[]").rstrip(".")
    if is_this_host(name):
        return "is this host (a loopback address, one of its own, or its Docker bridge)"
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        local = name in LOCAL_NAMES or f".{name}".endswith(LOCAL_SUFFIXES)
        return "is a name of a local network only" if local else None
    if address.is_private or address.is_link_local or address.is_reserved:
        return "is a private address"
    return None


def check_remote_endpoint(model: ModelSpec, *, backend: str, opt_in_env: str | None) -> None:
    """Raise ConfigError when the model's endpoint cannot be reached from the sandboxes of
    `backend`, which run elsewhere (`unreachable_from_elsewhere`); `opt_in_env`: the
    environment variable that says they can reach this host after all (named in the fix)."""
    endpoint = model.endpoint if model.needs_network else None
    problem = unreachable_from_elsewhere(endpoint[0]) if endpoint else None
    if problem is None:
        return
    opt_in = (
        f"; or, for a local {backend}-compatible server whose sandboxes do reach it (tests, "
        f"a self-hosted deployment), set {opt_in_env}=1"
        if opt_in_env
        else ""
    )
    raise ConfigError(
        f"The model endpoint {model.api_base} {problem}, which the {backend} backend's "
        "sandboxes cannot reach: they run elsewhere. Nothing was built or started.",
        f"Use an endpoint reachable from the internet with --api-base, or run on this host "
        f"with --backend {DEFAULT_BACKEND}{opt_in}.",
    )


def host_networks(
    *, prefix_length: int | None = None
) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
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
