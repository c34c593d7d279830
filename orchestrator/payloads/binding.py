"""Secrets bound to hosts (`[secrets.bind]`): the manifest's rules, checked on the host.

A bound secret is meant never to enter the sandbox: the sandbox holds a placeholder, and an
intercepting proxy on the egress path puts the value into a request only for the hosts and
places it is bound to. This module is the manifest side only: what a binding may say, and
whether it says it consistently with the rest of the manifest. Whether a backend can keep
the promise is `Capabilities.bound_secrets`, asked by `runner.prepare`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from ..errors import Problem
from ..policy import HOST_NAME_HELP, check_host_name, host_covered
from ..schema import INVALID, Field, Table, check_value

#: Where in a request a placeholder may be replaced by its value. `header` covers every
#: header, Authorization's Basic credentials included; `query` and `body` must be asked for.
PLACES = ("header", "query", "body")
DEFAULT_PLACES = ("header",)

BIND_FIX = (
    'For example [secrets.bind] ANALYTICS_TOKEN = { hosts = ["api.example.com"], in = '
    '["header"] }: a secret of `[secrets] required`, bound to hosts of `[network] hosts`.'
)

#: One binding's table (`secrets.bind.NAME`).
BINDING = Field(
    dict,
    table=Table(
        {
            "hosts": Field(
                list,
                required=True,
                items=Field(str, check=check_host_name, fix=HOST_NAME_HELP),
                fix="It is required: the hosts (from `[network] hosts`) the secret goes to.",
            ),
            "in": Field(
                list,
                items=Field(str, choices=PLACES),
                fix=f"Each must be one of {', '.join(PLACES)} (default: header).",
            ),
        }
    ),
)

#: `[network] passthrough`: hosts (of `[network] hosts`) whose TLS a bound run's interceptor
#: relays unread, for clients that pin certificates; checked with the bindings
#: (`check_bindings`: on the allowlist, and no secret bound to one).
#: Its names are checked there too, so that a bad one does not hide the allowlist.
PASSTHROUGH_FIELD = Field(
    list,
    items=Field(str),
    fix="Names or `*.` patterns of `[network] hosts` whose TLS a bound run's interceptor "
    "relays unread (clients that pin certificates); no secret may be bound to one.",
)

#: The `bind` field of a manifest's `[secrets]`: secret names to their bindings, each checked
#: by `check_bindings` (with the rest of the manifest: every problem of every binding at once).
BIND_FIELD = Field(dict)


@dataclass(frozen=True)
class SecretBinding:
    """One secret bound to hosts: the value goes on the wire only to `hosts` (exact names or
    `*.` patterns, lower case), only in `places` (of `PLACES`)."""

    name: str
    hosts: tuple[str, ...]
    places: tuple[str, ...] = DEFAULT_PLACES

    def describe(self) -> str:
        """`NAME -> api.example.com (header)`, for messages and the record."""
        return f"{self.name} -> {', '.join(self.hosts)} ({', '.join(self.places)})"


def check_bindings(
    sections: dict[str, dict[str, Any]], problems: list[Problem]
) -> tuple[SecretBinding, ...]:
    """The bindings of a manifest's `[secrets.bind]`, each checked against `BINDING` and
    against the rest of the manifest (a name not in `[secrets] required`, a host that
    `[network] hosts` does not cover or `[network] passthrough` relays unread), and the
    passthrough hosts against the allowlist; every problem added to `problems`."""
    required = tuple(sections["secrets"].get("required", ()))
    allowlist = tuple(h.lower() for h in sections["network"].get("hosts", ()))
    passthrough = passthrough_hosts(sections)
    bindings: list[SecretBinding] = []
    for name, table in sections["secrets"].get("bind", {}).items():
        where = f"secrets.bind.{name}"
        found: list[Problem] = []
        if name not in required:
            found.append(
                Problem(
                    where,
                    f"binds {name!r}, which is not a secret of `[secrets] required` "
                    f"(declared: {', '.join(required) or 'none'})",
                    f"Add {name} to `[secrets] required`, or fix the name.",
                )
            )
        checked = check_value(BINDING, table, where, found)
        hosts = table.get("hosts") if isinstance(table, dict) else None
        for host in hosts if isinstance(hosts, list) else ():
            if isinstance(host, str) and not check_host_name(host):
                if not host_covered(host, allowlist):
                    found.append(_not_listed(f"{where}.hosts", host.lower()))
        for place in ("hosts", "in"):
            if checked is not INVALID and checked.get(place) == []:
                found.append(Problem(f"{where}.{place}", "is empty", _EMPTY_FIX[place]))
        for host in hosts if isinstance(hosts, list) else ():
            relayed = [
                p for p in passthrough if not check_host_name(p) and _overlap(str(host).lower(), p)
            ]
            if isinstance(host, str) and relayed:
                found.append(_relayed(f"{where}.hosts", host.lower(), relayed[0]))
        problems += found
        if not found:
            places = tuple(dict.fromkeys(checked.get("in", DEFAULT_PLACES)))
            bound = tuple(dict.fromkeys(h.lower() for h in checked["hosts"]))
            bindings.append(SecretBinding(name=name, hosts=bound, places=places))
    for host in passthrough:
        if bad := check_host_name(host):
            problems.append(
                Problem("network.passthrough", f"has an entry {host!r} that {bad}", HOST_NAME_HELP)
            )
        elif not host_covered(host, allowlist):
            problems.append(
                Problem(
                    "network.passthrough",
                    f"has an entry {host!r} that is not on the allowlist of `[network] hosts`",
                    f"Add {host} to `[network] hosts`, or remove it from passthrough (a "
                    "host the run may not reach needs no passthrough).",
                )
            )
    return tuple(bindings)


def passthrough_hosts(sections: dict[str, dict[str, Any]]) -> tuple[str, ...]:
    """`[network] passthrough`, lower case, once each (as checked by the schema)."""
    raw = sections["network"].get("passthrough", ())
    if not isinstance(raw, list):
        return ()
    return tuple(dict.fromkeys(h.lower() for h in raw if isinstance(h, str)))


def _overlap(bound: str, relayed: str) -> bool:
    """A name or pattern both lists can name (the interceptor refuses such a pair too)."""
    return host_covered(bound, [relayed]) or host_covered(relayed, [bound])


def _relayed(field: str, host: str, relayed: str) -> Problem:
    return Problem(
        field,
        f"has an entry {host!r} whose TLS `[network] passthrough` relays unread "
        f"({relayed!r}): the value could never be put in place there",
        f"Remove {relayed} from `[network] passthrough` (its clients must then trust the "
        "run's CA), or bind the secret to another host.",
    )


_EMPTY_FIX = {
    "hosts": "List the hosts the secret goes to, or remove the binding.",
    "in": f"Leave it out (header) or name places: {', '.join(PLACES)}.",
}


def _not_listed(field: str, host: str) -> Problem:
    return Problem(
        field,
        f"has an entry {host!r} that is not on the allowlist of `[network] hosts`",
        f"Add {host} to `[network] hosts` (a secret is bound only to hosts the run may "
        "reach), or bind the secret to a listed host.",
    )


@dataclass(frozen=True)
class BoundSecret:
    """A bound secret in one run: the placeholder the sandbox holds in its place, and the
    value only the interceptor gets (at its start, on its stdin)."""

    binding: SecretBinding
    placeholder: str
    value: str = field(repr=False)

    def interceptor_config(self) -> dict[str, Any]:
        """This secret as the interceptor's configuration names it
        (images/interceptor/interceptor.py)."""
        b = self.binding
        return {
            "name": b.name,
            "placeholder": self.placeholder,
            "value": self.value,
            "hosts": list(b.hosts),
            "in": list(b.places),
        }


def new_placeholder(name: str, value: str) -> str:
    """A fresh placeholder for the secret `name` (a new one per run): its name, to tell a
    reader what it stands for, and 128 random bits; never inside the value or holding it."""
    while True:
        placeholder = f"orchestrator-bound-{name}-{secrets.token_hex(16)}"
        if placeholder not in value and value not in placeholder:
            return placeholder


def bind_secrets(
    values: dict[str, str], bindings: tuple[SecretBinding, ...]
) -> tuple[dict[str, str], tuple[BoundSecret, ...]]:
    """The secrets the sandbox gets, each bound one's value replaced by a fresh placeholder,
    and the bound secrets for the interceptor. A binding whose secret has no value here
    (schedule validation reads none) is left out of both."""
    sandbox = dict(values)
    bound = []
    for binding in bindings:
        value = values.get(binding.name)
        if not value:
            continue
        placeholder = new_placeholder(binding.name, value)
        sandbox[binding.name] = placeholder
        bound.append(BoundSecret(binding, placeholder, value))
    return sandbox, tuple(bound)
