"""The conformance kit against the E2B backend, through the real `e2b` SDK and the local E2B
test server (its sandboxes are containers on this engine; its wire protocol is E2B's).
E2B declares no per-run memory limit and runs its sandboxes elsewhere (microVMs with a
kernel of their own), so the memory check and the shared-kernel checks are NOT APPLICABLE;
every other check must pass."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from orchestrator.testing.plugin import conformance_tests
from tests.e2b_server import E2BTestServer
from tests.e2b_server.fixtures import base_image

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module", autouse=True)
def e2b_environment(e2b_test_server: E2BTestServer) -> Iterator[E2BTestServer]:
    """For the whole module (the kit's runs, and the orchestrator process one check kills,
    read it): the SDK pointed at the test server, whose sandboxes reach this host."""
    server = e2b_test_server
    server.reset()
    wanted = {
        **server.env(),
        "ORCHESTRATOR_E2B_BASE_IMAGE": base_image(),
        "ORCHESTRATOR_E2B_ALLOW_LOCAL_ENDPOINTS": "1",
    }
    saved = {key: os.environ.get(key) for key in wanted}
    os.environ.update(wanted)
    yield server
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    left = server.alive_ids()
    for sandbox_id in left:
        server.kill(sandbox_id, reason="test teardown")
    assert not left, f"sandboxes left alive: {left}"


test_e2b = conformance_tests("e2b")
