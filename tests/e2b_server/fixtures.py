"""pytest fixtures for the E2B test server.

Wire them into tests/conftest.py with:

    from tests.e2b_server.fixtures import e2b_test_server, fake_e2b  # noqa: F401
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import docker
import docker.errors
import pytest

from .server import E2BTestServer

TEST_TEMPLATE = "orchestrator-test"


@functools.cache
def base_image() -> str:
    """The image sandboxes and template builds start from: the agent image's own base
    (`$ORCHESTRATOR_BASE_IMAGE`, else python:3.12-slim, pulled; where no registry answers,
    the Debian base orchestrator bootstraps), so the tests run on any machine."""
    from orchestrator.backends.docker import connect
    from orchestrator.backends.docker.base_image import resolve_base

    return resolve_base(connect())


def docker_ready(image: str | None = None) -> str | None:
    """None if Docker answers and has `image`, else the reason it cannot be used."""
    try:
        client = docker.from_env()
        client.ping()
        client.images.get(image or base_image())
    except docker.errors.ImageNotFound:
        return f"image {image} is not built"
    except Exception as e:  # any failure means no usable engine
        return f"Docker engine not available: {e}"
    return None


def require_docker(image: str | None = None) -> None:
    """Fail (never skip) when Docker or `image` is missing: a test that needs Docker runs
    Docker, and a skip must not hide a missing feature."""
    image = image or base_image()
    reason = docker_ready(image)
    if reason:
        pytest.fail(
            f"the E2B test server needs a Docker engine and the image {image}: {reason} "
            "(start dockerd and build the base image first, see README.md)",
            pytrace=False,
        )


@contextlib.contextmanager
def session_server() -> Iterator[E2BTestServer]:
    """A running E2B test server whose templates "base" and "orchestrator-test" both map to
    `base_image()` until a test maps them elsewhere; shut down (its images removed) on exit."""
    require_docker()
    base = base_image()
    with E2BTestServer(templates={"base": base, TEST_TEMPLATE: base}) as server:
        yield server


@pytest.fixture(scope="session")
def e2b_test_server() -> Iterator[E2BTestServer]:
    """One E2B test server for the session (see `session_server`)."""
    with session_server() as server:
        yield server


@pytest.fixture
def fake_e2b(
    e2b_test_server: E2BTestServer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[E2BTestServer]:
    """The session server, freshly reset, with the SDK's environment pointing at it.

    After the test, sandboxes it left alive are killed, templates it built are forgotten
    (their images removed) and its configuration changes (templates, base images, caps,
    default user, network, delays) are undone.
    """
    server = e2b_test_server
    saved = (
        dict(server.templates),
        dict(server.base_images),
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
        server.reset_templates()
        (
            server.templates,
            server.base_images,
            server.max_concurrent,
            server.default_user,
            server.container_network,
            server.container_options,
        ) = saved
        server.reset()
