"""The connection to the local engine (backends/docker/engine.py), against the real engine."""

from __future__ import annotations

import pytest

from orchestrator.backends.docker.engine import connect, engine_api_version
from orchestrator.errors import EngineUnavailable


@pytest.mark.docker
def test_the_client_speaks_the_engines_own_api_version(docker_client) -> None:
    """`/_ping`'s version is the one the SDK's "auto" reads from `/version`: the client
    speaks what the engine offers, not the SDK's default."""
    offered = docker_client.api.version(api_version=False)["ApiVersion"]
    assert engine_api_version() == offered
    assert connect().api.api_version == offered


def test_no_engine_is_an_error_saying_how_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(EngineUnavailable) as error:
        connect()
    assert "Cannot reach the Docker engine" in error.value.cause
    assert "Start Docker" in error.value.fix
