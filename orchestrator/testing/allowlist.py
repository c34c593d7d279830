"""The checks of egress under `allowlist`: one run whose sandbox reaches a listed endpoint
(the kit's model stub, listed as the run's model endpoint) and tries an unlisted one on the
same host (a listener counting what arrives); the refusal must be in the record."""

from __future__ import annotations

import secrets
from typing import Any

from ..policy import HOST_ALIAS
from .gateway import KEY_PREFIX, model_key, stub_host
from .hostnet import Listener
from .kit import CheckFailed, Kit
from .model_stub import ModelStub

ALLOWLIST_FIX = (
    "Under `allowlist` give the sandbox one way out, through a proxy that lets only the "
    "listed hosts and endpoints through (NetworkPolicy.hosts, endpoints, host_endpoints)."
)


def _allowlist_run(kit: Kit) -> dict[str, Any]:
    """The allowlist run (once per kit): the probe's outcomes and what each side saw."""

    def make() -> dict[str, Any]:
        host = stub_host(kit)
        target = HOST_ALIAS if kit.capabilities.sandboxes_run == "this_host" else host
        stub, listener = ModelStub(), Listener()
        attempts = [
            {"kind": "http", "url": f"http://{target}:{stub.port}/allowed"},
            {"kind": "http", "url": f"http://{target}:{listener.port}/unlisted"},
        ]
        try:
            with model_key(f"{KEY_PREFIX}{secrets.token_hex(16)}"):
                result = kit.run(
                    "allowlist",
                    "net",
                    {"attempts": attempts},
                    model="openai:conformance",
                    api_base=stub.api_base(host),
                    network="allowlist",  # the model's endpoint listed, nothing else
                    gateway=False,  # the sandbox itself reaches the endpoint, through egress
                )
        finally:
            stub.close()
            listener.close()
        return {
            "result": result,
            "outcomes": kit.answer(result),
            "gets": stub.gets,
            "arrived": listener.connections,
            "unlisted_port": listener.port,
        }

    found: dict[str, Any] = kit.memo("allowlist-run", make)
    return found


def check_allowlist_allowed(kit: Kit) -> str:
    seen = _allowlist_run(kit)
    allowed = seen["outcomes"][0]
    if not allowed["ok"] or not seen["gets"]:
        raise CheckFailed(
            f"under `allowlist` the listed endpoint {allowed['url']} was not reached "
            f"({allowed.get('status') or allowed.get('error')}; {seen['gets']} requests "
            "arrived there)",
            ALLOWLIST_FIX,
        )
    return f"{allowed['url']} answered {allowed['status']} (allowlist: {seen['result'].allowlist})"


def check_allowlist_refused(kit: Kit) -> str:
    seen = _allowlist_run(kit)
    unlisted = seen["outcomes"][1]
    if unlisted["ok"] or seen["arrived"]:
        raise CheckFailed(
            f"under `allowlist` the unlisted {unlisted['url']} was reached "
            f"({unlisted.get('status')}; {seen['arrived']} connections arrived there)",
            ALLOWLIST_FIX,
        )
    said = unlisted.get("status") or unlisted.get("error")
    return f"{unlisted['url']} refused ({said}), no connection arrived"


def check_allowlist_recorded(kit: Kit) -> str:
    seen = _allowlist_run(kit)
    result, port = seen["result"], seen["unlisted_port"]
    blocked = kit.events_of(result, "egress_blocked")
    named = [e for e in blocked if int(e.get("port") or 0) == port]
    if not named:
        raise CheckFailed(
            f"the refused attempt on port {port} is not in the record "
            f"({len(blocked)} egress_blocked events: {blocked[:3]})",
            "Report what the egress control refused (Sandbox.egress_blocked), or declare "
            "egress_events=False.",
        )
    return (
        f"egress_blocked {named[0].get('host')}:{port} from {named[0].get('source')}; "
        f"the result counts {result.egress_blocked}"
    )
