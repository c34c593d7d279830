"""Sandbox backends, found by name.

Each backend is a `base.Backend` subclass, made by its `create_backend(env_file)`: the
built-in ones live in sub-packages here (`docker/`, `e2b/`), others register through the
entry-point group `orchestrator.backends` (`orchestrator.registry`). Its module is imported
only when it is chosen (or its capabilities are asked for), so a backend's heavy or optional
dependency (the `e2b` SDK, imported when one is made) costs nothing to users of another.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..registry import DEFAULT_BACKEND, backend_entries, backend_entry, backend_names

if TYPE_CHECKING:
    from ..payloads.manifest import Manifest
    from .base import Backend, Capabilities


def backend_name(requested: str | None, manifest: Manifest | None = None) -> str:
    """The backend of a run: the one asked for, else the payload's, else the default.

    Raises ConfigError for a name that is not a backend."""
    name = requested or (manifest.backend if manifest else None) or DEFAULT_BACKEND
    if backend_entry(name) is None:
        raise ConfigError(f"Unknown backend {name!r}.", f"Use one of {', '.join(backend_names())}.")
    return name


def backend_class(name: str) -> type[Backend]:
    """A backend's class by name, imported (not made: no settings read, no engine reached).

    Raises ConfigError for an unknown name, or when what is registered under it cannot be
    imported or is no `Backend` subclass."""
    from .base import Backend

    name = backend_name(name)
    entry = backend_entry(name) or backend_entries()[name]
    module_name, _, attribute = entry.factory.partition(":")
    where = f"registered by {entry.distribution}" if entry.distribution else "built in"
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"The {name} backend ({where}, {entry.factory}) cannot be loaded: {exc}.",
            "Reinstall the package that provides it (or choose another backend).",
        ) from exc
    if not (isinstance(found, type) and issubclass(found, Backend)):
        raise ConfigError(
            f"The {name} backend ({where}) names {entry.factory}, which is not a subclass "
            "of orchestrator.backends.base.Backend.",
            "Point its entry point in the group `orchestrator.backends` at the backend's "
            'class (docs/ARCHITECTURE.md, "Adding a backend").',
        )
    return found


def backend_capabilities(name: str) -> Capabilities:
    """What the backend `name` can do, as its class declares it (nothing is made). Raises
    ConfigError as `backend_class`."""
    return backend_class(name).capabilities


def get_backend(name: str, *, env_file: str | Path | None = None) -> Backend:
    """A backend by name, ready to use; fails (before anything starts) if it cannot be used
    here: ConfigError for an unknown name or bad settings, EngineUnavailable when its engine
    or API cannot be reached."""
    return backend_class(name).create_backend(env_file=env_file)
