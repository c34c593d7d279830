"""Sandbox backends, found by name.

Each backend is a sub-package (`docker/`, `e2b/`) whose `__init__` offers
`create_backend(env_file)`. It is imported only when chosen, so a backend's heavy or optional
dependency (the `e2b` SDK) costs nothing to users of another. A new backend is a new
sub-package plus its name in `orchestrator.spec.BACKENDS`.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..spec import BACKENDS

if TYPE_CHECKING:
    from ..manifest import Manifest
    from .base import Backend


def backend_name(requested: str | None, manifest: Manifest | None = None) -> str:
    """The backend of a run: the one asked for, else the payload's, else docker.

    Raises ConfigError for a name that is not a backend."""
    name = requested or (manifest.backend if manifest else None) or "docker"
    if name not in BACKENDS:
        raise ConfigError(f"Unknown backend {name!r}.", f"Use one of {', '.join(BACKENDS)}.")
    return name


def get_backend(name: str, *, env_file: str | Path | None = None) -> Backend:
    """A backend by name, ready to use; fails (before anything starts) if it cannot be used
    here: ConfigError for an unknown name or bad settings, EngineUnavailable when its engine
    or API cannot be reached."""
    package = importlib.import_module(f"{__name__}.{backend_name(name)}")
    return package.create_backend(env_file=env_file)
