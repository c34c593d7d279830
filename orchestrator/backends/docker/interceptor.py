"""The secret interceptor's output read back on the host (images/interceptor/interceptor.py):
where it listens and the run's CA certificate, the values it put on the wire and the
requests it refused, as squid's access log is read back in egress.py.

Not yet started by any run: `Capabilities.bound_secrets` stays False until the interceptor's
container is on the egress path (the run with bindings is refused before anything starts).
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

#: The prefixes of the interceptor's lines (its module docstring describes them).
READY_PREFIX = "ORCH-INTERCEPTOR-READY\t"
LOG_PREFIX = "ORCH-SECRET\t"
#: The reason of a request refused because it carried a placeholder where its secret may
#: not go (the `egress_blocked` event's `reason`).
SECRET_NOT_BOUND = "secret_not_bound"
#: Why a client's TLS handshake with the interceptor failed, as the record says it.
TLS_REFUSED = (
    "the client refused the interception's certificate (it pins certificates, or trusts "
    "only its own CA store, not the run's CA)"
)


@dataclass(frozen=True)
class Ready:
    """The interceptor listens at `address` (host:port); the sandbox must trust `ca_pem`."""

    address: str
    ca_pem: str


def read_ready(text: str) -> Ready | None:
    """The interceptor's ready line in its output, or None while it has none (a line that
    does not read as one is no ready line: the caller keeps waiting, then fails)."""
    for line in text.splitlines():
        if not line.startswith(READY_PREFIX):
            continue
        parts = line[len(READY_PREFIX) :].split("\t")
        if len(parts) != 2:
            continue
        try:
            pem = base64.b64decode(parts[1], validate=True).decode("ascii")
        except (binascii.Error, UnicodeDecodeError):
            continue
        if pem.startswith("-----BEGIN CERTIFICATE-----") and "PRIVATE KEY" not in pem:
            return Ready(parts[0], pem)
    return None


def _records(text: str) -> list[dict[str, Any]]:
    records = []
    for line in text.splitlines():
        if not line.startswith(LOG_PREFIX):
            continue
        try:
            record = json.loads(line[len(LOG_PREFIX) :])
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("ts"), (int, float)):
            records.append(record)
    return records


def refusals(text: str) -> list[dict[str, Any]]:
    """What the interceptor refused, as egress attempts (the shape of
    `egress.parse_access_log`'s): a placeholder where its secret may not go (`denied`,
    reason `secret_not_bound`, with the secret's name, the place and why), and clients that
    refused its certificate (`allowed` but failed: pinning, their own CA store)."""
    attempts = []
    for record in _records(text):
        verdict = record.get("verdict")
        event: dict[str, Any] = {"ts": float(record["ts"]), "host": record.get("host")}
        if verdict == "refused":
            event.update(
                method=record.get("method"),
                verdict="denied",
                reason=SECRET_NOT_BOUND,
                secret=record.get("name"),
                place=record.get("place"),
                detail=record.get("why"),
            )
        elif verdict == "tls_failed":
            event.update(verdict="allowed", reason=TLS_REFUSED, detail=record.get("why"))
        else:
            continue
        attempts.append(event)
    return attempts


def injections(text: str) -> list[dict[str, Any]]:
    """Where each secret's value was put on the wire, one entry per secret, host and place,
    in the order first seen: `{"secret", "host", "place", "count", "first_ts"}`; the record
    shows `injected NAME HOST PLACE`. Never a value: the interceptor never writes one."""
    seen: dict[tuple[str, str, str], dict[str, Any]] = {}
    for record in _records(text):
        if record.get("verdict") != "injected":
            continue
        key = (str(record.get("name")), str(record.get("host")), str(record.get("place")))
        entry = seen.setdefault(
            key,
            {
                "secret": key[0],
                "host": key[1],
                "place": key[2],
                "count": 0,
                "first_ts": record["ts"],
            },
        )
        entry["count"] += 1
    return list(seen.values())


def describe_injection(entry: dict[str, Any]) -> str:
    """`injected ANALYTICS_TOKEN api.example.com header:X-Api-Key` (and how many times)."""
    times = f" ({entry['count']} requests)" if entry.get("count", 1) > 1 else ""
    return f"injected {entry['secret']} {entry['host']} {entry['place']}{times}"
