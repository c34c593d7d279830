"""The Docker backend: hardened containers on the local engine.

`backend.py` the backend (`DockerBackend`, what the registry names), `sandbox.py` one run's
container, `snapshots.py` gVisor sandboxes restored from a snapshot,
`egress.py` an `allowlist` run's network and proxy, `gateway.py` the run's model gateway,
`images.py` the agent and payload images, `base_image.py` what they are built on,
`prune.py` listing and pruning, `engine.py` the connection, `runsc_direct/` gVisor driven
through runsc itself.

The two names below are imported on first use (as the top package's are), so that a module
of this package that needs no engine (runsc_direct's head start, at `run`'s very start)
costs no Docker SDK import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backend import DockerBackend
    from .engine import connect

_EXPORTS = {"DockerBackend": "backend", "connect": "engine"}

__all__ = ["DockerBackend", "connect"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
