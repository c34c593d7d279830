"""What stands between a payload and the host's kernel: gVisor's kernel (runsc),
or the host's behind our own seccomp profile (runc: Docker's default minus io_uring).

Tests marked `gvisor` run in the suite's runtime (runc, `tests/conftest.py`) and again on
gVisor in CI (`ORCHESTRATOR_SANDBOX_RUNTIME=runsc pytest -m gvisor`, `.ci/run`)."""

from __future__ import annotations

import html
import http.client
import json
import os
import signal

import pytest

from orchestrator import RunSpec, Store, run
from orchestrator.backends.docker import DockerBackend
from orchestrator.backends.docker.runtimes import RUNSC, RUNSC_NET, SETUP_SCRIPT, EngineRuntimes
from orchestrator.backends.docker.seccomp import PROFILE_NAME, profile_text, security_options
from orchestrator.errors import ConfigError

from .conftest import TEST_PAYLOADS, cli, events_of, start_cli
from .test_view import started

pytestmark = pytest.mark.docker

KERNEL_PROBE = TEST_PAYLOADS / "kernel_probe"


class NoGvisor(EngineRuntimes):
    """An engine's runtimes as an engine without gVisor lists them."""

    def names(self) -> set[str]:
        return {"runc", "io.containerd.runc.v2"}


def test_profile_is_dockers_default_without_io_uring() -> None:
    profile = json.loads(profile_text())
    allowed = {
        name
        for rule in profile["syscalls"]
        if rule["action"] == "SCMP_ACT_ALLOW"
        for name in rule["names"]
    }
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    assert not {n for n in allowed if n.startswith("io_uring")}
    assert not allowed & {
        "ptrace",
        "bpf",
        "perf_event_open",
        "userfaultfd",
        "unshare",
        "mount",
        "keyctl",
        "add_key",
        "setns",
        "process_vm_writev",
    }
    # What every Python program needs is there (threads, sockets, files).
    assert {"clone", "futex", "socket", "openat", "mmap", "execve", "epoll_wait"} <= allowed
    assert security_options() == ["no-new-privileges:true", f"seccomp={profile_text()}"]


@pytest.mark.gvisor
def test_the_probe_meets_the_runtimes_kernel(
    agent_image: str, docker_client, sandbox_runtime: str, no_leftovers
) -> None:
    """Acceptance 1: under runc the probe's io_uring_setup gets EPERM; under gVisor the
    probe reports gVisor's kernel. The record names the runtime (and under runc the profile),
    and the engine shows both on the container."""
    seen: dict[str, dict] = {}

    def on_event(event: dict) -> None:
        if event.get("type") == "sandbox_created" and "host" not in seen:
            seen["host"] = docker_client.api.inspect_container(event["sandbox_id"])["HostConfig"]

    result = run(RunSpec(payload=KERNEL_PROBE, model="mock"), on_event=on_event)
    assert result.status == "succeeded", result.error
    answer = json.loads(result.answer)
    created = [e for e in events_of(result) if e["type"] == "sandbox_created"]
    assert created[0]["isolation"] == result.sandbox
    if sandbox_runtime == "runsc":
        assert answer["proc_version"].startswith("Linux version 4.4.0"), answer  # gVisor's
        assert result.sandbox == {
            "runtime": "runsc",
            "seccomp": "none (gVisor's kernel)",
            "requested": "runsc",
        }
        assert seen["host"]["Runtime"] == RUNSC  # no network: gVisor's --network=none
        assert seen["host"]["SecurityOpt"] == ["no-new-privileges:true"]
    else:
        assert answer["io_uring_setup"] == {"allowed": False, "errno": "EPERM"}, answer
        assert not answer["proc_version"].startswith("Linux version 4.4.0")
        assert result.sandbox == {
            "runtime": "runc",
            "seccomp": PROFILE_NAME,
            "requested": sandbox_runtime,
        }
        assert seen["host"]["Runtime"] == "runc"
        assert seen["host"]["SecurityOpt"] == security_options()


def test_runsc_without_gvisor_is_refused_before_anything_starts(
    agent_image: str, no_leftovers
) -> None:
    """Acceptance 4: runsc asked for on an engine without it is bad input (exit 2) naming
    the set-up step; no record, no container."""
    backend = DockerBackend()
    backend.runtimes = NoGvisor(backend.client)
    store = Store()
    before = len(store.list_runs(limit=1000))
    with pytest.raises(ConfigError) as caught:
        run(RunSpec(payload=KERNEL_PROBE, sandbox_runtime="runsc"), backend=backend)
    assert caught.value.exit_code == 2 and caught.value.field == "sandbox_runtime"
    assert str(SETUP_SCRIPT) in str(caught.value) and "runc" in caught.value.fix
    assert len(store.list_runs(limit=1000)) == before


def test_auto_without_gvisor_runs_on_runc_and_says_so(agent_image: str, no_leftovers) -> None:
    """Acceptance 4: `auto` on an engine without gVisor is runc, and the record says so."""
    backend = DockerBackend()
    backend.runtimes = NoGvisor(backend.client)
    result = run(RunSpec(payload=KERNEL_PROBE, sandbox_runtime="auto"), backend=backend)
    assert result.status == "succeeded", result.error
    assert result.sandbox == {"runtime": "runc", "seccomp": PROFILE_NAME, "requested": "auto"}
    assert json.loads(result.answer)["io_uring_setup"]["errno"] == "EPERM"


@pytest.fixture
def gvisor(docker_client) -> None:
    """gVisor registered with the engine (`setup-gvisor.sh`; CI runs it). Set
    ORCHESTRATOR_TESTS_WITHOUT_GVISOR=1 to skip the tests that need it on a machine without."""
    runtimes = set(docker_client.api.info().get("Runtimes") or {})
    if {RUNSC, RUNSC_NET} <= runtimes:
        return
    if os.environ.get("ORCHESTRATOR_TESTS_WITHOUT_GVISOR") == "1":
        pytest.skip("gVisor is not registered with this engine")
    pytest.fail(f"gVisor is not registered with the engine: run `bash {SETUP_SCRIPT}` as root")


def test_auto_with_gvisor_runs_on_gvisor_and_the_cli_says_which(
    agent_image: str, gvisor: None, no_leftovers
) -> None:
    """`auto` on an engine with gVisor is gVisor; `runs show` and the viewer say which
    runtime ran it."""
    done = cli("run", str(KERNEL_PROBE), "--sandbox-runtime", "auto", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["sandbox"]["runtime"] == "runsc" and result["sandbox"]["requested"] == "auto"
    shown = cli("runs", "show", result["run_id"])
    assert "sandbox runtime: runsc: gVisor's kernel; asked for auto" in shown.stdout, shown.stdout
    viewer = start_cli("view", "--port", "0")
    try:
        port = int(started(viewer)[-1].rsplit(":", 1)[1].split("/")[0])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", f"/run/{result['run_id']}")
        page = html.unescape(conn.getresponse().read().decode())
        conn.close()
    finally:
        os.killpg(viewer.pid, signal.SIGINT)
        viewer.wait(10)
    assert 'id="sandbox-runtime">runsc' in page and "gVisor's kernel; asked for auto" in page


def test_a_batch_asking_for_runsc_without_gvisor_stops_before_its_first_task(
    tmp_path, agent_image: str, no_leftovers
) -> None:
    """The batch checks the runtime once, up front (bad input for the whole batch)."""
    from orchestrator.batch import BatchSpec, run_batch

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": 1, "task": "probe"}\n')
    backend = DockerBackend()
    backend.runtimes = NoGvisor(backend.client)
    spec = BatchSpec(
        tasks=tasks,
        output=tmp_path / "out",
        run=RunSpec(payload=KERNEL_PROBE, sandbox_runtime="runsc"),
    )
    before = len(Store().list_runs(limit=1000))
    with pytest.raises(ConfigError, match="setup-gvisor.sh"):
        run_batch(spec, backend=backend)
    assert len(Store().list_runs(limit=1000)) == before
