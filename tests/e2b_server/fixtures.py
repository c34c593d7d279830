"""pytest fixtures for the E2B test server.

Wire them into tests/conftest.py with:

    from tests.e2b_server.fixtures import e2b_test_server, fake_e2b  # noqa: F401
"""

from __future__ import annotations

from collections.abc import Iterator

import docker
import docker.errors
import pytest

from .cloud import DEFAULT_IMAGE
from .server import E2BTestServer

TEST_TEMPLATE = "orchestrator-test"


def docker_ready(image: str = DEFAULT_IMAGE) -> str | None:
    """None if Docker answers and has `image`, else the reason it cannot be used."""
    try:
        client = docker.from_env()
        client.ping()
        client.images.get(image)
    except docker.errors.ImageNotFound:
        return f"image {image} is not built"
    except Exception as e:  # noqa: BLE001 - any failure means no usable engine
        return f"Docker engine not available: {e}"
    return None


@pytest.fixture(scope="session")
def e2b_test_server() -> Iterator[E2BTestServer]:
    """One E2B test server for the session; templates "base" and "orchestrator-test"
    both map to orchestrator-base:bookworm until a test maps them elsewhere."""
    reason = docker_ready()
    if reason:
        pytest.skip(reason)
    server = E2BTestServer(templates={"base": DEFAULT_IMAGE, TEST_TEMPLATE: DEFAULT_IMAGE})
    with server:
        yield server


@pytest.fixture
def fake_e2b(
    e2b_test_server: E2BTestServer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[E2BTestServer]:
    """The session server, freshly reset, with the SDK's environment pointing at it.

    After the test, sandboxes it left alive are killed and its configuration changes
    (templates, caps, default user, network, delays) are undone.
    """
    server = e2b_test_server
    saved = (
        dict(server.templates),
        server.max_concurrent,
        server.default_user,
        server.container_network,
        dict(server.container_options),
    )
    server.reset()
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    try:
        yield server
    finally:
        for sandbox_id in server.alive_ids():
            server.kill(sandbox_id, reason="test teardown")
        (
            server.templates,
            server.max_concurrent,
            server.default_user,
            server.container_network,
            server.container_options,
        ) = saved
        server.reset()
