"""What stands between a payload and the host's kernel: our own seccomp profile (Docker's
default minus io_uring, ptrace and AF_VSOCK) in front of gVisor's kernel (runsc, which applies
it with `--oci-seccomp`) or of the host's (runc).

Tests marked `gvisor` run in the suite's runtime (runc, `tests/conftest.py`) and again on
gVisor in CI (`ORCHESTRATOR_SANDBOX_RUNTIME=runsc pytest -m gvisor`, `.ci/run`)."""

from __future__ import annotations

import html
import http.client
import json
import os
import signal

import pytest

from orchestrator import Limits, RunSpec, Store, run
from orchestrator.backends.docker import DockerBackend
from orchestrator.backends.docker.runsc_direct import direct
from orchestrator.backends.docker.runtimes import (
    GVISOR_NPROC_FLOOR,
    GVISOR_PROCESS_MB,
    GVISOR_RUNTIME_MB,
    GVISOR_RUNTIME_TASKS,
    NO_FILTER_IN_GVISOR,
    PIDS_BY_CGROUP,
    RUNSC,
    RUNSC_NET,
    SETUP_SCRIPT,
    EngineRuntimes,
    Placement,
    gvisor_nproc,
    gvisor_pids_limit,
    pids_by_gvisor,
    place,
)
from orchestrator.backends.docker.seccomp import (
    GVISOR_PROFILE_NAME,
    PROFILE_NAME,
    gvisor_security_options,
    profile_text,
    security_options,
)
from orchestrator.errors import ConfigError
from tests.conftest import TEST_PAYLOADS, cli, events_of, start_cli
from tests.view.test_view import started

pytestmark = pytest.mark.docker

KERNEL_PROBE = TEST_PAYLOADS / "kernel_probe"
#: What the kernel probe's manifest asks for: under gVisor its 256 MiB carry fewer than its
#: 64 processes, and the record says so.
PROBE_PIDS = pids_by_gvisor(Limits(memory_mb=256, pids=64))


class NoGvisor(EngineRuntimes):
    """An engine's runtimes as an engine without gVisor lists them."""

    def registered(self) -> dict[str, dict]:
        return {"runc": {"path": "runc"}, "io.containerd.runc.v2": {}}


class GvisorWithoutFilter(EngineRuntimes):
    """gVisor as a runsc registered without `--oci-seccomp` lists it (an older setup)."""

    def registered(self) -> dict[str, dict]:
        return {
            "runc": {"path": "runc"},
            RUNSC: {"path": "/usr/bin/runsc", "runtimeArgs": ["--network=none"]},
            RUNSC_NET: {"path": "/usr/bin/runsc", "runtimeArgs": ["--network=host"]},
        }


#: What the probe's calls get from our profile, on either kernel.
REFUSED = {"allowed": False, "errno": "EPERM"}


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
    """Under runc and under gVisor alike, our profile refuses the probe's io_uring_setup,
    unshare(CLONE_NEWUSER), ptrace and AF_VSOCK socket (EPERM, a filter in force on the tool's
    process); under gVisor the probe meets gVisor's kernel. The record names the runtime and
    the profile, and the engine shows both on the container."""
    seen: dict[str, dict] = {}

    def on_event(event: dict) -> None:
        if event.get("type") == "sandbox_created" and "host" not in seen:
            seen["host"] = docker_client.api.inspect_container(event["sandbox_id"])["HostConfig"]

    result = run(RunSpec(payload=KERNEL_PROBE, model="mock"), on_event=on_event)
    assert result.status == "succeeded", result.error
    answer = json.loads(result.answer)
    created = [e for e in events_of(result) if e["type"] == "sandbox_created"]
    assert created[0]["isolation"] == result.sandbox
    for call in ("io_uring_setup", "unshare_user", "ptrace", "vsock"):
        assert answer[call] == REFUSED, (call, answer)
    assert answer["seccomp"] == "2", answer  # filter mode, on the tool's own process
    # ENOSYS, so the C library falls back to clone (flags checked) and threads still start.
    assert answer["clone3"] == {"allowed": False, "errno": "ENOSYS"}, answer
    if sandbox_runtime == "runsc":
        assert answer["proc_version"].startswith("Linux version 4.4.0"), answer  # gVisor's
        isolation = {k: v for k, v in result.sandbox.items() if k != "snapshot"}  # restored?
        assert isolation == {
            "runtime": "runsc",
            "seccomp": GVISOR_PROFILE_NAME,
            "pids": PROBE_PIDS,
            "requested": "runsc",
        }
        assert seen["host"]["Runtime"] == RUNSC  # no network: gVisor's --network=none
        assert seen["host"]["SecurityOpt"] == gvisor_security_options()
    else:
        assert not answer["proc_version"].startswith("Linux version 4.4.0")
        assert result.sandbox == {
            "runtime": "runc",
            "seccomp": PROFILE_NAME,
            "pids": PIDS_BY_CGROUP,
            "requested": sandbox_runtime,
        }
        assert seen["host"]["Runtime"] == "runc"
        assert seen["host"]["SecurityOpt"] == security_options()


def test_gvisor_holds_processes_to_what_the_memory_carries_and_runc_to_pids() -> None:
    """Under gVisor RLIMIT_NPROC is the sandbox's `pids`, or fewer where its memory carries
    fewer forked processes (never under the runtime's own floor), and the record gives the
    figure and why; runc's pids cgroup is `pids` as ever, with no nproc ulimit."""
    gvisor, runc = Placement("runsc", RUNSC, "runsc"), Placement("runc", "runc", "runc")
    small, roomy = Limits(memory_mb=256, pids=64), Limits(memory_mb=4096, pids=64)
    carried = GVISOR_RUNTIME_TASKS + (256 - GVISOR_RUNTIME_MB) // GVISOR_PROCESS_MB
    assert gvisor_nproc(small) == carried < 64
    assert gvisor_nproc(roomy) == 64
    assert gvisor_nproc(Limits(memory_mb=64, pids=64)) == GVISOR_NPROC_FLOOR
    cgroup, (nproc,) = gvisor.pids_options(small)
    assert (nproc.name, nproc.soft, nproc.hard) == ("nproc", carried, carried)
    assert cgroup == gvisor_pids_limit(64)  # room for gVisor's threads, as before
    assert runc.pids_options(small) == (64, [])
    said = gvisor.isolation(small)["pids"]
    assert said.startswith(f"RLIMIT_NPROC {carried} in gVisor's kernel, not pids 64: "), said
    assert "memory_mb 256" in said and f"{GVISOR_PROCESS_MB} MiB a process" in said
    assert gvisor.isolation(roomy)["pids"] == "RLIMIT_NPROC 64 in gVisor's kernel"
    assert runc.isolation(small)["pids"] == PIDS_BY_CGROUP


def test_gvisor_without_the_filter_claims_none(docker_client) -> None:
    """A runsc registered without `--oci-seccomp` ignores the engine's seccomp option: the
    sandbox is not given one, and the record says none is in force and how to fix it."""
    placement = place("auto", GvisorWithoutFilter(docker_client), networked=False)
    assert placement.runtime == "runsc" and not placement.seccomp
    assert placement.security_options() == ["no-new-privileges:true"]
    assert placement.isolation(Limits())["seccomp"] == NO_FILTER_IN_GVISOR
    assert "setup-gvisor.sh" in NO_FILTER_IN_GVISOR


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


#: Why a test's host cannot run runsc-direct (`direct.why_not_here`, as a test has it say).
NOT_HERE = "not here, as this test has it"


def test_auto_picks_runsc_direct_then_the_engines_gvisor_then_runc(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`auto` is runsc-direct where the host can run it (whatever the engine has registered),
    else gVisor through the engine where registered, else runc; asked once per backend;
    any runtime named is itself."""
    answers: list[str | None] = []
    monkeypatch.setattr(direct, "why_not_here", lambda: answers.pop(0))
    order = []
    for here, runtimes in ((None, NoGvisor), (NOT_HERE, EngineRuntimes), (NOT_HERE, NoGvisor)):
        backend = DockerBackend()
        backend.runtimes = runtimes(backend.client)
        answers.append(here)
        order.append(backend.runtime_for("auto"))
        assert backend.runtime_for("auto") == order[-1] and not answers  # asked once
        assert [backend.runtime_for(n) for n in ("runc", "runsc")] == ["runc", "runsc"]
    assert order == ["runsc-direct", "runsc", "runc"]


def test_auto_asks_the_engine_for_its_runtimes_only_where_it_may_need_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run on `auto` starts asking the engine for its runtimes in the background while it
    is checked, except where `auto` is runsc-direct, which needs nothing of them."""
    asked: list[str] = []

    class Counted(EngineRuntimes):
        def prefetch(self) -> None:
            asked.append("prefetch")
            super().prefetch()

    for here, expected in ((None, []), (NOT_HERE, ["prefetch"])):
        monkeypatch.setattr(direct, "why_not_here", lambda here=here: here)
        backend = DockerBackend()
        backend.runtimes = Counted(backend.client)
        backend.check_runtime("auto")
        assert asked == expected, (here, asked)
        asked.clear()


def test_auto_without_gvisor_runs_on_runc_and_says_so(
    agent_image: str, no_leftovers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Acceptance 4: `auto` on an engine without gVisor, on a host that cannot run runsc
    itself, is runc, and the record says so."""
    monkeypatch.setattr(direct, "why_not_here", lambda: NOT_HERE)
    backend = DockerBackend()
    backend.runtimes = NoGvisor(backend.client)
    result = run(RunSpec(payload=KERNEL_PROBE, sandbox_runtime="auto"), backend=backend)
    assert result.status == "succeeded", result.error
    assert result.sandbox == {
        "runtime": "runc",
        "seccomp": PROFILE_NAME,
        "pids": PIDS_BY_CGROUP,
        "requested": "auto",
    }
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
    """`auto` on an engine with gVisor is gVisor: run by runsc itself (runsc-direct) where
    this host can (root, runsc on PATH: CI), else through the engine; `runs show` and the
    viewer say which runtime ran it."""
    done = cli("run", str(KERNEL_PROBE), "--sandbox-runtime", "auto", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["sandbox"]["runtime"] == "runsc" and result["sandbox"]["requested"] == "auto"
    itself = direct.why_not_here() is None
    assert (result["sandbox"].get("engine_runtime") == "runsc-direct") == itself, result
    shown = cli("runs", "show", result["run_id"])
    said = (
        f"sandbox runtime: runsc: gVisor's kernel{' through runsc-direct' if itself else ''}, "
        f"seccomp {GVISOR_PROFILE_NAME}, processes limited by {PROBE_PIDS}; asked for auto"
    )
    assert said in shown.stdout, shown.stdout
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
    assert 'id="sandbox-runtime">runsc' in page
    assert f"seccomp {GVISOR_PROFILE_NAME}, processes limited by {PROBE_PIDS}; asked" in page
    assert ("gVisor's kernel through runsc-direct, seccomp" in page) == itself


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
