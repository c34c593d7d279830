"""The Docker backend: hardened containers on the local engine.

`sandbox.py` one run's container, `egress.py` an `allowlist` run's network and proxy,
`images.py` the agent and payload images, `base_image.py` what they are built on,
`prune.py` listing and pruning, `engine.py` the connection.
"""

from __future__ import annotations

from pathlib import Path

from .engine import connect
from .sandbox import DockerBackend

__all__ = ["DockerBackend", "connect", "create_backend"]


def create_backend(env_file: str | Path | None = None) -> DockerBackend:
    """A backend on the local engine; EngineUnavailable if it cannot be reached."""
    return DockerBackend()
