"""E2B settings from the environment, the SDK's lazy import, and retries of its calls."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from ...errors import ConfigError
from ...images.imagedef import DEFAULT_BASE
from ...payloads.secrets import resolve_secrets
from ..base import Progress

T = TypeVar("T")


API_KEY_ENV = "E2B_API_KEY"


BASE_IMAGE_ENV = "ORCHESTRATOR_E2B_BASE_IMAGE"


PYTHON_ENV = "ORCHESTRATOR_E2B_PYTHON"


MAX_SANDBOXES_ENV = "ORCHESTRATOR_E2B_MAX_SANDBOXES"


CPUS_ENV = "ORCHESTRATOR_E2B_CPUS"


MEMORY_ENV = "ORCHESTRATOR_E2B_MEMORY_MB"


ATTEMPTS_ENV = "ORCHESTRATOR_E2B_ATTEMPTS"


#: Set to 1: this E2B's sandboxes reach this host (a local E2B-compatible server, as the tests
#: run, or a self-hosted one), so a model endpoint on this host or a private address is used
#: as given instead of refused.
ALLOW_LOCAL_ENDPOINTS_ENV = "ORCHESTRATOR_E2B_ALLOW_LOCAL_ENDPOINTS"


#: E2B's Hobby plan allows 20 concurrent sandboxes (Pro: 100 and more).
DEFAULT_MAX_SANDBOXES = 20


#: Sandbox size, fixed per template on E2B.
DEFAULT_CPUS = 2


DEFAULT_MEMORY_MB = 1024


#: Tries for each API call (create, kill, list, upload), the first included.
DEFAULT_ATTEMPTS = 4


def sdk() -> Any:
    """The `e2b` SDK, or a clear error saying how to install it."""
    try:
        import e2b
    except ImportError as exc:
        raise ConfigError(
            "The E2B backend needs the `e2b` package, which is not installed.",
            "Install the extra: pip install 'orchestrator[e2b]'.",
        ) from exc
    return e2b


@dataclass(frozen=True)
class E2BSettings:
    """How this host uses E2B; from the environment (and `.env` for the API key)."""

    api_key: str
    base_image: str = DEFAULT_BASE
    max_sandboxes: int = DEFAULT_MAX_SANDBOXES
    cpus: int = DEFAULT_CPUS
    memory_mb: int = DEFAULT_MEMORY_MB
    attempts: int = DEFAULT_ATTEMPTS
    python: str | None = None

    @classmethod
    def from_env(cls, env_file: str | Path | None = None) -> E2BSettings:
        try:
            api_key = resolve_secrets([API_KEY_ENV], env_file=env_file)[API_KEY_ENV]
        except ConfigError as exc:
            raise ConfigError(
                f"The E2B backend needs an API key, and {API_KEY_ENV} is not set.",
                f"Get one at https://e2b.dev/dashboard and export {API_KEY_ENV}=e2b_... (or add "
                "it to .env); it is used on this host only and never enters a sandbox. "
                "Nothing was started.",
            ) from exc
        return cls(
            api_key=api_key,
            base_image=os.environ.get(BASE_IMAGE_ENV) or DEFAULT_BASE,
            max_sandboxes=_int_env(MAX_SANDBOXES_ENV, DEFAULT_MAX_SANDBOXES, 1, 10_000),
            cpus=_int_env(CPUS_ENV, DEFAULT_CPUS, 1, 64),
            memory_mb=_int_env(MEMORY_ENV, DEFAULT_MEMORY_MB, 128, 65536),
            attempts=_int_env(ATTEMPTS_ENV, DEFAULT_ATTEMPTS, 1, 20),
            python=os.environ.get(PYTHON_ENV) or None,
        )


def _int_env(name: str, default: int, low: int, high: int) -> int:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise ConfigError(f"{name}={raw!r} is not a whole number from {low} to {high}.", "Fix it.")
    return value


def is_transient(exc: BaseException) -> bool:
    """Worth another try: rate limits, server errors, a busy service, a dropped connection."""
    import httpx

    e2b = sdk()
    if isinstance(exc, e2b.RateLimitException | e2b.ServiceBusyException | httpx.TransportError):
        return True
    status = getattr(exc, "status_code", None)
    return isinstance(exc, e2b.SandboxException) and isinstance(status, int) and status >= 500


def with_retries(attempts: int, call: Callable[[], T], *, what: str, progress: Progress) -> T:
    """`call()`, retried on transient faults with exponential backoff and jitter."""

    def before_sleep(state: Any) -> None:
        exc = state.outcome.exception() if state.outcome else None
        progress(f"e2b: {what} failed ({type(exc).__name__}: {exc}); retrying")

    retrying = Retrying(
        stop=stop_after_attempt(attempts),
        wait=wait_random_exponential(multiplier=0.5, max=30),
        retry=retry_if_exception(is_transient),
        before_sleep=before_sleep,
        reraise=True,
    )
    return retrying(call)
