"""The E2B backend: one E2B sandbox per run, from a template made of the agent image's
definition.

`settings.py` the environment, the SDK and retries, `templates.py` the template,
`sandbox.py` one run's sandbox and the backend.
"""

from __future__ import annotations

from pathlib import Path

from .sandbox import E2BBackend, E2BSandbox
from .settings import E2BSettings
from .templates import ensure_template

__all__ = ["E2BBackend", "E2BSandbox", "E2BSettings", "create_backend", "ensure_template"]


def create_backend(env_file: str | Path | None = None) -> E2BBackend:
    """A backend on E2B; ConfigError without an API key (or without the `e2b` SDK)."""
    return E2BBackend(E2BSettings.from_env(env_file))
