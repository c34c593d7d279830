"""The Docker backend's module: what it knows without the engine."""

from __future__ import annotations


def test_runsc_direct_is_named_as_runsc_direct_names_itself() -> None:
    """backend.py names the runtime itself, so that runs on the others never import
    runsc_direct/ (tests/cli/test_help.py checks that they do not)."""
    from orchestrator.backends.docker import backend
    from orchestrator.backends.docker.runsc_direct import direct

    assert backend.RUNSC_DIRECT == direct.RUNSC_DIRECT
    assert direct.RUNSC_DIRECT in backend.DockerBackend.capabilities.sandbox_runtimes
