"""The real e2b SDK, unmodified, against the local E2B test server (sandboxes are containers)."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
import e2b
import httpx
import pytest
from e2b import Template
from e2b.exceptions import (
    AuthenticationException,
    BuildException,
    FileNotFoundException,
    RateLimitException,
    SandboxException,
    SandboxNotRunningException,
)
from e2b.sandbox.commands.command_handle import CommandExitException
from e2b.template.logger import LogEntry

from tests.e2b_server import (
    IMAGE_REPOSITORY,
    LABEL,
    LABEL_SANDBOX,
    E2BTestServer,
    list_containers,
)
from tests.e2b_server import fixtures as e2b_fixtures
from tests.e2b_server.docker_sandbox import LABEL_INSTANCE
from tests.e2b_server.fixtures import TEST_TEMPLATE, base_image, require_docker

pytestmark = pytest.mark.docker

# The server's fixtures (harmless if tests/conftest.py imports them too).
e2b_test_server = e2b_fixtures.e2b_test_server
fake_e2b = e2b_fixtures.fake_e2b


def containers_of(sandbox_id: str) -> list[Any]:
    """The Docker containers of a sandbox (label lookup, so removed ones are absent)."""
    return list_containers(docker.from_env(), **{LABEL_SANDBOX: sandbox_id})


def wait_until(predicate: Callable[[], object], timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_create_with_metadata_records_request_and_lists_by_metadata(
    fake_e2b: E2BTestServer,
) -> None:
    run = e2b.Sandbox.create(
        TEST_TEMPLATE,
        timeout=120,
        metadata={"orchestrator.run-id": "run 1/a", "kind": "test"},
        envs={"SANDBOX_LEVEL": "visible"},
        allow_internet_access=True,
    )
    other = e2b.Sandbox.create(TEST_TEMPLATE, metadata={"orchestrator.run-id": "run-2"})

    body = fake_e2b.create_requests[0]
    assert body["templateID"] == TEST_TEMPLATE
    assert body["metadata"] == {"orchestrator.run-id": "run 1/a", "kind": "test"}
    assert body["envVars"] == {"SANDBOX_LEVEL": "visible"}
    assert body["timeout"] == 120
    assert body["allow_internet_access"] is True

    query = e2b.SandboxQuery(metadata={"orchestrator.run-id": "run 1/a"})
    listed = e2b.Sandbox.list(query=query).next_items()
    assert [s.sandbox_id for s in listed] == [run.sandbox_id]
    assert listed[0].metadata["kind"] == "test"
    running = e2b.SandboxQuery(state=[e2b.SandboxState.RUNNING], metadata={"kind": "test"})
    assert [s.sandbox_id for s in e2b.Sandbox.list(query=running).next_items()] == [run.sandbox_id]

    info = run.get_info()
    assert info.template_id == TEST_TEMPLATE
    assert info.metadata["orchestrator.run-id"] == "run 1/a"
    assert (info.end_at - info.started_at).total_seconds() == pytest.approx(120, abs=2)

    (container,) = containers_of(run.sandbox_id)
    assert container.labels[LABEL] == "1"
    assert run.is_running()
    assert run.kill() and other.kill()
    assert fake_e2b.alive_count() == 0
    assert containers_of(run.sandbox_id) == []


def test_connect_pagination_and_kill_by_id_like_a_cleanup(fake_e2b: E2BTestServer) -> None:
    left = [e2b.Sandbox.create(TEST_TEMPLATE, metadata={"owner": "crashed"}) for _ in range(3)]
    paginator = e2b.Sandbox.list(query=e2b.SandboxQuery(metadata={"owner": "crashed"}), limit=2)
    found = paginator.next_items()
    assert len(found) == 2 and paginator.has_next
    found += paginator.next_items()
    assert not paginator.has_next
    assert sorted(s.sandbox_id for s in found) == sorted(s.sandbox_id for s in left)

    again = e2b.Sandbox.connect(left[0].sandbox_id, timeout=600)
    assert again.commands.run("echo still here").stdout == "still here\n"
    for info in found:
        assert e2b.Sandbox.kill(info.sandbox_id) is True
    assert e2b.Sandbox.kill(left[0].sandbox_id) is False
    assert fake_e2b.alive_count() == 0
    kills = [r for r in fake_e2b.requests if r.method == "DELETE"]
    assert [r.status for r in kills] == [204, 204, 204, 404]


def test_files_write_single_and_many_then_read(fake_e2b: E2BTestServer) -> None:
    sandbox = e2b.Sandbox.create(TEST_TEMPLATE)
    info = sandbox.files.write("/work/in/task.json", '{"task": "x"}')
    assert (info.path, info.name) == ("/work/in/task.json", "task.json")

    written = sandbox.files.write_files(
        [
            {"path": "/work/payload/agent.py", "data": "print('hi')\n"},
            {"path": "/work/payload/pkg/tool.py", "data": b"X = 1\n"},
            {"path": "relative.txt", "data": b"\x00\x01binary"},
        ]
    )
    assert [w.path for w in written] == [
        "/work/payload/agent.py",
        "/work/payload/pkg/tool.py",
        "/root/relative.txt",
    ]
    uploads = [r for r in fake_e2b.requests if r.method == "POST" and r.path == "/files"]
    assert len(uploads) == 2, "many files go up in one request"

    assert sandbox.files.read("/work/in/task.json") == '{"task": "x"}'
    assert sandbox.files.read("/work/payload/pkg/tool.py") == "X = 1\n"
    assert sandbox.files.read("relative.txt", format="bytes") == b"\x00\x01binary"
    with pytest.raises(FileNotFoundException):
        sandbox.files.read("/work/missing.txt")

    assert sandbox.files.make_dir("/work/out") is True
    assert sandbox.files.make_dir("/work/out") is False
    assert sandbox.files.exists("/work/payload/agent.py")
    names = sorted(e.name for e in sandbox.files.list("/work/payload"))
    assert names == ["agent.py", "pkg"]
    result = sandbox.commands.run("cat /work/payload/agent.py | python3")
    assert result.stdout == "hi\n"
    sandbox.kill()


def test_commands_run_with_envs_streaming_and_exit_codes(fake_e2b: E2BTestServer) -> None:
    sandbox = e2b.Sandbox.create(TEST_TEMPLATE, envs={"LEVEL": "sandbox", "BOTH": "sandbox"})
    chunks: list[tuple[str, str, float]] = []
    started = time.monotonic()
    script = "echo out-$LEVEL-$BOTH-$ONLY; echo err >&2; sleep 1; echo late; pwd"
    result = sandbox.commands.run(
        script,
        envs={"BOTH": "command", "ONLY": "secret-value"},
        cwd="/tmp",
        on_stdout=lambda s: chunks.append(("out", s, time.monotonic() - started)),
        on_stderr=lambda s: chunks.append(("err", s, time.monotonic() - started)),
    )
    assert result.exit_code == 0
    assert result.stdout == "out-sandbox-command-secret-value\nlate\n/tmp\n"
    assert result.stderr == "err\n"
    first = next(c for c in chunks if c[1].startswith("out-"))
    late = next(c for c in chunks if c[1].startswith("late"))
    assert late[2] - first[2] > 0.8, "output must stream live, not arrive at the end"
    (command,) = [c for c in fake_e2b.commands if c.sandbox_id == sandbox.sandbox_id]
    assert command.envs == {"BOTH": "command", "ONLY": "secret-value"}
    assert "secret-value" not in str(fake_e2b.create_requests)

    with pytest.raises(CommandExitException) as failed:
        sandbox.commands.run("echo boom >&2; exit 7")
    assert failed.value.exit_code == 7
    assert failed.value.stderr == "boom\n"
    assert sandbox.commands.run("id -un", user="root").stdout == "root\n"
    with pytest.raises(SandboxException):
        sandbox.commands.run("true", cwd="/does/not/exist")
    sandbox.kill()


def test_long_running_command_is_killed(fake_e2b: E2BTestServer) -> None:
    sandbox = e2b.Sandbox.create(TEST_TEMPLATE)
    handle = sandbox.commands.run("echo ready; sleep 60", background=True)
    assert [p.pid for p in sandbox.commands.list()] == [handle.pid]
    started = time.monotonic()
    assert handle.kill() is True
    with pytest.raises(CommandExitException) as killed:
        handle.wait()
    assert killed.value.exit_code == -1
    assert killed.value.error == "signal: killed"
    assert time.monotonic() - started < 30  # killed: the command would have slept 60 s
    assert sandbox.commands.list() == []
    assert sandbox.commands.kill(handle.pid) is False

    with pytest.raises(e2b.TimeoutException):
        sandbox.commands.run("sleep 30", timeout=1)
    # Killed at its timeout (1 s), long before the 30 s it would sleep.
    assert wait_until(lambda: sandbox.commands.list() == [], timeout=25), "envd kills it"
    sandbox.kill()


def test_set_timeout_then_expiry_kills_the_sandbox(fake_e2b: E2BTestServer) -> None:
    sandbox = e2b.Sandbox.create(TEST_TEMPLATE, timeout=300)
    sandbox.set_timeout(2)
    info = sandbox.get_info()
    assert (info.end_at - info.started_at).total_seconds() < 10
    # Gone by its new timeout (2 s), not its first (300 s); the margin is for a busy machine.
    assert wait_until(lambda: not fake_e2b.sandbox(sandbox.sandbox_id).alive, timeout=60)
    assert fake_e2b.sandbox(sandbox.sandbox_id).killed_reason == "timeout"
    assert not sandbox.is_running()
    assert e2b.Sandbox.list().next_items() == []
    assert containers_of(sandbox.sandbox_id) == []
    with pytest.raises(SandboxNotRunningException):
        sandbox.commands.run("true")
    assert sandbox.kill() is False


def test_bad_api_key_and_bad_access_token_get_401(fake_e2b: E2BTestServer) -> None:
    with pytest.raises(AuthenticationException):
        e2b.Sandbox.create(TEST_TEMPLATE, api_key="e2b_wrong")
    assert fake_e2b.requests[-1].status == 401
    assert fake_e2b.alive_count() == 0

    sandbox = e2b.Sandbox.create(TEST_TEMPLATE)
    headers = {"E2b-Sandbox-Id": sandbox.sandbox_id, "X-Access-Token": "wrong"}
    response = httpx.get(f"{fake_e2b.url}/files", params={"path": "/etc/hostname"}, headers=headers)
    assert response.status_code == 401
    sandbox.kill()


def test_rate_limit_on_create_is_surfaced_or_retried(fake_e2b: E2BTestServer) -> None:
    fake_e2b.fail_next_create(status=429, retry_after=0, times=1)
    with pytest.raises(RateLimitException):
        e2b.Sandbox.create(TEST_TEMPLATE, retries=0)
    assert fake_e2b.requests[-1].status == 429
    assert fake_e2b.alive_count() == 0

    fake_e2b.fail_next_create(status=429, retry_after=1, times=1)
    started = time.monotonic()
    sandbox = e2b.Sandbox.create(TEST_TEMPLATE)  # the SDK honours Retry-After and retries
    assert time.monotonic() - started >= 1
    assert len(fake_e2b.create_requests) == 3
    sandbox.kill()


def test_sandbox_killed_mid_command_makes_the_sdk_raise(fake_e2b: E2BTestServer) -> None:
    sandbox = e2b.Sandbox.create(TEST_TEMPLATE)
    seen: list[str] = []
    threading.Timer(1.0, fake_e2b.kill_sandbox, args=(sandbox.sandbox_id,)).start()
    with pytest.raises(SandboxNotRunningException):
        sandbox.commands.run("echo working; sleep 60", on_stdout=seen.append)
    assert seen == ["working\n"]
    with pytest.raises(SandboxNotRunningException):
        sandbox.files.read("/etc/hostname")
    with pytest.raises(e2b.SandboxNotFoundException):
        sandbox.get_info()
    assert sandbox.kill() is False
    # The container is removed by the killer (here a timer thread) just after the SDK saw it go.
    assert wait_until(lambda: fake_e2b.alive_count() == 0)
    assert containers_of(sandbox.sandbox_id) == []


def test_async_sandbox(fake_e2b: E2BTestServer) -> None:
    async def scenario() -> None:
        sandbox = await e2b.AsyncSandbox.create(TEST_TEMPLATE, metadata={"flavor": "async"})
        await sandbox.files.write_files(
            [{"path": "/app/a.txt", "data": "A"}, {"path": "/app/b.txt", "data": "B"}]
        )
        out: list[str] = []
        result = await sandbox.commands.run(
            "cat /app/a.txt /app/b.txt; echo; echo $TOKEN",
            envs={"TOKEN": "t0k"},
            on_stdout=out.append,
        )
        assert result.stdout == "AB\nt0k\n" and "".join(out) == result.stdout
        query = e2b.SandboxQuery(metadata={"flavor": "async"})
        listed = await e2b.AsyncSandbox.list(query=query).next_items()
        assert [s.sandbox_id for s in listed] == [sandbox.sandbox_id]
        await sandbox.set_timeout(30)
        assert await sandbox.kill() is True

    asyncio.run(scenario())
    assert fake_e2b.alive_count() == 0


def test_counters_concurrency_cap_and_network(fake_e2b: E2BTestServer) -> None:
    sandboxes: list[e2b.Sandbox] = []
    threads = [
        threading.Thread(target=lambda: sandboxes.append(e2b.Sandbox.create(TEST_TEMPLATE)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert fake_e2b.alive_count() == 3 and fake_e2b.max_alive == 3

    fake_e2b.max_concurrent = 3
    with pytest.raises(RateLimitException):
        e2b.Sandbox.create(TEST_TEMPLATE, retries=0)
    for sandbox in sandboxes:
        sandbox.kill()
    assert fake_e2b.alive_count() == 0 and fake_e2b.max_alive == 3

    offline = e2b.Sandbox.create(TEST_TEMPLATE, allow_internet_access=False)
    (container,) = containers_of(offline.sandbox_id)
    assert container.attrs["HostConfig"]["NetworkMode"] == "none"
    offline.kill()


def test_stopping_the_server_removes_its_containers(monkeypatch: pytest.MonkeyPatch) -> None:
    require_docker()
    server = E2BTestServer(templates={"base": base_image()}).start()
    try:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        sandbox = e2b.Sandbox.create()
        handle = sandbox.commands.run("sleep 60", background=True)
        assert len(containers_of(sandbox.sandbox_id)) == 1
    finally:
        server.stop()
    assert containers_of(sandbox.sandbox_id) == []
    assert server.container_ids() == []
    with pytest.raises(Exception):  # noqa: B017 - the server is gone: any transport error
        handle.wait()


# -- template builds ---------------------------------------------------------------------


def images_of(server: E2BTestServer) -> list[Any]:
    """Every image the server built, intermediate layers included."""
    label = f"{LABEL_INSTANCE}={server.instance_id}"
    return docker.from_env().images.list(all=True, filters={"label": [label]})


def test_template_build_then_a_sandbox_runs_the_built_image(
    fake_e2b: E2BTestServer, tmp_path: Path
) -> None:
    (tmp_path / "requirements.txt").write_text("smolagents==1.26\n")
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "tool.py").write_text("X = 1\n")
    (tmp_path / "pkg" / "sub" / "data.txt").write_text("nested\n")
    template = (
        Template(file_context_path=str(tmp_path))
        .from_image(base_image())
        .copy("requirements.txt", "/build/")
        .copy("pkg/", "/opt/pkg/")
        .run_cmd("useradd -u 10001 -m agent && id -un > /tmp/built-by", user="root")
        .set_envs({"APP_MODE": "test run"})
        .set_workdir("/tmp")
        .set_user("agent")
    )
    name = "orchestrator-tpl-test"
    assert not Template.exists(name)
    logs: list[LogEntry] = []
    info = Template.build(template, name, cpu_count=1, memory_mb=1024, on_build_logs=logs.append)
    assert Template.exists(name)
    assert (info.name, info.tags) == (name, ["default"])

    assert fake_e2b.template_requests == [{"name": name, "cpuCount": 1, "memoryMB": 1024}]
    (start,) = fake_e2b.template_build_requests
    assert start["fromImage"] == base_image()
    steps = [(s["type"], s["args"]) for s in start["steps"]]
    assert steps[2:] == [
        ("RUN", ["useradd -u 10001 -m agent && id -un > /tmp/built-by", "root"]),
        ("ENV", ["APP_MODE", "test run"]),
        ("WORKDIR", ["/tmp"]),
        ("USER", ["agent"]),
    ]
    uploads = [r for r in fake_e2b.requests if r.method == "PUT"]
    assert [r.status for r in uploads] == [200, 200], "one tar per COPY, through pyqwest"
    build = fake_e2b.template_build(info.build_id)
    assert build.status == "ready" and build.image is not None
    assert any(e.message.startswith("Step ") for e in logs), "builder logs reach on_build_logs"

    sandbox = e2b.Sandbox.create(name)
    assert sandbox.get_info().template_id == info.template_id
    result = sandbox.commands.run(
        "id -un; pwd; echo $APP_MODE; cat /build/requirements.txt /opt/pkg/tool.py"
        " /opt/pkg/sub/data.txt /tmp/built-by; ls /opt/pkg"
    )
    assert result.stdout == (
        "agent\n/tmp\ntest run\nsmolagents==1.26\nX = 1\nnested\nroot\nsub\ntool.py\n"
    )
    (container,) = containers_of(sandbox.sandbox_id)
    assert container.attrs["Config"]["Image"] == build.image
    assert build.image.startswith(f"{IMAGE_REPOSITORY}/{info.template_id}:")
    assert container.attrs["HostConfig"]["Memory"] == 1024 * 2**20
    sandbox.kill()

    again = Template.build(template, name, on_build_logs=logs.append)
    assert again.template_id == info.template_id and again.build_id != info.build_id
    assert sum("already cached" in e.message for e in logs) == 2, "uploads are cached by hash"


def test_failing_build_steps_raise_build_exception(fake_e2b: E2BTestServer, tmp_path: Path) -> None:
    base = Template(file_context_path=str(tmp_path)).from_image(base_image())
    base = base.set_envs({"A": "1"})
    failing_line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
    template = base.run_cmd("echo compiling; echo 'no such package: left-pad' >&2; exit 3")
    with pytest.raises(BuildException) as raised:
        Template.build(template, "orchestrator-tpl-broken")
    message = str(raised.value)
    assert "no such package: left-pad" in message and "compiling" in message
    assert "returned a non-zero code: 3" in message
    (build,) = fake_e2b.template_builds.builds
    assert (build.status, build.reason_step) == ("error", "2")
    frames = []
    tb = raised.value.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    assert (__file__, failing_line) in frames, "reason.step points the SDK at the failing call"
    assert not docker.from_env().images.list(
        filters={"reference": f"{IMAGE_REPOSITORY}/{build.template_id}"}
    )

    missing = Template().from_image("e2b-test-server-missing/base:1").run_cmd("true")
    with pytest.raises(BuildException, match="cannot pull"):
        Template.build(missing, "orchestrator-tpl-no-base")
    assert fake_e2b.template_builds.builds[-1].reason_step == "base"


def test_template_routes_check_keys_signatures_and_faults(fake_e2b: E2BTestServer) -> None:
    assert Template.exists(TEST_TEMPLATE), "configured templates exist too"
    with pytest.raises(AuthenticationException):
        Template.exists("anything", api_key="e2b_wrong")
    with pytest.raises(AuthenticationException):
        Template.build(Template().from_image(base_image()), "x", api_key="e2b_wrong")
    assert {r.status for r in fake_e2b.requests} == {200, 401}

    headers = {"X-API-KEY": fake_e2b.api_key}
    created = httpx.post(f"{fake_e2b.url}/v3/templates", json={"name": "tpl"}, headers=headers)
    assert created.status_code == 202
    template_id = created.json()["templateID"]
    link = httpx.get(f"{fake_e2b.url}/templates/{template_id}/files/{'0' * 64}", headers=headers)
    assert link.status_code == 201 and link.json()["present"] is False
    forged = link.json()["url"].split("?")[0] + "?token=forged"
    assert httpx.put(forged, content=b"x").status_code == 403

    fake_e2b.fail_next("template_build", 500, message="builder unavailable")
    with pytest.raises(BuildException, match="builder unavailable"):
        Template.build(Template().from_image(base_image()), "orchestrator-tpl-fault")


def test_stopping_the_server_removes_the_images_it_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    require_docker()
    server = E2BTestServer(base_images={"e2bdev/base": base_image()}).start()
    try:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        # Template() defaults to E2B's base image, mapped to a local one here.
        Template.build(Template().from_base_image().run_cmd("echo built > /built"), "tpl-ok")
        broken = Template().from_base_image().run_cmd("touch /partial").run_cmd("exit 1")
        with pytest.raises(BuildException):
            Template.build(broken, "tpl-broken")
        assert len(images_of(server)) >= 3, "the built image and the failed build's layers"
        sandbox = e2b.Sandbox.create("tpl-ok")
        assert sandbox.files.read("/built") == "built\n"
    finally:
        server.stop()
    assert images_of(server) == []
    assert server.container_ids() == []
    docker.from_env().images.get(base_image())  # the base image stays


# ---- the edge: a sandbox's port by name, as E2B routes `<port>-<id>.<domain>` ------------------


def _port_url(server: E2BTestServer, sandbox: e2b.Sandbox, port: int) -> str:
    """As a client reaches a sandbox port through the test server: its host name
    (`get_host`), with the scheme and port of the server (E2B: https on 443)."""
    return f"http://{sandbox.get_host(port)}:{server.port}/"


def test_a_sandbox_port_is_reached_by_its_host_name_from_here_and_from_a_sandbox(
    fake_e2b: E2BTestServer,
) -> None:
    served = e2b.Sandbox.create(TEST_TEMPLATE, timeout=120)
    client = e2b.Sandbox.create(TEST_TEMPLATE, timeout=120)
    locked = e2b.Sandbox.create(TEST_TEMPLATE, timeout=120, network={"allow_public_traffic": False})
    try:
        assert served.get_host(8080) == f"8080-{served.sandbox_id}.{fake_e2b.domain}"
        for sandbox in (served, locked):
            sandbox.files.write("/tmp/www/hello.txt", "hello from " + sandbox.sandbox_id)
            sandbox.commands.run("cd /tmp/www && exec python3 -m http.server 8080", background=True)
        # From this host: the Host header routes, the server's own address carries it.
        here = f"http://127.0.0.1:{fake_e2b.port}/hello.txt"
        host = {"Host": served.get_host(8080)}
        assert wait_until(lambda: httpx.get(here, headers=host).status_code == 200, 30)
        assert httpx.get(here, headers=host).text == f"hello from {served.sandbox_id}"
        closed = httpx.get(here, headers={"Host": served.get_host(9)})
        assert closed.status_code == 502 and "port is not open" in closed.text
        # From another sandbox, by name only: its resolver answers the domain, as E2B's DNS.
        fetch = (
            'python3 -c "import urllib.request, sys; '
            'print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())" '
        )
        seen = client.commands.run(fetch + _port_url(fake_e2b, served, 8080) + "hello.txt")
        assert seen.stdout.strip() == f"hello from {served.sandbox_id}"
        # allow_public_traffic=False: the traffic access token is required, as on E2B.
        assert locked.traffic_access_token
        lhost = {"Host": locked.get_host(8080)}
        assert wait_until(lambda: httpx.get(here, headers=lhost).status_code == 403, 30)
        assert "e2b-traffic-access-token" in httpx.get(here, headers=lhost).text
        token = {**lhost, "e2b-traffic-access-token": locked.traffic_access_token}
        assert wait_until(lambda: httpx.get(here, headers=token).status_code == 200, 30)
        assert [r.plane for r in fake_e2b.requests if r.plane == "edge"]
    finally:
        for sandbox in (served, client, locked):
            sandbox.kill()
    gone = httpx.get(here, headers=host)
    assert gone.status_code == 502 and "not found" in gone.text
