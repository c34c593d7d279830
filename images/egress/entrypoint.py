"""Render this run's squid configuration into tmpfs, then become squid.

The policy comes in as one JSON document on stdin, ended by the end of input (not secret;
written by orchestrator/backends/docker/egress.py; not an environment variable, which the
kernel caps at 128 KiB: a long allowlist passes that):

    {"hosts": ["api.example.com"],             exact names, ports 80 and 443
     "wildcards": ["example.org"],             *.example.org: any subdomain, not the apex
     "endpoints": [["llm.example.net", 8443]], one name, one extra port
     "host_endpoints": [["host.orchestrator.internal", 8080]],
                                               a service on the Docker host; the only way
                                               past the private-address rule
     "clients": ["172.30.0.0/16"],             the run's private network: the only clients
     "blocked_dst": ["192.0.2.2/32"]}          the Docker host's addresses, Docker's subnets

Every value is validated again here: a malformed one stops the proxy (fail closed). The
listed names go into files of their own, one a line, which squid's ACLs read
(`acl NAME dstdomain "FILE"`): a configuration line holds any number of them that way.
"""

import ipaddress
import json
import os
import re
import sys

HERE = "/etc/squid/orchestrator"
CONF = "/tmp/squid.conf"
#: The listed names (exact) and the wildcards' patterns, one a line (tmpfs, like CONF).
NAMES = "/tmp/listed_names"
PATTERNS = "/tmp/listed_patterns"
NAME = re.compile(r"^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def name(value: object) -> str:
    text = str(value).lower()
    if not NAME.match(text) or len(text) > 253:
        raise ValueError(f"not a host name: {value!r}")
    return text


def port(value: object) -> int:
    if not isinstance(value, int) or not 0 < value < 65536:
        raise ValueError(f"not a port: {value!r}")
    return value


def network(value: object) -> str:
    return str(ipaddress.ip_network(str(value), strict=False))


def suffix_regex(suffix: str) -> str:
    """`*.example.org`: one or more labels, then exactly `example.org`."""
    return r"^([a-z0-9-]+\.)+" + re.escape(suffix) + "$"


def render(policy: dict) -> tuple[str, str, dict[str, str]]:
    """The run's `http_access` rules and `ssl_bump` rules, as squid.conf text, and the files
    they read (path: text)."""
    hosts = [name(h) for h in policy.get("hosts", [])]
    wildcards = [name(w) for w in policy.get("wildcards", [])]
    endpoints = [(name(h), port(p)) for h, p in policy.get("endpoints", [])]
    host_endpoints = [(name(h), port(p)) for h, p in policy.get("host_endpoints", [])]
    clients = [network(c) for c in policy.get("clients", [])]
    blocked = [network(b) for b in policy.get("blocked_dst", [])]
    if not clients:
        raise ValueError("no client network given")

    # Only the run's own network may use this proxy; IP literals are never allowed.
    rules = [
        f"acl run_clients src {' '.join(clients)}",
        "http_access deny front_port !run_clients",
        "http_access deny sni_port !loopback",
    ]
    if blocked:
        rules.append(f"acl blocked_dst dst {' '.join(blocked)}")
    rules.append("http_access deny ip_literal")
    sni: list[tuple[str, str]] = []  # (acl name, definition) of names a TLS SNI may carry

    # The named model endpoint on the Docker host: this name and this port, nothing else. It
    # is the one exception to the private-address rule, so it comes first. (The Host header
    # needs no rule: squid sends the request URL's host, RFC 9112 3.2.2.)
    for i, (host, host_port) in enumerate(host_endpoints):
        rules += [
            f"acl host_ep{i} dstdomain -n {host}",
            f"acl host_ep{i}_port port {host_port}",
            f"http_access allow host_ep{i} host_ep{i}_port",
        ]
        sni.append((f"host_ep{i}_sni", f"ssl::server_name {host}"))

    # Listed names. Nothing above or here resolves a name: unlisted names are refused
    # unresolved; `blocked_dst` (a DNS lookup) is only ever evaluated for listed names.
    for i, (host, extra_port) in enumerate(endpoints):
        rules += [
            f"acl endpoint{i} dstdomain -n {host}",
            f"acl endpoint{i}_port port {extra_port}",
            f"http_access allow endpoint{i} endpoint{i}_port !blocked_dst",
        ]
        sni.append((f"endpoint{i}_sni", f"ssl::server_name {host}"))
    listed = []
    files = {}
    if hosts:
        files[NAMES] = "".join(f"{h}\n" for h in dict.fromkeys(hosts))
        rules.append(f'acl listed_names dstdomain -n "{NAMES}"')
        sni.append(("listed_sni", f'ssl::server_name "{NAMES}"'))
        listed.append("listed_names")
    if wildcards:
        files[PATTERNS] = "".join(f"{suffix_regex(w)}\n" for w in dict.fromkeys(wildcards))
        rules.append(f'acl listed_wild dstdom_regex -n -i "{PATTERNS}"')
        sni.append(("listed_wild_sni", f'ssl::server_name_regex -i "{PATTERNS}"'))
        listed.append("listed_wild")
    for acl in listed:
        rules += [
            f"http_access deny {acl} !web_ports",
            f"http_access deny {acl} CONNECT !tls_ports",
            f"http_access allow {acl} !blocked_dst",
        ]
    ssl = [f"acl {acl} {definition}" for acl, definition in sni]
    ssl += [f"ssl_bump splice {acl}" for acl, _ in sni]
    return "\n".join(rules), "\n".join(ssl), files


def main() -> None:
    try:
        # The whole input: the host ends it after the policy (an input cut short is no JSON).
        access, ssl, files = render(json.loads(sys.stdin.buffer.read() or b"{}"))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        print(f"egress: refusing to start: bad policy: {exc}", file=sys.stderr)
        sys.exit(2)
    for path, text in files.items():
        with open(path, "w") as out:
            out.write(text)
    with open(f"{HERE}/squid.conf.template") as template:
        conf = template.read().replace("@ACCESS_RULES@", access).replace("@SSL_RULES@", ssl)
    with open(CONF, "w") as out:
        out.write(conf)
    sys.stdout.flush()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # squid reads nothing of the host's
    os.execv("/usr/sbin/squid", ["squid", "-N", "-f", CONF])


if __name__ == "__main__":
    main()
