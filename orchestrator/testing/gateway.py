"""The model gateway's checks: one run of a hosted model (the kit's stub endpoint on this
host) through the gateway, in which the probe looks for the key and over-reports its tokens;
the key must be nowhere in the sandbox, and the record must count what the gateway measured."""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from collections.abc import Iterator
from typing import Any

from .hostnet import host_addresses
from .kit import CheckFailed, Kit, NotApplicable
from .model_stub import COMPLETION_TOKENS, PROMPT_TOKENS, ModelStub

#: The variable a hosted model's key is read from (the `openai` provider's).
KEY_ENV = "OPENAI_API_KEY"
#: How the kit's model keys start (what the probe looks for before it compares hashes).
KEY_PREFIX = "sk-conformance-"
#: The tokens the probe claims on top of what its model calls used (a lie the host must not
#: believe when a gateway measured them).
CLAIMED_TOKENS = 1_000_000


def secret_sought(key: str) -> dict[str, Any]:
    """The probe's `find` parameters for `key`: its prefix, length and hash, never the key."""
    return {
        "prefix": KEY_PREFIX,
        "length": len(key),
        "sha256": hashlib.sha256(key.encode()).hexdigest(),
    }


@contextlib.contextmanager
def model_key(key: str) -> Iterator[str]:
    """`key` as the hosted model's key for the runs made meanwhile (this process's
    environment, restored after)."""
    saved = os.environ.get(KEY_ENV)
    os.environ[KEY_ENV] = key
    try:
        yield key
    finally:
        if saved is None:
            os.environ.pop(KEY_ENV, None)
        else:
            os.environ[KEY_ENV] = saved


def stub_host(kit: Kit) -> str:
    """Where the kit's sandboxes reach an endpoint on this host: its loopback (as the host
    alias) on this host; one of its own addresses (the bridge's first) from elsewhere. Raises
    NotApplicable when sandboxes elsewhere cannot reach this host."""
    caps = kit.capabilities
    if caps.sandboxes_run == "this_host":
        return "127.0.0.1"
    env = caps.local_endpoints_env
    if not (env and os.environ.get(env) == "1"):
        raise NotApplicable(
            f"the {kit.backend_name} backend's sandboxes run elsewhere and cannot reach the "
            f"kit's model endpoint on this host (set {env or 'its local-endpoints variable'}=1 "
            "where they can)"
        )
    return host_addresses()[0]


def _gateway_run(kit: Kit) -> dict[str, Any]:
    """The gateway's run (once per kit): what the probe found, what the endpoint got."""

    def make() -> dict[str, Any]:
        host = stub_host(kit)
        key = f"{KEY_PREFIX}{secrets.token_hex(16)}"
        stub = ModelStub()
        try:
            with model_key(key):
                result = kit.run(
                    "gateway",
                    "find",
                    {**secret_sought(key), "lie_tokens": CLAIMED_TOKENS},
                    model="openai:conformance",
                    api_base=stub.api_base(host),
                    network=None,  # a hosted model's default: its endpoint, through the gateway
                )
        finally:
            stub.close()
        calls = len(stub.authorizations)
        forwarded = stub.authorizations.count(f"Bearer {key}")
        return {"result": result, "calls": calls, "forwarded": forwarded}

    found: dict[str, Any] = kit.memo("gateway-run", make)
    return found


def check_gateway_key_absent(kit: Kit) -> str:
    found = _gateway_run(kit)
    result = found["result"]
    seen = kit.answer(result)
    if seen["found"]:
        raise CheckFailed(
            f"the model key is readable in the sandbox: {', '.join(seen['found'])}",
            "Give the key to the run's gateway only (GatewayHandle.open) and the sandbox a "
            "run token.",
        )
    if not found["forwarded"]:
        raise CheckFailed(
            f"the model endpoint never got the key ({found['calls']} calls): the "
            "gateway did not forward it",
        )
    if not result.gateway.get("enabled"):
        raise CheckFailed("the run had no gateway although the backend offers one")
    return (
        f"the key is in no process's environment or command line, none of "
        f"{seen['memories']} readable process memories, none of {seen['files']} files; the "
        f"gateway forwarded it on {found['forwarded']} call(s)"
    )


def check_gateway_tokens(kit: Kit) -> str:
    found = _gateway_run(kit)
    result, calls = found["result"], found["calls"]
    kit.answer(result)
    measured = {"input_tokens": PROMPT_TOKENS * calls, "output_tokens": COMPLETION_TOKENS * calls}
    counted = {name: result.token_usage.get(name) for name in measured}
    if result.token_usage_source != "gateway" or counted != measured:
        raise CheckFailed(
            f"the record counts {counted} (source {result.token_usage_source!r}); the model "
            f"endpoint answered {calls} call(s) worth {measured}, and the sandbox claimed "
            f"{CLAIMED_TOKENS} more",
            "Count a run's tokens from its gateway's model_call reports (records.account_"
            "gateway), never from the sandbox's run_end.",
        )
    reported = result.token_usage_reported or {}
    if not result.token_usage_mismatch:
        raise CheckFailed(
            f"the sandbox claimed {reported} and the record did not flag the difference "
            "(token_usage_mismatch)"
        )
    return (
        f"the record counts the gateway's {measured} over {calls} call(s); the sandbox's "
        f"claim of {reported.get('input_tokens')} input tokens kept beside it, flagged"
    )
