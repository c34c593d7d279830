"""The E2B backend through the real `e2b` SDK against the local E2B test server.

Templates are really built (the server turns the SDK's build steps into a Docker build), and
every sandbox is a container running that template, so a run here goes through the same
template definition, upload, command, stream and kill calls as on E2B's cloud.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import e2b
import pytest

from orchestrator import ConfigError, RunSpec, Store, load_manifest, run
from orchestrator.backends.e2b import E2BSettings, ensure_template
from orchestrator.backends.e2b.templates import SANDBOX_USER
from orchestrator.batch import BatchObservers, BatchSpec, run_batch
from orchestrator.labels import LABEL_RUN_ID
from tests.conftest import EXAMPLES, PAYLOADS, REPO, TEST_PAYLOADS, cli, events_of, wait_for
from tests.e2b_server import E2BTestServer
from tests.e2b_server.fixtures import base_image

pytestmark = pytest.mark.docker

SLEEPER = TEST_PAYLOADS / "sleeper"
MATH = TEST_PAYLOADS / "batch_math"
SECRET = "e2b-Secret-Value-That/Must+Not=Leak-42"


@pytest.fixture
def e2b_env(
    e2b_test_server: E2BTestServer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[E2BTestServer]:
    """The session's test server, its records reset, the SDK pointed at it, and templates
    built on the agent image's own base (no registry needed). Unlike `fake_e2b`, templates
    built here stay for the next test: that is the content addressing at work, and saves a
    build per test. A test must leave no sandbox alive."""
    server = e2b_test_server
    server.reset()
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("ORCHESTRATOR_E2B_BASE_IMAGE", base_image())
    for name in ("ORCHESTRATOR_E2B_MAX_SANDBOXES", "ORCHESTRATOR_E2B_PYTHON"):
        monkeypatch.delenv(name, raising=False)
    yield server
    left = server.alive_ids()
    for sandbox_id in left:
        server.kill(sandbox_id, reason="test teardown")
    server.reset()
    assert not left, f"sandboxes left alive: {left}"


def agent_trace(result: Any) -> list[tuple[Any, ...]]:
    """What the agents did, without times, ids and host-side bookkeeping."""
    return [
        (e["type"], e.get("agent"), e.get("step_number"), bool(e.get("error")), e.get("code"))
        for e in events_of(result)
        if e.get("source") != "host" and e["type"] not in ("run_start", "run_end")
    ]


def test_missing_api_key_starts_nothing(
    e2b_env: E2BTestServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("E2B_API_KEY")
    monkeypatch.chdir(tmp_path)  # no .env here
    with pytest.raises(ConfigError, match="E2B_API_KEY"):
        run(RunSpec(payload=PAYLOADS / "research_team", backend="e2b"))
    out = cli("run", str(PAYLOADS / "research_team"), "--backend", "e2b", env={"E2B_API_KEY": ""})
    assert out.returncode == 2 and "E2B_API_KEY" in out.stderr and "fix:" in out.stderr
    assert e2b_env.create_requests == []


def test_template_is_content_addressed_and_hardened(e2b_env: E2BTestServer) -> None:
    settings = E2BSettings.from_env()
    name = ensure_template(settings)
    e2b_env.reset()
    messages: list[str] = []
    assert ensure_template(settings, progress=messages.append) == name  # no second build
    assert not [r for r in e2b_env.requests if r.path.startswith("/v3/templates")]
    assert not [m for m in messages if "building" in m]

    sandbox = e2b.Sandbox.create(name, timeout=60)
    try:
        who = sandbox.commands.run("id -u; id -un", user=SANDBOX_USER)
        assert who.stdout.split() == ["10001", SANDBOX_USER]
        check = sandbox.commands.run(
            "/opt/venv/bin/python -c 'import smolagents, orchestrator_runtime; print(1)'; "
            "command -v pip pip3 apt-get dpkg gcc || echo none-found",
            user=SANDBOX_USER,
        )
        assert check.stdout.split() == ["1", "none-found"], check.stdout
        suid = sandbox.commands.run("find / -xdev -perm /6000 -type f", user="root")
        assert suid.stdout.strip() == ""
    finally:
        sandbox.kill()


#: The examples without requirements: one with requirements (web_browser) would build a second
#: derived image (an E2B template, ~100 s) in CI; its Docker runs cover it.
PLAIN_EXAMPLES = [p for p in EXAMPLES if not load_manifest(p).requirements]


@pytest.mark.parametrize("payload", PLAIN_EXAMPLES, ids=lambda p: p.name)
def test_example_payload_on_e2b_matches_docker(
    payload: Path, e2b_env: E2BTestServer, agent_image: str, example_secrets: None, no_leftovers
) -> None:
    manifest = load_manifest(payload)
    on_docker = run(RunSpec(payload=payload, model="mock"))
    on_e2b = run(RunSpec(payload=payload, model="mock", backend="e2b"))
    assert on_docker.status == on_e2b.status == "succeeded", on_e2b.error
    assert str(on_e2b.answer).strip() == manifest.example_answer == str(on_docker.answer).strip()
    assert on_e2b.backend == "e2b" and on_e2b.network == "none"
    assert agent_trace(on_e2b) == agent_trace(on_docker)
    types = [e["type"] for e in events_of(on_e2b)]
    assert "managed_agent_call" in types and "final_answer" in types
    assert on_e2b.token_usage == on_docker.token_usage
    assert Store().get_run(on_e2b.run_id)["backend"] == "e2b"

    (body,) = e2b_env.create_requests
    assert body["metadata"][LABEL_RUN_ID] == on_e2b.run_id
    assert body["templateID"] == on_e2b.image
    assert body.get("allow_internet_access") is False
    assert not body.get("envVars")  # nothing at sandbox level: secrets go per command
    limit = manifest.limits.timeout_seconds
    assert limit < body["timeout"] <= limit + 120
    assert e2b_env.alive_count() == 0


def test_secret_reaches_the_tool_and_nothing_else(
    e2b_env: E2BTestServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LEAKY_SECRET", SECRET)
    result = run(RunSpec(payload=TEST_PAYLOADS / "leaky", backend="e2b"))
    assert result.status == "succeeded", result.error
    assert f"secret-length={len(SECRET)}" in str(result.answer)
    (command,) = [c for c in e2b_env.commands if "orchestrator_runtime" in " ".join(c.args)]
    assert command.envs["LEAKY_SECRET"] == SECRET  # per command, for the runtime only
    assert command.user == SANDBOX_USER
    api_key = os.environ["E2B_API_KEY"]
    for body in e2b_env.create_requests:
        assert SECRET not in json.dumps(body) and api_key not in json.dumps(body)
    for started in e2b_env.commands:
        assert api_key not in json.dumps(started.envs)
    files = [p for p in Path(result.record_dir).rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"events.jsonl", "result.json", "stderr.log"}
    for path in files:
        assert SECRET not in path.read_text(), path.name
    assert SECRET not in json.dumps(Store().get_run(result.run_id))


def test_rate_limited_create_is_retried(e2b_env: E2BTestServer) -> None:
    # More 429s than the SDK retries by itself (3): our own retries must carry the run.
    e2b_env.fail_next_create(status=429, retry_after=0, times=5)
    messages: list[str] = []
    result = run(
        RunSpec(payload=PAYLOADS / "research_team", backend="e2b"), on_progress=messages.append
    )
    assert result.status == "succeeded", result.error
    assert len(e2b_env.create_requests) == 6
    assert [m for m in messages if "sandbox create failed (RateLimitException" in m]
    assert e2b_env.alive_count() == 0


def _run_in_thread(spec: RunSpec) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", run(spec)))
    thread.start()
    return thread, box


def _running_sandbox(server: E2BTestServer) -> str:
    """The id of the one sandbox whose runtime is running."""

    def started() -> str | None:
        ids = server.alive_ids()
        running = any("orchestrator_runtime" in " ".join(c.args) for c in server.commands)
        return ids[0] if len(ids) == 1 and running else None

    return wait_for(started, timeout=60)


def test_sandbox_killed_mid_run_is_an_infra_error(e2b_env: E2BTestServer) -> None:
    spec = RunSpec(payload=SLEEPER, backend="e2b", additional_args={"seconds": 60})
    thread, box = _run_in_thread(spec)
    sandbox_id = _running_sandbox(e2b_env)
    time.sleep(2)  # the agent is in its tool's sleep
    e2b_env.kill_sandbox(sandbox_id)
    thread.join(timeout=60)
    result = box["result"]
    assert result.status == "infra_error", result
    assert result.error.type == "sandbox_lost"
    assert e2b_env.alive_count() == 0


def test_time_limit_ends_timed_out_and_kills_the_sandbox(e2b_env: E2BTestServer) -> None:
    spec = RunSpec(
        payload=SLEEPER, backend="e2b", additional_args={"seconds": 60}, timeout_seconds=4
    )
    started = time.monotonic()
    result = run(spec)
    elapsed = time.monotonic() - started
    assert result.status == "timed_out", result
    (sandbox_id,) = {r.sandbox_id for r in e2b_env.requests if r.sandbox_id}
    assert e2b_env.sandbox(sandbox_id).killed_reason == "api"  # killed by us, not its lifetime
    assert e2b_env.alive_count() == 0
    assert elapsed < 4 + 30  # template lookup and sandbox start included; no wait on 60 s


def test_allowlist_run_denies_all_but_the_listed_hosts(e2b_env: E2BTestServer) -> None:
    result = run(
        RunSpec(payload=PAYLOADS / "research_team", backend="e2b", allow_hosts=("api.example.com",))
    )
    assert result.status == "succeeded", result.error
    assert result.network == "allowlist" and result.allowlist == ["api.example.com"]
    (body,) = e2b_env.create_requests
    assert body["network"]["denyOut"] == ["0.0.0.0/0"]
    assert body["network"]["allowOut"] == ["api.example.com"]


def math_rows(n: int) -> list[dict[str, Any]]:
    return [
        {
            "id": f"t{i}",
            "task": f"{i} * 3",
            "additional_args": {"op": "mul", "a": i, "b": 3},
            "expected": i * 3,
        }
        for i in range(n)
    ]


def test_batch_respects_the_sandbox_cap(
    e2b_env: E2BTestServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ORCHESTRATOR_E2B_MAX_SANDBOXES", "3")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in math_rows(10)))
    messages: list[str] = []
    summary = run_batch(
        BatchSpec(
            tasks=tasks,
            output=tmp_path / "out",
            run=RunSpec(payload=MATH, backend="e2b"),
            concurrency=10,
        ),
        observers=BatchObservers(on_message=messages.append),
    )
    assert summary.counts["succeeded"] == 10 and summary.accuracy == 1.0
    assert [m for m in messages if "lowered to 3" in m]
    assert 1 <= e2b_env.max_alive <= 3
    # one sandbox per task, plus the batch's up-front check that the payload loads
    assert len(e2b_env.create_requests) == 10 + 1
    assert e2b_env.alive_count() == 0


@pytest.fixture
def orchestrator_process(e2b_env: E2BTestServer) -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


def test_cleanup_kills_what_a_killed_orchestrator_left(
    e2b_env: E2BTestServer, orchestrator_process: list[subprocess.Popen[str]]
) -> None:
    command = [
        sys.executable,
        "-m",
        "orchestrator",
        "run",
        str(SLEEPER),
        "--backend",
        "e2b",
        "--arg",
        "seconds=120",
        "--quiet",
    ]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True)
    orchestrator_process.append(process)
    sandbox_id = _running_sandbox(e2b_env)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=10)
    time.sleep(0.5)
    assert e2b_env.alive_ids() == [sandbox_id]  # nobody left to kill it

    dry = cli("cleanup", "--backend", "e2b", "--dry-run")
    assert dry.returncode == 0 and f"would remove sandbox {sandbox_id}" in dry.stdout
    assert e2b_env.alive_ids() == [sandbox_id]
    out = cli("cleanup", "--backend", "e2b")
    assert out.returncode == 0, out.stderr
    assert f"removed sandbox {sandbox_id}" in out.stdout
    assert e2b_env.alive_count() == 0
    assert e2b_env.sandbox(sandbox_id).killed_reason == "api"
    run_id = e2b_env.sandbox(sandbox_id).metadata[LABEL_RUN_ID]
    assert Store().get_run(run_id)["status"] == "infra_error"
