"""The `mirror` backend: Docker's sandboxes under another name, registered from outside
orchestrator (see pyproject.toml's entry point). It shows what a third-party backend needs:
a `Backend` subclass with a `name`, its `capabilities` declared as data, and
`create_backend(env_file)`; everything else comes from the class it builds on."""

from __future__ import annotations

from pathlib import Path

from orchestrator.backends.base import Backend
from orchestrator.backends.docker import DockerBackend

__all__ = ["MirrorBackend"]


class MirrorBackend(DockerBackend):
    """Sandboxes on the local Docker engine, under the name `mirror`."""

    name = "mirror"
    #: Docker's, declared again on purpose: a backend says what it can do.
    capabilities = DockerBackend.capabilities

    @classmethod
    def create_backend(cls, env_file: str | Path | None = None) -> Backend:
        """A backend on the local engine; EngineUnavailable if it cannot be reached."""
        return cls()
