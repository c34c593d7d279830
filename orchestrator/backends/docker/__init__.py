"""The Docker backend: hardened containers on the local engine.

`backend.py` the backend (`DockerBackend`, what the registry names), `sandbox.py` one run's
container, `snapshots.py` gVisor sandboxes restored from a snapshot,
`egress.py` an `allowlist` run's network and proxy, `gateway.py` the run's model gateway,
`images.py` the agent and payload images, `base_image.py` what they are built on,
`prune.py` listing and pruning, `engine.py` the connection.
"""

from __future__ import annotations

from .backend import DockerBackend
from .engine import connect

__all__ = ["DockerBackend", "connect"]
