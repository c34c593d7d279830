"""Which sandbox backends exist, by name: the built-in ones and those other packages register.

A package adds a backend through the entry-point group `orchestrator.backends`:

    [project.entry-points."orchestrator.backends"]
    mycloud = "mycloud_orchestrator:MyCloudBackend"

where `MyCloudBackend` subclasses `orchestrator.backends.base.Backend`: it declares its
`capabilities` (read before one is made) and `create_backend(env_file=None)` makes one. This
module only knows names, descriptions and where each class lives; it imports no backend
(that is `orchestrator.backends.get_backend`'s job), so that validating a manifest, a config
file or a command line costs no backend's dependencies. It sits at the bottom of the layers
for that reason: every layer may ask which names are backends.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

#: The entry-point group third-party backends register under.
ENTRY_POINT_GROUP = "orchestrator.backends"
#: The backend of a run that names none.
DEFAULT_BACKEND = "docker"


@dataclass(frozen=True)
class BackendEntry:
    """A backend by name: where its factory lives and a line for `--help`."""

    name: str
    #: `module:Class` of its `backends.base.Backend` subclass.
    factory: str
    summary: str
    #: The distribution that registered it (None: built into orchestrator).
    distribution: str | None = None


_BUILT_IN = (
    BackendEntry(
        "docker",
        "orchestrator.backends.docker:DockerBackend",
        "this host's Docker engine",
    ),
    BackendEntry(
        "e2b",
        "orchestrator.backends.e2b:E2BBackend",
        "E2B's cloud, needs E2B_API_KEY",
    ),
)

_BY_NAME = {entry.name: entry for entry in _BUILT_IN}


def entry_points(**selection: str) -> Any:
    """`importlib.metadata.entry_points` (the site's reference pages put a stand-in here, to
    show only the built-in backends)."""
    from importlib import metadata

    return metadata.entry_points(**selection)


@functools.cache
def backend_entries() -> dict[str, BackendEntry]:
    """Every backend by name: the built-in ones first, then those of installed packages (a
    package cannot replace a built-in name: a plugin must not silently take over `docker`).
    Reads every installed distribution's entry points (milliseconds of CPU in a large
    environment: benchmarks/results/code_figures.md#import-costs-on-the-start-path), once
    per process: `backend_entry` spares it a run on a built-in backend."""
    found = dict(_BY_NAME)
    for point in entry_points(group=ENTRY_POINT_GROUP):
        if point.name in found:
            continue
        dist = point.dist.name if point.dist is not None else None
        summary = f"registered by {dist}" if dist else "a registered backend"
        found[point.name] = BackendEntry(point.name, point.value, summary, dist)
    return found


def backend_entry(name: str) -> BackendEntry | None:
    """The backend `name` (None: no such backend). A built-in name is answered without
    reading the entry points: no package can take it over."""
    return _BY_NAME.get(name) or backend_entries().get(name)


def backend_names() -> tuple[str, ...]:
    """The names `--backend`, `payload.backend`, the config file and schedules accept."""
    return tuple(backend_entries())


def backends_help() -> str:
    """One phrase naming every backend and what it is, for `--backend`'s help."""
    return "; ".join(f"{e.name} ({e.summary})" for e in backend_entries().values())
