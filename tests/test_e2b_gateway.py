"""The model gateway on E2B (issue 22): fail closed, endpoints checked before anything starts,
and the gateway in an E2B sandbox of its own.

Through the real `e2b` SDK against the local E2B test server (`tests/e2b_server`), whose edge
routes `<port>-<sandbox id>.<domain>` to that port of the sandbox's container as E2B's does;
the model is the scripted server on this host, which the test server's sandboxes reach on the
Docker bridge (so these tests set ORCHESTRATOR_E2B_ALLOW_LOCAL_ENDPOINTS=1, as a local
E2B-compatible server needs).
"""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator import ConfigError, RunSpec, run
from orchestrator.backends import backend_class
from orchestrator.policy import unreachable_from_elsewhere
from orchestrator.runner import prepare

from . import test_e2b_backend as e2b_tests
from .conftest import TEST_PAYLOADS, cli
from .e2b_server import E2BTestServer

e2b_test_server = e2b_tests.e2b_test_server
e2b_env = e2b_tests.e2b_env

PROBE = TEST_PAYLOADS / "gateway_probe"
ALLOW_LOCAL = "ORCHESTRATOR_E2B_ALLOW_LOCAL_ENDPOINTS"


# ---- fail closed: a backend without a gateway refuses a hosted model ------------------------


def test_a_backend_without_a_gateway_refuses_a_hosted_model_before_anything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rule reads the backend's declared capabilities, not its name: the plugin backend
    `mirror` (Docker's sandboxes) declared without a gateway refuses an `openai` run before
    a backend is even made; --no-gateway opts out by name."""
    from dataclasses import replace

    mirror = backend_class("mirror")
    monkeypatch.setattr(mirror, "capabilities", replace(mirror.capabilities, model_gateway="none"))

    def made(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("a backend was made for a refused run")

    monkeypatch.setattr(mirror, "create_backend", classmethod(made))
    monkeypatch.setenv("OPENAI_API_KEY", "sk-gwtest-closed")
    spec = RunSpec(payload=PROBE, model="openai:gpt-4o-mini", backend="mirror")
    with pytest.raises(ConfigError) as refused:
        run(spec)
    assert refused.value.exit_code == 2 and refused.value.field == "model"
    assert "mirror backend cannot give the run a model gateway" in refused.value.cause
    assert "--no-gateway" in refused.value.fix
    opted_out = prepare(RunSpec(payload=PROBE, model="openai:gpt-4o-mini", backend="mirror",
                                gateway=False))  # fmt: skip
    assert opted_out.gateway is None and "--no-gateway" in str(opted_out.gateway_off)


# ---- endpoints E2B cannot reach: exit 2 before any template is built --------------------------


def test_which_endpoints_a_sandbox_elsewhere_cannot_reach() -> None:
    local = ("127.0.0.1", "localhost", "172.17.0.1", "10.1.2.3", "192.168.1.9", "[::1]",
             "169.254.169.254", "gpu.local", "llm.internal", "host.docker.internal")  # fmt: skip
    for name in local:
        assert unreachable_from_elsewhere(name), name
    for name in ("api.openai.com", "1.1.1.1", "router.huggingface.co", "8.8.8.8"):
        assert unreachable_from_elsewhere(name) is None, name


def test_an_endpoint_e2b_cannot_reach_is_exit_2_before_any_template(
    e2b_env: E2BTestServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-gwtest-endpoint")
    monkeypatch.delenv(ALLOW_LOCAL, raising=False)
    bridge = "http://172.17.0.1:9/v1"  # this host's Docker bridge: the example
    done = cli("run", str(PROBE), "--backend", "e2b", "--model", "openai:m", "--api-base",
               bridge, env={ALLOW_LOCAL: ""})  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "is this host" in done.stderr and f"{ALLOW_LOCAL}=1" in done.stderr
    for api_base in ("http://127.0.0.1:8080/v1", "http://10.1.2.3/v1", "http://gpu.local/v1"):
        with pytest.raises(ConfigError) as refused:
            prepare(RunSpec(payload=PROBE, model="openai:m", api_base=api_base, backend="e2b"))
        assert refused.value.exit_code == 2 and ALLOW_LOCAL in refused.value.fix, api_base
    assert e2b_env.requests == []  # no template looked up, no sandbox made
    # A public endpoint passes; on this host, only when the user says E2B reaches it.
    prepare(RunSpec(payload=PROBE, model="openai:m", api_base="https://llm.example.com/v1",
                    backend="e2b", gateway=False))  # fmt: skip
    monkeypatch.setenv(ALLOW_LOCAL, "1")
    local = prepare(RunSpec(payload=PROBE, model="openai:m", api_base=bridge, backend="e2b",
                            gateway=False))  # fmt: skip
    assert local.network.host_endpoints == () and "172.17.0.1" in local.network.hosts
