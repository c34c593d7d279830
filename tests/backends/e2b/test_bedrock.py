"""Amazon Bedrock on E2B: the same program as tests/models/test_bedrock.py's, its gateway an E2B
sandbox of its own (reached through E2B's per-port host name), given the host's AWS
credentials on its stdin only; the project's E2B test server, through the real `e2b` SDK."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.backends.e2b.test_backend import e2b_env  # noqa: F401 - fixture
from tests.backends.e2b.test_gateway import ALLOW_LOCAL
from tests.e2b_server import E2BTestServer
from tests.model_server import docker_bridge_address
from tests.models.test_bedrock import run_bedrock_program

pytestmark = pytest.mark.docker


def test_a_bedrock_program_runs_through_the_gateway_on_e2b(
    tmp_path: Path,
    e2b_env: E2BTestServer,  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ALLOW_LOCAL, "1")  # Bedrock's stand-in is a server on this host
    run_bedrock_program(tmp_path, "--backend", "e2b", host_address=docker_bridge_address())
    assert len(e2b_env.create_requests) == 2  # the gateway's sandbox and the run's
    assert e2b_env.alive_count() == 0
