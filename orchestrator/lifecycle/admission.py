"""Whether a run may go ahead on its backend, decided while it is prepared (`prepared.prepare`)
from what the backend declares (`Capabilities`), before anything starts: these are rules
about runs, not a backend's business, so no backend implements them."""

from __future__ import annotations

import os

from ..backends.base import Capabilities
from ..errors import ConfigError
from ..models import ModelSpec
from ..payloads.manifest import Manifest
from ..policy import check_remote_endpoint
from ..spec import NetworkPolicy


def check_bound_secrets(backend: str, capabilities: Capabilities, manifest: Manifest) -> None:
    """Raise ConfigError (exit 2, before anything starts) when the payload binds secrets to
    hosts and the backend cannot keep them out of the sandbox (`Capabilities.bound_secrets`):
    running it anyway would put the value inside, the one thing a binding asks not to."""
    if not manifest.bindings or capabilities.bound_secrets:
        return
    bound = "; ".join(b.describe() for b in manifest.bindings)
    raise ConfigError(
        f"{manifest.path}: `[secrets.bind]` binds {bound}, but binding secrets to hosts is "
        f"not available on the {backend} backend (yet): it has no intercepting proxy on "
        "its sandboxes' egress path to keep the value out of the sandbox. Nothing was "
        "started.",
        "Remove `[secrets.bind]` to run with the secret inside the sandbox (in its "
        "environment, as `[secrets] required` alone gives it), or run on a backend that "
        "binds secrets.",
    )


def check_bound_network(manifest: Manifest, network: NetworkPolicy) -> None:
    """Raise ConfigError (exit 2, before anything starts) for bound secrets under `open`:
    the sandbox would have a way out past the interceptor, and a binding's hosts mean
    something only against an allowlist. (`none`: nothing leaves, the placeholder alone
    is inside.)"""
    if not manifest.bindings or network.mode != "open":
        return
    bound = "; ".join(b.describe() for b in manifest.bindings)
    raise ConfigError(
        f"{manifest.path}: `[secrets.bind]` binds {bound}, but the run's network policy is "
        "`open`: a bound secret needs the allowlist (its only way out is the interceptor, "
        "in front of the egress proxy). Nothing was started.",
        "Run with --network allowlist (the default for a payload with hosts), or remove "
        "`[secrets.bind]` to run with the secret inside the sandbox.",
    )


def endpoint_on_host(capabilities: Capabilities, model: ModelSpec, backend: str) -> bool:
    """True when a model endpoint on this host is reached as `policy.HOST_ALIAS` (sandboxes
    on this host), False when it is used as given. Raises ConfigError (before anything
    starts) for an endpoint that sandboxes running elsewhere cannot reach."""
    if capabilities.sandboxes_run == "this_host":
        return True
    env = capabilities.local_endpoints_env
    if not (env and os.environ.get(env) == "1"):
        check_remote_endpoint(model, backend=backend, opt_in_env=env)
    return False
