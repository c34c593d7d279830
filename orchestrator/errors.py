"""Errors a user can act on: each says what went wrong and what to do about it."""

from __future__ import annotations


class OrchestratorError(Exception):
    """A problem with the user's input or environment, reported as one paragraph.

    `cause` says what is wrong (and where), `fix` says what to do. The CLI prints both and
    exits with `exit_code`; nothing has been started when one of these is raised before a run.
    """

    exit_code = 2
    #: The input field the problem is in (`payload`, `model`, `limits`...), when known: set by
    #: `runner.prepare`, so a schedules file or tasks file can point at its own field.
    field: str | None = None

    def __init__(self, cause: str, fix: str = "") -> None:
        self.cause = cause
        self.fix = fix
        super().__init__(f"{cause} {fix}".strip())


class ManifestError(OrchestratorError):
    """A payload manifest is malformed or asks for something refused."""


class ConfigError(OrchestratorError):
    """A bad option, model spec, policy or missing secret."""


class EngineUnavailable(OrchestratorError):
    """The sandbox engine (Docker daemon, E2B API) cannot be reached."""

    exit_code = 5


class RecordError(OrchestratorError):
    """The run store cannot be written (disk full, read-only, permissions)."""

    exit_code = 5


class ImageBuildError(OrchestratorError):
    """An image could not be built."""

    exit_code = 5
