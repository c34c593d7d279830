"""Sandbox backends, found by name.

Each backend is a package whose `create_backend(env_file)` makes it: the built-in ones are
sub-packages here (`docker/`, `e2b/`), others register through the entry-point group
`orchestrator.backends` (`orchestrator.registry`). It is imported only when chosen, so a
backend's heavy or optional dependency (the `e2b` SDK) costs nothing to users of another.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..registry import DEFAULT_BACKEND, backend_entries, backend_names

if TYPE_CHECKING:
    from ..manifest import Manifest
    from .base import Backend


def backend_name(requested: str | None, manifest: Manifest | None = None) -> str:
    """The backend of a run: the one asked for, else the payload's, else docker.

    Raises ConfigError for a name that is not a backend."""
    name = requested or (manifest.backend if manifest else None) or DEFAULT_BACKEND
    if name not in backend_names():
        raise ConfigError(
            f"Unknown backend {name!r}.", f"Use one of {', '.join(backend_names())}."
        )
    return name


def get_backend(name: str, *, env_file: str | Path | None = None) -> Backend:
    """A backend by name, ready to use; fails (before anything starts) if it cannot be used
    here: ConfigError for an unknown name or bad settings, EngineUnavailable when its engine
    or API cannot be reached."""
    entry = backend_entries()[backend_name(name)]
    module_name, _, function = entry.factory.partition(":")
    factory = getattr(importlib.import_module(module_name), function or "create_backend")
    return factory(env_file=env_file)
