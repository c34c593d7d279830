"""The per-run model gateway: model keys never enter the sandbox; the host measures
every model call and keeps the run's budget.

The gateway's own rules are tested on this host against its real process (uvicorn, httpx) and
the scripted model server; the rest against the real engine, with payloads that look for the
key everywhere a sandbox can read, lie about their usage, stream, and hold their run open
while a probe container on their network tries the other run's token.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchestrator import RunSpec, Store, run
from orchestrator.backends.docker.gateway import KIND_GATEWAY
from orchestrator.backends.docker.seccomp import security_options
from orchestrator.labels import LABEL_KIND, LABEL_RUN_ID
from orchestrator_runtime.gateway.usage import UsageReader

from .conftest import (
    PAYLOADS,
    REPO,
    TEST_PAYLOADS,
    cli,
    events_of,
    wait_for,
)
from .model_server import ScriptedModelServer

PROBE = TEST_PAYLOADS / "gateway_probe"
LIAR = TEST_PAYLOADS / "gateway_liar"
STREAM = TEST_PAYLOADS / "gateway_stream"
RESEARCH = PAYLOADS / "research_team"


def code(body: str, thought: str = "I will do it.") -> str:
    """One CodeAgent step as a model writes it."""
    return f"Thought: {thought}\n<code>\n{body}\n</code>"


@pytest.fixture
def model_key(monkeypatch: pytest.MonkeyPatch) -> str:
    """A real-looking key the scripted server expects; every test key starts `sk-gwtest-`
    (the probe payload looks for that marker)."""
    key = f"sk-gwtest-{secrets.token_hex(16)}"
    monkeypatch.setenv("OPENAI_API_KEY", key)
    return key


def gateway_events(result: Any, kind: str) -> list[dict[str, Any]]:
    return [e for e in events_of(result) if e["type"] == kind and e.get("source") == "gateway"]


# ---- the usage reader: what a response says it cost ------------------------------------------


def test_usage_is_read_from_json_and_from_streams_split_anywhere() -> None:
    body = json.dumps({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3}})
    reader = UsageReader("application/json")
    for i in range(0, len(body), 5):
        reader.feed(body[i : i + 5].encode())
    reader.close()
    assert (reader.input_tokens, reader.output_tokens, reader.streamed) == (12, 3, False)

    events = [
        {"choices": [{"delta": {"content": "hi"}}]},
        {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 7}},
    ]
    stream = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    reader = UsageReader("text/event-stream; charset=utf-8")
    for i in range(0, len(stream), 3):
        reader.feed(stream[i : i + 3].encode())
    reader.close()
    assert (reader.input_tokens, reader.output_tokens, reader.streamed) == (40, 7, True)

    # Anthropic's shape: input in message_start, output (so far) in each message_delta.
    anthropic = [
        {"type": "message_start", "message": {"usage": {"input_tokens": 25, "output_tokens": 1}}},
        {"type": "message_delta", "usage": {"output_tokens": 9}},
        {"type": "message_delta", "usage": {"output_tokens": 15}},
    ]
    reader = UsageReader("text/event-stream")
    reader.feed("".join(f"event: x\ndata: {json.dumps(e)}\n\n" for e in anthropic).encode())
    reader.close()
    assert (reader.input_tokens, reader.output_tokens) == (25, 15)

    silent = UsageReader("application/json")
    silent.feed(b'{"usage": {"prompt_tokens": "many"}}')
    silent.close()
    assert (silent.input_tokens, silent.output_tokens) == (None, None)


# ---- the gateway process on this host: its rules, one by one ----------------------------------


class LocalGateway:
    """The real gateway process (`python -m orchestrator_runtime.gateway`) on a free port."""

    def __init__(
        self,
        upstream: str,
        *,
        max_calls: int = 100,
        max_tokens: int = 10**6,
        clients: tuple[str, ...] = ("127.0.0.0/8",),
        key: str = "sk-real",
    ) -> None:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.token = secrets.token_urlsafe(32)
        self.events: list[dict[str, Any]] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator_runtime.gateway"],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        config = {
            "token": self.token,
            "key": key,
            "upstream": upstream,
            "port": self.port,
            "clients": list(clients),
            "max_calls": max_calls,
            "max_tokens": max_tokens,
        }
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(config) + "\n")
        self.proc.stdin.flush()
        assert json.loads(self.proc.stdout.readline())["type"] == "gateway_ready"
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.base = f"http://127.0.0.1:{self.port}/v1"

    def _read(self) -> None:
        assert self.proc.stdout
        for line in self.proc.stdout:
            self.events.append(json.loads(line))

    def post(self, token: str | None, path: str = "/chat/completions", **body: Any):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
        return httpx.post(self.base + path, json=payload, headers=headers, timeout=30)

    def stop(self) -> int:
        assert self.proc.stdin
        self.proc.stdin.write("stop\n")
        self.proc.stdin.flush()
        code = self.proc.wait(timeout=10)
        self.reader.join(timeout=5)
        return code


def test_the_gateway_swaps_the_token_for_the_key_and_refuses_everything_else() -> None:
    with ScriptedModelServer(["one", "two"]) as server:
        gateway = LocalGateway(server.api_base(), key="sk-the-real-key")
        try:
            assert gateway.post(None).status_code == 401
            assert gateway.post("not-the-token").status_code == 401
            assert gateway.post(gateway.token[:-1] + "x").status_code == 401
            assert gateway.post(gateway.token, path="/../../admin").status_code == 404
            ok = gateway.post(gateway.token)
            assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "one"
            # x-api-key carries it as well (Anthropic-style clients), swapped the same way.
            other = httpx.post(
                gateway.base + "/chat/completions",
                json={"messages": []},
                headers={"x-api-key": gateway.token},
                timeout=30,
            )
            assert other.status_code == 200
        finally:
            assert gateway.stop() == 0
        # Nothing refused reached the server; what did carries the key, never the token.
        assert len(server.requests) == 2
        assert server.requests[0]["headers"]["Authorization"] == "Bearer sk-the-real-key"
        assert server.requests[1]["headers"]["X-Api-Key"] == "sk-the-real-key"
        assert all(gateway.token not in json.dumps(r) for r in server.requests)
    kinds = [e["type"] for e in gateway.events]
    assert kinds.count("model_call_refused") == 4 and kinds.count("model_call") == 2
    assert kinds[-1] == "gateway_closed" and gateway.events[-1]["calls"] == 2


def test_only_model_calls_under_the_endpoints_path_are_forwarded() -> None:
    """The key is for the model: not the provider's files, fine-tunes or billing, and no path
    may climb out of the endpoint's base path (dot segments, encoded or not)."""
    import http.client

    with ScriptedModelServer(["one"]) as server:
        gateway = LocalGateway(server.api_base())
        statuses = {}
        try:
            for method, target in (
                ("GET", "/v1/files"),
                ("DELETE", "/v1/files/file-1"),
                ("POST", "/v1/fine_tuning/jobs"),
                ("POST", "/v1/%2e%2e/dashboard/billing"),
                ("POST", "/v1/chat/../files"),
                ("POST", "http://evil.example/v1/chat/completions"),
                ("GET", "/v1/models"),
            ):
                conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=10)
                conn.request(
                    method, target, body=b"{}", headers={"Authorization": f"Bearer {gateway.token}"}
                )
                statuses[(method, target)] = conn.getresponse().status
                conn.close()
        finally:
            gateway.stop()
        forwarded = [(r["method"], r["path"]) for r in server.requests]
    assert forwarded == [("GET", "/v1/models")], forwarded  # the one model-list call
    assert statuses[("GET", "/v1/files")] == 403
    assert statuses[("DELETE", "/v1/files/file-1")] == 403
    assert statuses[("POST", "/v1/fine_tuning/jobs")] == 403
    assert statuses[("POST", "/v1/%2e%2e/dashboard/billing")] == 404
    assert statuses[("POST", "/v1/chat/../files")] == 404
    assert statuses[("POST", "http://evil.example/v1/chat/completions")] in (400, 404)
    reasons = {e["reason"] for e in gateway.events if e["type"] == "model_call_refused"}
    assert reasons == {"not_a_model_call", "outside_upstream"}


def test_a_client_outside_the_runs_network_is_refused() -> None:
    with ScriptedModelServer(["one"]) as server:
        gateway = LocalGateway(server.api_base(), clients=("10.99.0.0/16",))
        try:
            refused = gateway.post(gateway.token)
        finally:
            gateway.stop()
        assert refused.status_code == 403 and server.requests == []


def test_budget_of_calls_and_of_tokens_and_the_end_of_the_run() -> None:
    with ScriptedModelServer(["a", "b", "c", "d"]) as server:
        gateway = LocalGateway(server.api_base(), max_calls=2)
        try:
            assert [gateway.post(gateway.token).status_code for _ in range(3)] == [200, 200, 429]
            assert gateway.post(gateway.token).json()["error"]["type"] == "budget_exceeded"
        finally:
            gateway.stop()
        assert len(server.requests) == 2
    spent = [e for e in gateway.events if e["type"] == "budget_exceeded"]
    assert len(spent) == 1 and spent[0]["limit"] == "max_model_calls" and spent[0]["value"] == 2

    with ScriptedModelServer(["a", "b", "c"]) as server:
        gateway = LocalGateway(server.api_base(), max_tokens=5)  # the first call spends more
        try:
            assert [gateway.post(gateway.token).status_code for _ in range(2)] == [200, 429]
            gateway.proc.stdin.write("stop\n")  # type: ignore[union-attr]
            gateway.proc.stdin.flush()  # type: ignore[union-attr]
            wait_for(lambda: any(e["type"] == "gateway_closed" for e in gateway.events), 10)
            late = gateway.post(gateway.token)  # the run has ended: its token is dead
            assert late.status_code in (401, 503) or late.is_error
        except httpx.HTTPError:
            pass  # the gateway is already gone: refused as well
        finally:
            gateway.proc.wait(timeout=10)
        assert len(server.requests) == 1


def test_streamed_answers_pass_through_unbuffered_and_are_counted() -> None:
    text = "x" * 200  # five events of 40 characters, then the usage event
    with ScriptedModelServer([text]) as server:
        server.stream_delay = 0.3
        gateway = LocalGateway(server.api_base())
        try:
            arrivals = []
            started = time.monotonic()
            body = {
                "stream": True,
                "stream_options": {"include_usage": True},
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
            }
            headers = {"Authorization": f"Bearer {gateway.token}"}
            with httpx.stream(
                "POST", gateway.base + "/chat/completions", json=body, headers=headers, timeout=30
            ) as response:
                assert response.headers["content-type"].startswith("text/event-stream")
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.monotonic() - started)
        finally:
            gateway.stop()
    assert len(arrivals) == 6
    # The first event arrived while the server was still sending the rest.
    assert arrivals[0] < arrivals[-1] - 1.0, arrivals
    call = next(e for e in gateway.events if e["type"] == "model_call")
    assert call["streamed"] is True
    assert (call["input_tokens"], call["output_tokens"]) == (
        server.usage["input_tokens"],
        server.usage["output_tokens"],
    )


# ---- against the real engine ------------------------------------------------------------------


@pytest.mark.docker
def test_the_model_key_is_nowhere_in_the_sandbox(
    agent_image: str, model_key: str, nothing_left: None
) -> None:
    """Acceptance 1. The probe reads every process's environment and command line, every file
    under /tmp and /work and its own memory (where the runtime's request is); with the
    gateway it finds no key, without it (the control) it does."""
    look = code("result = look_for_key()\nfinal_answer(result)")
    with ScriptedModelServer([look, look]) as server:
        result = run(RunSpec(payload=PROBE, model="openai:scripted", api_base=server.api_base()))
        control = run(
            RunSpec(
                payload=PROBE, model="openai:scripted", api_base=server.api_base(), gateway=False
            )
        )
        headers = [r["headers"] for r in server.requests]
    assert result.status == "succeeded", result.error
    tail = model_key[len("sk-gwtest-") :][:32][::-1]  # as the probe reports what it saw
    report = json.loads(result.answer)
    assert report["read"]["proc"] >= 2 and report["read"]["files"] >= 1, report
    assert "memory" in report["found"], report  # it did look (its own marker is there)
    assert not [place for place, tails in report["found"].items() if tail in tails], report
    # The server got the real key from the gateway, never the token.
    assert headers[0]["Authorization"] == f"Bearer {model_key}"
    assert result.gateway["enabled"] is True and result.gateway["calls"] == 1
    # The control: the same probe finds the key when it is put into the sandbox.
    assert control.status == "succeeded", control.error
    found = json.loads(control.answer)["found"]
    leaks = {place for place, tails in found.items() if tail in tails}
    assert {"memory", "os.environ"} <= leaks, found
    assert control.gateway == {"enabled": False, "reason": control.gateway["reason"]}
    assert "--no-gateway" in control.gateway["reason"]


@pytest.mark.docker
def test_host_measured_tokens_match_the_servers_own_counts(
    agent_image: str, model_key: str, nothing_left: None
) -> None:
    """Acceptance 2: plain and streamed responses, and a sandbox that under-reports."""
    from tests.backends.docker.test_egress import research_outputs

    with ScriptedModelServer(research_outputs()) as server:
        plain = run(RunSpec(payload=RESEARCH, model="openai:scripted", api_base=server.api_base()))
        served = dict(server.usage)
    assert plain.status == "succeeded", plain.error
    assert plain.token_usage_source == "gateway"
    assert plain.token_usage == {**served, "total_tokens": sum(served.values())}
    assert plain.token_usage_reported == served and plain.token_usage_mismatch is False
    calls = gateway_events(plain, "model_call")
    assert len(calls) == 4 and all(c["status"] == 200 and c["latency_ms"] > 0 for c in calls)
    saved = json.loads((Path(plain.record_dir) / "result.json").read_text())
    assert saved["token_usage_source"] == "gateway" and saved["token_usage"] == plain.token_usage
    row = Store().get_run(plain.run_id)
    assert (row["input_tokens"], row["output_tokens"]) == (
        served["input_tokens"],
        served["output_tokens"],
    )

    delegate = code('answer = helper(task="What is 6 times 7?")\nfinal_answer(answer)')
    helper = code("final_answer(42)")
    with ScriptedModelServer([delegate, helper]) as server:
        streamed = run(RunSpec(payload=STREAM, model="openai:scripted", api_base=server.api_base()))
        served = dict(server.usage)
        asked = [r["body"] for r in server.requests]
    assert streamed.status == "succeeded", streamed.error
    assert all(body.get("stream") for body in asked)
    calls = gateway_events(streamed, "model_call")
    assert len(calls) == 2 and all(c["streamed"] for c in calls)
    assert streamed.token_usage == {**served, "total_tokens": sum(served.values())}
    assert streamed.token_usage_mismatch is False

    with ScriptedModelServer([code("final_answer('done')")]) as server:
        lied = run(RunSpec(payload=LIAR, model="openai:scripted", api_base=server.api_base()))
        served = dict(server.usage)
    assert lied.status == "succeeded", lied.error
    assert lied.token_usage == {**served, "total_tokens": sum(served.values())}
    assert lied.token_usage_reported == {"input_tokens": 1, "output_tokens": 1}
    assert lied.token_usage_mismatch is True
    flagged = [e for e in events_of(lied) if e["type"] == "token_usage_mismatch"]
    assert flagged and flagged[0]["reported"] == {"input_tokens": 1, "output_tokens": 1}


@pytest.mark.gvisor
@pytest.mark.docker
def test_budgets_of_calls_and_of_tokens_stop_the_run(
    agent_image: str, model_key: str, nothing_left: None
) -> None:
    """Acceptance 3, through the command line (flag, exit code, record); then the token
    budget, the gateway's other limit, through the API."""
    steps = [code(f"print('step {i}')") for i in range(4)] + [code("final_answer('done')")]
    with ScriptedModelServer(steps) as server:
        done = cli(
            "run",
            str(PROBE),
            "--model",
            "openai:scripted",
            "--api-base",
            server.api_base(),
            "--max-model-calls",
            "2",
            "--json",
        )
        calls = len(server.requests)
    assert done.returncode == 1, done.stderr
    result = json.loads(done.stdout)
    assert result["status"] == "failed"
    assert result["error"]["type"] == "budget_exceeded", result["error"]
    assert "max_model_calls = 2" in result["error"]["message"]
    assert calls == 2
    assert result["gateway"]["max_model_calls"] == 2 and result["gateway"]["calls"] == 2
    events = [json.loads(x) for x in (Path(result["record_dir"]) / "events.jsonl").open()]
    assert any(e["type"] == "budget_exceeded" and e["source"] == "gateway" for e in events)

    # The token budget: the call that crosses it completes, the next is refused.
    with ScriptedModelServer(steps) as server:
        spent = run(
            RunSpec(
                payload=PROBE, model="openai:scripted", api_base=server.api_base(), max_tokens=1
            )
        )
        calls = len(server.requests)
    assert spent.status == "failed" and spent.error, (spent.status, spent.error)
    assert spent.error.type == "budget_exceeded" and "max_tokens = 1" in spent.error.message
    assert calls == 1


def _gateway_of(docker_client, run_id: str) -> dict[str, Any] | None:
    found = docker_client.api.containers(
        filters={"label": [f"{LABEL_RUN_ID}={run_id}", f"{LABEL_KIND}={KIND_GATEWAY}"]}
    )
    return found[0] if found else None


def _try_token(agent_image: str, network: str, url: str, token: str, store_label: str) -> int:
    """The HTTP status a probe container on `network` gets from the gateway at `url`."""
    script = (
        "import urllib.request, urllib.error, sys\n"
        "req = urllib.request.Request(sys.argv[1] + '/models', "
        "headers={'Authorization': 'Bearer ' + sys.argv[2]})\n"
        "try:\n    print(urllib.request.urlopen(req, timeout=10).status)\n"
        "except urllib.error.HTTPError as e:\n    print(e.code)\n"
    )
    done = subprocess.run(
        [
            "docker",
            "run",
            "--rm",
            "--network",
            network,
            "--label",
            store_label,
            "--cap-drop",
            "ALL",
            "--entrypoint",
            "python",
            agent_image,
            "-c",
            script,
            url,
            token,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


@pytest.mark.docker
def test_each_runs_token_works_only_for_its_own_run(
    agent_image: str, docker_client, store_label: str, model_key: str, nothing_left: None
) -> None:
    """Acceptance 4: two concurrent runs; each token is refused by the other run's gateway,
    and once a run has ended its gateway (and with it the token) is gone. Each run is kept
    going by its model holding the second answer until the tokens were tried."""
    script = [code("print(show_gateway())"), code("final_answer('done')")]
    seen: dict[str, str] = {}
    results: dict[str, Any] = {}
    run_ids = {name: f"r-gwtoken-{name}-{secrets.token_hex(3)}" for name in ("a", "b")}

    def one(name: str, server: ScriptedModelServer) -> None:
        def on_event(event: dict[str, Any]) -> None:
            text = json.dumps(event)
            if "GATEWAY http" in text and name not in seen:
                seen[name] = text[text.index("GATEWAY http") :].split("\\n")[0]

        spec = RunSpec(
            payload=PROBE, model="openai:scripted", api_base=server.api_base(), run_id=run_ids[name]
        )
        results[name] = run(spec, on_event=on_event)

    with ScriptedModelServer(script) as server_a, ScriptedModelServer(script) as server_b:
        releases = [server_a.hold_after(1), server_b.hold_after(1)]
        threads = [
            threading.Thread(target=one, args=("a", server_a)),
            threading.Thread(target=one, args=("b", server_b)),
        ]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: len(seen) == 2, timeout=120)
            runs = {}
            for name, line in seen.items():
                _, url, reversed_token = line.split()[:3]
                token = reversed_token.strip('"\\')[::-1]
                runs[name] = (url, token, f"orchestrator-net-{run_ids[name]}")
            (url_a, token_a, net_a), (url_b, token_b, net_b) = runs["a"], runs["b"]
            assert token_a != token_b
            assert _try_token(agent_image, net_a, url_a, token_b, store_label) == 401
            assert _try_token(agent_image, net_b, url_b, token_a, store_label) == 401
            # Its own token is accepted (forwarded: the scripted server has no /models).
            assert _try_token(agent_image, net_a, url_a, token_a, store_label) == 404
        finally:
            for release in releases:
                release.set()
            for t in threads:
                t.join(timeout=120)
    for name in ("a", "b"):
        assert results[name].status == "succeeded", results[name].error
        assert _gateway_of(docker_client, results[name].run_id) is None
        refused = gateway_events(results[name], "model_call_refused")
        assert [e["reason"] for e in refused] == ["bad_token"]
    # After the end, the network the token was good on is gone too.
    assert not docker_client.api.networks(names=[runs["a"][2], runs["b"][2]])


@pytest.mark.gvisor
@pytest.mark.docker
def test_killing_the_gateway_ends_the_run_network_lost(
    agent_image: str, docker_client, model_key: str, nothing_left: None
) -> None:
    """Acceptance 5, and the gateway's hardening (as the egress proxy's) while it runs."""
    hold = code("hold(seconds=40)\nfinal_answer('done')")
    box: dict[str, Any] = {}
    run_id = f"r-gwkill-{secrets.token_hex(4)}"
    with ScriptedModelServer([hold]) as server:
        spec = RunSpec(
            payload=PROBE, model="openai:scripted", api_base=server.api_base(), run_id=run_id
        )
        worker = threading.Thread(target=lambda: box.setdefault("result", run(spec)))
        worker.start()
        try:
            wait_for(lambda: len(server.requests) == 1, timeout=120)
            gateway = _gateway_of(docker_client, run_id)
            assert gateway is not None
            info = docker_client.api.inspect_container(gateway["Id"])
            host = info["HostConfig"]
            assert host["CapDrop"] == ["ALL"] and host["ReadonlyRootfs"] is True
            assert host["SecurityOpt"] == security_options() and not host["Privileged"]
            assert host["Runtime"] == "runc"  # whatever runs the sandbox
            assert host["Memory"] > 0 and host["PidsLimit"] > 0 and host["NanoCpus"] > 0
            assert host["LogConfig"]["Type"] == "none" and not host.get("Binds")
            assert info["Config"]["User"] not in ("", "0", "root")
            assert model_key not in json.dumps(info)  # not in its env, command or labels
            killed = time.monotonic()
            docker_client.api.kill(gateway["Id"])
            worker.join(timeout=30)
            ended = time.monotonic() - killed
        finally:
            worker.join(timeout=60)
    result = box["result"]
    assert result.status == "infra_error", result.error
    assert result.error.type == "network_lost" and "gateway" in result.error.message
    assert ended < 5, ended


@pytest.mark.docker
@pytest.mark.parametrize("hosts", [(), ("example.com",)], ids=["sandbox", "squid"])
def test_a_gateway_that_cannot_start_leaves_nothing_of_the_run(
    agent_image: str,
    docker_client,
    model_key: str,
    nothing_left: None,
    monkeypatch,
    hosts: tuple[str, ...],
) -> None:
    """The gateway starts beside the sandbox (or beside squid): when its start fails, the
    run ends as an infra error and neither the sandbox nor the network nor squid is left."""
    from orchestrator.backends.docker.gateway import Gateway

    started = Gateway.start

    def fails(*args: Any, **kwargs: Any) -> Any:
        gateway = started(*args, **kwargs)  # a real container, removed again by the failure
        gateway.remove()
        raise RuntimeError("the gateway would not start (test)")

    monkeypatch.setattr(Gateway, "start", fails)
    run_id = f"r-gwfail-{secrets.token_hex(4)}"
    with ScriptedModelServer(["unused"]) as server:
        result = run(
            RunSpec(
                payload=PROBE,
                model="openai:scripted",
                api_base=server.api_base(),
                run_id=run_id,
                allow_hosts=hosts,
            )
        )
        assert server.requests == []
    assert result.status == "infra_error", result.error
    assert "would not start" in result.error.message
    mine = {"label": [f"{LABEL_RUN_ID}={run_id}"]}
    assert docker_client.api.containers(all=True, filters=mine) == []
    assert docker_client.api.networks(filters=mine) == []


# ---- the rules: who gets a gateway, and what the sandbox may then reach -----------------------


def test_which_runs_get_a_gateway_and_where_it_forwards() -> None:
    from orchestrator.backends import backend_capabilities
    from orchestrator.errors import ConfigError
    from orchestrator.gateway import HF_ROUTER, plan_gateway, sandbox_network
    from orchestrator.models import parse_model
    from orchestrator.policy import HOST_ALIAS, resolve_policy
    from orchestrator.spec import Limits, NetworkPolicy

    def plan(
        model: str,
        *,
        api_base: str | None = None,
        backend: str = "docker",
        network: str | None = None,
        enabled: bool = True,
        hosts: tuple[str, ...] = (),
    ) -> tuple[Any, str | None, Any]:
        spec = parse_model(model, api_base=api_base)
        policy = resolve_policy(network, model=spec, hosts=hosts)
        provision = backend_capabilities(backend).model_gateway  # as each backend declares
        gateway, why = plan_gateway(
            enabled=enabled,
            model=spec,
            network=policy,
            backend=backend,
            provision=provision,
            limits=Limits(max_model_calls=7),
        )
        return gateway, why, policy

    gateway, _, policy = plan("openai:gpt-4o-mini", hosts=("api.example.com",))
    assert gateway is not None and gateway.upstream == "https://api.openai.com/v1"
    assert gateway.max_calls == 7 and len(gateway.token) >= 40 and not gateway.on_this_host
    assert policy.hosts == ("api.openai.com", "api.example.com")
    # The sandbox keeps the payload's hosts; the model's host is the gateway's business.
    assert sandbox_network(policy, gateway, ("api.example.com",)).hosts == ("api.example.com",)
    local, _, _ = plan("openai:llama", api_base="http://127.0.0.1:8080/v1")
    assert local is not None and local.on_this_host
    assert local.upstream == f"http://{HOST_ALIAS}:8080/v1"
    hf, _, _ = plan("hf:Qwen/Qwen2.5-Coder-32B-Instruct")
    assert hf is not None and hf.upstream == HF_ROUTER
    assert hf.credential_env == "HF_TOKEN"
    two, _, _ = plan("openai:gpt-4o-mini")
    assert two is not None and two.token != gateway.token  # one token per run
    for model, kwargs, reason in (
        ("mock", {}, "mock model"),
        ("openai", {"enabled": False}, "--no-gateway"),
    ):
        none, why, _ = plan(model, **kwargs)
        assert none is None and reason in str(why), (model, kwargs, why)
    # Fail closed: a backend that declares no gateway refuses a hosted model,
    # whatever its name; --no-gateway is the way out, by name.
    with pytest.raises(ConfigError) as closed:
        plan_gateway(
            enabled=True,
            model=parse_model("openai"),
            network=resolve_policy(None, model=parse_model("openai"), hosts=()),
            backend="somewhere",
            provision="none",
            limits=Limits(),
        )
    assert "--no-gateway" in closed.value.fix and "somewhere" in closed.value.cause
    # A model that needs the network under `none` is refused up front (resolve_policy, issue
    # 27); plan_gateway still says why such a policy would get no gateway.
    with pytest.raises(ConfigError):
        plan("openai", network="none")
    offline, why = plan_gateway(
        enabled=True,
        model=parse_model("openai"),
        network=NetworkPolicy(mode="none"),
        backend="docker",
        provision=backend_capabilities("docker").model_gateway,
        limits=Limits(),
    )
    assert offline is None and "no network" in str(why)
    with pytest.raises(ConfigError) as refused:  # no endpoint at all (prepare asks LiteLLM)
        plan("litellm:anthropic/claude-3-haiku")
    assert "--api-base" in refused.value.fix
    unserved, why, _ = plan("litellm:anthropic/claude-3-haiku", enabled=False)
    assert unserved is None and "--no-gateway" in str(why)


@pytest.mark.docker
def test_hf_models_go_through_the_gateway_too(
    agent_image: str, monkeypatch: pytest.MonkeyPatch, nothing_left: None
) -> None:
    from tests.backends.docker.test_egress import research_outputs

    monkeypatch.setenv("HF_TOKEN", "hf_gwtest_token_123456")
    said: list[str] = []
    with ScriptedModelServer(research_outputs()) as server:
        model = "hf:Qwen/Qwen2.5-Coder-32B-Instruct"
        spec = RunSpec(payload=RESEARCH, model=model, api_base=server.api_base())
        result = run(spec, on_progress=said.append)
        requests = list(server.requests)
        served = dict(server.usage)
    assert result.status == "succeeded", result.error
    # The gateway's start is said as a sentence (before: a lone line
    # `orchestrator: model gateway` above `▶ run started`).
    (line,) = [m for m in said if "gateway" in m]
    assert line.startswith("starting the run's model gateway to ") and f":{server.port} " in line
    assert line.endswith(
        "(the model key stays with it, outside the sandbox, which gets a run token)"
    ), line
    assert {r["headers"]["Authorization"] for r in requests} == {"Bearer hf_gwtest_token_123456"}
    assert {r["body"]["model"] for r in requests} == {"Qwen/Qwen2.5-Coder-32B-Instruct"}
    assert result.token_usage_source == "gateway"
    assert result.token_usage == {**served, "total_tokens": sum(served.values())}


@pytest.mark.docker
def test_a_batch_summary_counts_the_tokens_the_gateway_measured(
    agent_image: str, model_key: str, tmp_path: Path, nothing_left: None
) -> None:
    from orchestrator.batch import BatchSpec, run_batch
    from orchestrator.payloads.manifest import load_manifest
    from tests.batch.test_session import MATH, math_rows, write_jsonl

    step = load_manifest(MATH).mock_scripts["manager"][0]
    tasks = write_jsonl(tmp_path / "tasks.jsonl", math_rows(3))
    with ScriptedModelServer([step] * 4) as server:  # the load check asks no model
        spec = BatchSpec(
            tasks=tasks,
            output=tmp_path / "out",
            concurrency=1,
            run=RunSpec(payload=MATH, model="openai:scripted", api_base=server.api_base()),
        )
        summary = run_batch(spec)
        served = dict(server.usage)
    assert summary.state == "complete" and summary.counts["succeeded"] == 3, summary
    assert summary.tokens_source == "gateway"
    assert summary.tokens == {"input": served["input_tokens"], "output": served["output_tokens"]}
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").open()]
    assert {row["tokens"]["source"] for row in rows} == {"gateway"}


@pytest.mark.docker
def test_the_gateway_is_never_recorded_as_blocked_egress(
    agent_image: str, model_key: str, nothing_left: None
) -> None:
    """With an egress proxy (a listed host) and the model through the gateway, the
    sandbox's calls to the gateway (direct, as NO_PROXY says) are no blocked egress: the record
    has model calls and no `egress_blocked` event at all."""
    steps = [code("print('one')"), code("final_answer('done')")]
    with ScriptedModelServer(steps) as server:
        result = run(
            RunSpec(
                payload=PROBE,
                model="openai:scripted",
                api_base=server.api_base(),
                allow_hosts=("example.com",),
            )
        )
    assert result.status == "succeeded", result.error
    assert result.network == "allowlist" and result.gateway["calls"] == 2
    assert len(gateway_events(result, "model_call")) == 2
    assert [e for e in events_of(result) if e["type"] == "egress_blocked"] == []
    assert result.egress_blocked == 0
