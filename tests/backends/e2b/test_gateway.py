"""The model gateway on E2B: fail closed, endpoints checked before anything starts,
and the gateway in an E2B sandbox of its own.

Through the real `e2b` SDK against the local E2B test server (`tests/e2b_server`), whose edge
routes `<port>-<sandbox id>.<domain>` to that port of the sandbox's container as E2B's does;
the model is the scripted server on this host, which the test server's sandboxes reach on the
Docker bridge (so these tests set ORCHESTRATOR_E2B_ALLOW_LOCAL_ENDPOINTS=1, as a local
E2B-compatible server needs).
"""

from __future__ import annotations

import json
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from orchestrator import ConfigError, RunSpec, run
from orchestrator.backends import backend_class
from orchestrator.backends.e2b.gateway import GATEWAY_PORT, KIND_GATEWAY
from orchestrator.labels import LABEL_KIND, LABEL_RUN_ID
from orchestrator.lifecycle.runner import prepare
from orchestrator.policy import unreachable_from_elsewhere
from tests.backends.e2b import test_backend as e2b_tests
from tests.conftest import PAYLOADS, TEST_PAYLOADS, cli, events_of, start_cli, wait_for
from tests.e2b_server import E2BTestServer
from tests.model_server import ScriptedModelServer, docker_bridge_address
from tests.test_gateway import code, gateway_events

e2b_env = e2b_tests.e2b_env

PROBE = TEST_PAYLOADS / "gateway_probe"
LIAR = TEST_PAYLOADS / "gateway_liar"
RESEARCH = PAYLOADS / "research_team"
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
    opted_out = prepare(
        RunSpec(payload=PROBE, model="openai:gpt-4o-mini", backend="mirror", gateway=False)
    )
    assert opted_out.gateway is None and "--no-gateway" in str(opted_out.gateway_off)


# ---- endpoints E2B cannot reach: exit 2 before any template is built --------------------------


def test_which_endpoints_a_sandbox_elsewhere_cannot_reach() -> None:
    local = (
        "127.0.0.1",
        "localhost",
        "172.17.0.1",
        "10.1.2.3",
        "192.168.1.9",
        "[::1]",
        "169.254.169.254",
        "gpu.local",
        "llm.internal",
        "host.docker.internal",
    )
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
    done = cli(
        "run",
        str(PROBE),
        "--backend",
        "e2b",
        "--model",
        "openai:m",
        "--api-base",
        bridge,
        env={ALLOW_LOCAL: ""},
    )
    assert done.returncode == 2, done.stderr
    assert "is this host" in done.stderr and f"{ALLOW_LOCAL}=1" in done.stderr
    for api_base in ("http://127.0.0.1:8080/v1", "http://10.1.2.3/v1", "http://gpu.local/v1"):
        with pytest.raises(ConfigError) as refused:
            prepare(RunSpec(payload=PROBE, model="openai:m", api_base=api_base, backend="e2b"))
        assert refused.value.exit_code == 2 and ALLOW_LOCAL in refused.value.fix, api_base
    assert e2b_env.requests == []  # no template looked up, no sandbox made
    # A public endpoint passes; on this host, only when the user says E2B reaches it.
    public = prepare(
        RunSpec(
            payload=PROBE, model="openai:m", backend="e2b", api_base="https://llm.example.com/v1"
        )
    )
    assert public.gateway is not None and public.gateway.upstream == "https://llm.example.com/v1"
    monkeypatch.setenv(ALLOW_LOCAL, "1")
    local = prepare(
        RunSpec(payload=PROBE, model="openai:m", api_base=bridge, backend="e2b", gateway=False)
    )
    assert local.network.host_endpoints == () and "172.17.0.1" in local.network.hosts


# ---- the gateway in an E2B sandbox of its own --------------------------------------------------


@pytest.fixture
def e2b_model(e2b_env: E2BTestServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The E2B test server with the scripted model server on this host allowed (its sandboxes
    reach it on the Docker bridge), and the model's key; yields the key."""
    monkeypatch.setenv(ALLOW_LOCAL, "1")
    key = f"sk-gwtest-{secrets.token_hex(16)}"
    monkeypatch.setenv("OPENAI_API_KEY", key)
    yield key


def api_base(server: ScriptedModelServer) -> str:
    """The model server as the test server's sandboxes reach it."""
    return server.api_base(docker_bridge_address())


def test_the_model_key_is_nowhere_in_the_e2b_sandbox(
    e2b_model: str, e2b_env: E2BTestServer
) -> None:
    """Acceptance 1: the probe reads every process's environment and command line, /tmp (the
    run's working directory), /work and its own memory; with the gateway it finds no key, with
    --no-gateway (the control) it does. The model server got the real key."""
    key = e2b_model
    look = code("result = look_for_key()\nfinal_answer(result)")
    with ScriptedModelServer([look, look]) as server:
        result = run(
            RunSpec(
                payload=PROBE, model="openai:scripted", api_base=api_base(server), backend="e2b"
            )
        )
        creates = list(e2b_env.create_requests)
        commands = list(e2b_env.commands)
        control = run(
            RunSpec(
                payload=PROBE,
                model="openai:scripted",
                api_base=api_base(server),
                backend="e2b",
                gateway=False,
            )
        )
        headers = [r["headers"] for r in server.requests]
    assert result.status == "succeeded", result.error
    tail = key[len("sk-gwtest-") :][:32][::-1]  # as the probe reports what it saw
    report = json.loads(result.answer)
    assert report["read"]["proc"] >= 2 and report["read"]["files"] >= 1, report
    assert "memory" in report["found"], report  # it did look (its own marker is there)
    assert not [place for place, tails in report["found"].items() if tail in tails], report
    assert headers[0]["Authorization"] == f"Bearer {key}"  # the real key, from the gateway
    assert result.gateway["enabled"] is True and result.gateway["calls"] == 1
    assert result.token_usage_source == "gateway"
    # Two sandboxes: the gateway's first, then the run's, which may reach the gateway only.
    gateway_body, sandbox_body = creates
    assert gateway_body["metadata"][LABEL_KIND] == KIND_GATEWAY
    assert gateway_body["metadata"][LABEL_RUN_ID] == result.run_id
    assert gateway_body["network"]["allowOut"] == [docker_bridge_address()]
    gateway_id = next(
        c.sandbox_id for c in commands if "orchestrator_runtime.gateway" in c.cmd + " ".join(c.args)
    )
    gateway_host = f"{GATEWAY_PORT}-{gateway_id}.{e2b_env.domain}"
    assert sandbox_body["network"] == {"denyOut": ["0.0.0.0/0"], "allowOut": [gateway_host]}
    assert not gateway_body.get("envVars") and not sandbox_body.get("envVars")
    assert key not in json.dumps(creates) and key not in json.dumps([c.envs for c in commands])
    # The control: the same probe finds the key when it is put into the sandbox.
    assert control.status == "succeeded", control.error
    found = json.loads(control.answer)["found"]
    leaks = {place for place, tails in found.items() if tail in tails}
    assert {"memory", "os.environ"} <= leaks, found
    assert "--no-gateway" in control.gateway["reason"]
    assert e2b_env.alive_count() == 0


def test_e2b_tokens_are_measured_by_the_gateway_and_a_budget_stops_the_run(
    e2b_model: str, e2b_env: E2BTestServer
) -> None:
    """Acceptance 2: measured tokens equal the server's own counts (and a sandbox that lies
    is flagged); `--max-model-calls 2` ends the run `budget_exceeded`, the server having seen
    exactly 2 calls."""
    from tests.backends.docker.test_egress import research_outputs

    with ScriptedModelServer(research_outputs()) as server:
        plain = run(
            RunSpec(
                payload=RESEARCH, model="openai:scripted", api_base=api_base(server), backend="e2b"
            )
        )
        served = dict(server.usage)
    assert plain.status == "succeeded", plain.error
    assert plain.token_usage_source == "gateway"
    assert plain.token_usage == {**served, "total_tokens": sum(served.values())}
    assert plain.token_usage_reported == served and plain.token_usage_mismatch is False
    calls = gateway_events(plain, "model_call")
    assert len(calls) == 4 and all(c["status"] == 200 and c["latency_ms"] > 0 for c in calls)

    with ScriptedModelServer([code("final_answer('done')")]) as server:
        lied = run(
            RunSpec(payload=LIAR, model="openai:scripted", api_base=api_base(server), backend="e2b")
        )
        served = dict(server.usage)
    assert lied.status == "succeeded", lied.error
    assert lied.token_usage == {**served, "total_tokens": sum(served.values())}
    assert lied.token_usage_reported == {"input_tokens": 1, "output_tokens": 1}
    assert lied.token_usage_mismatch is True

    steps = [code(f"print('step {i}')") for i in range(4)] + [code("final_answer('done')")]
    with ScriptedModelServer(steps) as server:
        done = cli(
            "run",
            str(PROBE),
            "--backend",
            "e2b",
            "--model",
            "openai:scripted",
            "--api-base",
            api_base(server),
            "--max-model-calls",
            "2",
            "--json",
        )
        seen = len(server.requests)
    assert done.returncode == 1, done.stderr
    result = json.loads(done.stdout)
    assert result["status"] == "failed" and result["error"]["type"] == "budget_exceeded"
    assert "max_model_calls = 2" in result["error"]["message"]
    assert seen == 2 and result["gateway"]["calls"] == 2
    assert e2b_env.alive_count() == 0


def test_two_concurrent_e2b_runs_cannot_use_each_others_tokens(
    e2b_model: str, e2b_env: E2BTestServer
) -> None:
    """Acceptance 2: each run's token is refused (401) by the other run's gateway, reached
    as the sandboxes reach it (the edge, by the gateway's host name); its own is forwarded.
    Each run is kept going by its model holding the second answer until the tokens were
    tried."""
    script = [code("print(show_gateway())"), code("final_answer('done')")]
    seen: dict[str, str] = {}
    results: dict[str, Any] = {}

    def one(name: str, server: ScriptedModelServer) -> None:
        def on_event(event: dict[str, Any]) -> None:
            text = json.dumps(event)
            if "GATEWAY http" in text and name not in seen:
                seen[name] = text[text.index("GATEWAY http") :].split("\\n")[0]

        spec = RunSpec(
            payload=PROBE, model="openai:scripted", api_base=api_base(server), backend="e2b"
        )
        results[name] = run(spec, on_event=on_event)

    def status(url: str, token: str) -> int:
        parts = httpx.URL(url)
        edge = f"http://127.0.0.1:{e2b_env.port}{parts.path}/models"
        answer = httpx.get(
            edge, headers={"Host": parts.host, "Authorization": f"Bearer {token}"}, timeout=30
        )
        return answer.status_code

    with ScriptedModelServer(script) as server_a, ScriptedModelServer(script) as server_b:
        releases = [server_a.hold_after(1), server_b.hold_after(1)]
        threads = [
            threading.Thread(target=one, args=("a", server_a)),
            threading.Thread(target=one, args=("b", server_b)),
        ]
        for thread in threads:
            thread.start()
        try:
            wait_for(lambda: len(seen) == 2, timeout=300)
            runs = {}
            for name, line in seen.items():
                _, url, reversed_token = line.split()[:3]
                runs[name] = (url, reversed_token.strip('"\\')[::-1])
            (url_a, token_a), (url_b, token_b) = runs["a"], runs["b"]
            assert token_a != token_b and url_a != url_b
            assert url_a.startswith(f"http://{GATEWAY_PORT}-") and e2b_env.domain in url_a
            assert status(url_a, token_b) == 401 and status(url_b, token_a) == 401
            assert status(url_a, token_a) == 404  # forwarded: the scripted server has no /models
        finally:
            for release in releases:
                release.set()
            for thread in threads:
                thread.join(timeout=300)
    for name in ("a", "b"):
        assert results[name].status == "succeeded", results[name].error
        refused = gateway_events(results[name], "model_call_refused")
        assert [e["reason"] for e in refused] == ["bad_token"]
    assert status(url_a, token_a) == 502  # the run has ended: its gateway's sandbox is gone
    assert e2b_env.alive_count() == 0


def test_killing_the_gateway_sandbox_ends_the_run_infra_error_within_5_s(
    e2b_model: str, e2b_env: E2BTestServer
) -> None:
    hold = code("hold(seconds=60)\nfinal_answer('done')")
    box: dict[str, Any] = {}
    with ScriptedModelServer([hold]) as server:
        spec = RunSpec(
            payload=PROBE, model="openai:scripted", api_base=api_base(server), backend="e2b"
        )
        worker = threading.Thread(target=lambda: box.setdefault("result", run(spec)))
        worker.start()
        try:
            wait_for(lambda: len(server.requests) == 1, timeout=300)
            (gateway_id,) = [
                i
                for i in e2b_env.alive_ids()
                if e2b_env.sandbox(i).metadata.get(LABEL_KIND) == KIND_GATEWAY
            ]
            killed = time.monotonic()
            e2b_env.kill_sandbox(gateway_id)
            worker.join(timeout=30)
            ended = time.monotonic() - killed
        finally:
            worker.join(timeout=120)
    result = box["result"]
    assert result.status == "infra_error", result.error
    assert result.error.type == "network_lost" and "gateway" in result.error.message
    assert ended < 5, ended
    assert [e for e in events_of(result) if e["type"] == "network_lost"]
    assert e2b_env.alive_count() == 0


def test_cleanup_removes_the_gateway_sandbox_a_killed_orchestrator_left(
    e2b_model: str, e2b_env: E2BTestServer
) -> None:
    """Both sandboxes of a run carry its labels: after a SIGKILLed orchestrator, `cleanup
    --backend e2b` removes the gateway's sandbox with the run's (E2B's lifetime would too)."""
    with ScriptedModelServer([code("hold(seconds=60)\nfinal_answer('done')")]) as server:
        process = start_cli(
            "run",
            str(PROBE),
            "--backend",
            "e2b",
            "--model",
            "openai:scripted",
            "--api-base",
            api_base(server),
            "--quiet",
        )
        try:
            wait_for(lambda: len(server.requests) == 1, timeout=300)
            alive = e2b_env.alive_ids()
            kinds = sorted(e2b_env.sandbox(i).metadata.get(LABEL_KIND) for i in alive)
            assert kinds == [KIND_GATEWAY, "sandbox"], kinds
        finally:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=30)
    assert sorted(e2b_env.alive_ids()) == sorted(alive)  # nobody left to kill them
    out = cli("cleanup", "--backend", "e2b")
    assert out.returncode == 0, out.stderr
    assert e2b_env.alive_count() == 0
    assert {e2b_env.sandbox(i).killed_reason for i in alive} == {"api"}
