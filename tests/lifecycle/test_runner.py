"""The run path end to end, in real containers on the real Docker engine."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import docker
import pytest

from orchestrator import RunSpec, Store, load_manifest, run
from orchestrator.backends.docker.runtimes import PIDS_BY_CGROUP, gvisor_nproc
from orchestrator.backends.docker.seccomp import security_options
from orchestrator.labels import LABEL_KIND, LABEL_RUN_ID
from orchestrator.records.store import new_run_id
from orchestrator.spec import Limits
from tests.conftest import (
    EXAMPLES,
    PAYLOADS,
    REPO,
    TEST_PAYLOADS,
    cli,
    events_of,
    our_containers,
    run_containers,
    running_sandbox,
    wait_for,
)

pytestmark = pytest.mark.docker

ADVERSARY = TEST_PAYLOADS / "adversary"


@pytest.mark.parametrize("payload", EXAMPLES, ids=lambda p: p.name)
def test_example_payload_end_to_end(
    payload: Path, agent_image: str, example_secrets: None, no_leftovers
) -> None:
    manifest = load_manifest(payload)
    result = run(RunSpec(payload=payload, model="mock"))
    assert result.status == "succeeded", result.error
    assert str(result.answer).strip() == manifest.example_answer
    events = events_of(result)
    types = [e["type"] for e in events]
    assert "run_start" in types and "final_answer" in types
    assert [e for e in events if e["type"] == "managed_agent_call"], "no managed agent call"
    steps = [e for e in events if e["type"] == "step"]
    failed = [s for s in steps if s.get("error")]
    assert failed, "no step with a code error"
    # The agent whose code failed corrects it in its next step.
    first = failed[0]
    later = [
        s
        for s in steps
        if s["agent"] == first["agent"] and s["step_number"] == first["step_number"] + 1
    ]
    assert later and not later[0].get("error")
    assert result.token_usage.get("input_tokens", 0) > 0
    stored = Store().get_run(result.run_id)
    assert stored["status"] == "succeeded"
    assert json.loads((Path(result.record_dir) / "result.json").read_text())["status"] == (
        "succeeded"
    )


def test_second_run_does_not_rebuild(
    agent_image: str, docker_client, example_secrets: None, no_leftovers
) -> None:
    # The run's own image, by id: other tests (another pytest-xdist worker) build and prune
    # images of their own meanwhile, so the engine's whole list is no measure of this run.
    payload = EXAMPLES[0]
    first = run(RunSpec(payload=payload))
    assert first.image
    before = docker_client.images.get(first.image).id
    messages: list[str] = []
    second = run(RunSpec(payload=payload), on_progress=messages.append)
    assert first.status == second.status == "succeeded"
    assert second.image == first.image
    assert docker_client.images.get(second.image).id == before
    assert not [m for m in messages if "build" in m.lower()], messages


def _run_in_thread(spec: RunSpec, **kwargs):
    box: dict = {}
    cancel = threading.Event()

    def target() -> None:
        box["result"] = run(spec, cancel=cancel, **kwargs)

    thread = threading.Thread(target=target)
    thread.start()
    return thread, cancel, box


def test_container_is_hardened_while_live(
    agent_image: str, docker_client, store_label: str, no_leftovers
) -> None:
    run_id = new_run_id()
    spec = RunSpec(
        payload=ADVERSARY, additional_args={"mode": "sleep"}, timeout_seconds=60, run_id=run_id
    )
    thread, cancel, box = _run_in_thread(spec)
    try:
        info = wait_for(lambda: running_sandbox(docker_client, store_label, run_id), timeout=120)
    finally:
        cancel.set()
        thread.join(timeout=60)
    host = info["HostConfig"]
    assert info["Config"]["User"] not in ("", "0", "root", "0:0")
    assert info["Config"]["User"].split(":")[0] != "0"
    assert host["CapDrop"] == ["ALL"] and not host["CapAdd"]
    assert not host["Privileged"]
    assert host["SecurityOpt"] == security_options()  # and our seccomp profile (no io_uring)
    assert not any("unconfined" in opt for opt in host["SecurityOpt"])
    assert host["ReadonlyRootfs"] is True
    assert host["Memory"] == 256 * 2**20 and host["MemorySwap"] == host["Memory"]
    assert host["NanoCpus"] > 0
    assert host["PidsLimit"] == 64
    assert host["NetworkMode"] == "none"
    # PID 1 is the deadline keeper (an init that reaps and forwards signals), not docker-init.
    assert not host["Init"]
    entrypoint = info["Config"]["Entrypoint"]
    assert entrypoint[3].endswith("orchestrator_runtime/deadline.py"), entrypoint
    assert entrypoint[-3:] == ["python", "-m", "orchestrator_runtime"], entrypoint
    assert host["PidMode"] in ("", "private") and host["IpcMode"] in ("private", "")
    assert host["UTSMode"] == "" and host["UsernsMode"] == ""
    assert not host.get("Binds") and not host.get("Mounts")
    assert all(m["Type"] not in ("bind", "volume") for m in info["Mounts"])
    assert "docker.sock" not in json.dumps(info)
    assert set(host["Tmpfs"]) == {"/tmp", "/work"}
    assert info["Config"]["Labels"][LABEL_RUN_ID] == box["result"].run_id
    assert box["result"].status == "cancelled"


def test_inner_executor_refuses_os_and_subprocess(agent_image: str, no_leftovers) -> None:
    result = run(RunSpec(payload=TEST_PAYLOADS / "forbidden_import"))
    assert result.status in ("succeeded", "failed")
    errors = [
        e["error"]["message"] for e in events_of(result) if e["type"] == "step" and e.get("error")
    ]
    assert any("os" in m and "not allowed" in m.lower() for m in errors), errors
    assert any("subprocess" in m and "not allowed" in m.lower() for m in errors), errors


LEAK_SECRET = "s3cr3t-Value-That-Must-Not-Leak-4711"


def test_secret_reaches_tool_but_never_leaks(
    agent_image: str,
    docker_client,
    store_label: str,
    monkeypatch: pytest.MonkeyPatch,
    no_leftovers,
) -> None:
    manifest = load_manifest(TEST_PAYLOADS / "leaky")
    name = manifest.secrets[0]
    monkeypatch.setenv(name, LEAK_SECRET)
    inspected: list[dict] = []
    stop = threading.Event()

    def watch() -> None:  # inspect the container while it is live
        while not stop.is_set():
            for c in our_containers(docker_client, store_label):
                try:
                    inspected.append(docker_client.api.inspect_container(c["Id"]))
                except Exception:
                    pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = run(RunSpec(payload=TEST_PAYLOADS / "leaky"))
    finally:
        stop.set()
        watcher.join()
    assert result.status == "succeeded", result.error
    assert inspected, "never saw the container live"
    forms = [
        LEAK_SECRET,
        base64.b64encode(LEAK_SECRET.encode()).decode().rstrip("="),
        base64.b64encode(b"x" + LEAK_SECRET.encode()).decode()[4:20],
    ]
    assert LEAK_SECRET not in json.dumps(inspected)
    history = json.dumps(docker_client.api.history(result.image))
    assert LEAK_SECRET not in history
    # The tool saw the secret: the leaky payload's answer proves it without revealing it.
    assert "secret-length=" + str(len(LEAK_SECRET)) in str(result.answer)
    record = Path(result.record_dir)
    files = [p for p in record.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"events.jsonl", "result.json", "stderr.log"}
    for path in files:
        text = path.read_text()
        for form in forms:
            assert form not in text, f"{form!r} leaked into {path.name}"
        for piece in ("Value-That", "Must-Not-Leak"):  # line-by-line prints of a split secret
            assert piece not in text or LEAK_SECRET[:6] not in text
    assert LEAK_SECRET not in json.dumps(Store().get_run(result.run_id))


def test_timeout_kills_the_sandbox(agent_image: str, no_leftovers) -> None:
    spec = RunSpec(payload=ADVERSARY, additional_args={"mode": "sleep"}, timeout_seconds=5)
    result = run(spec)
    assert result.status == "timed_out"
    assert result.timings["duration"] < 5 + 3


@pytest.mark.gvisor
def test_memory_limit_is_oom_killed(agent_image: str, no_leftovers) -> None:
    spec = RunSpec(payload=ADVERSARY, additional_args={"mode": "memory"}, memory_mb=128)
    result = run(spec)
    assert result.status == "oom_killed", (result.status, result.error)
    assert result.oom_killed


#: A parent that outlives its child as the runtime's relay does: the child holds memory past
#: the container's limit, the parent exits as a shell reports the child's end (137 for a
#: SIGKILL); with "self", the child kills itself with SIGKILL instead (no OOM at all).
OUTLIVED_CHILD = (
    "import subprocess, sys\n"
    "hoard = 'held = [bytearray(16 << 20) for _ in range(64)]'\n"
    "suicide = 'import os, signal; os.kill(os.getpid(), signal.SIGKILL)'\n"
    "child = subprocess.run([sys.executable, '-c', suicide if sys.argv[1:] else hoard])\n"
    "sys.exit(128 - child.returncode if child.returncode < 0 else child.returncode)\n"
)


@pytest.mark.parametrize("ending", ["oom", "self-kill"])
def test_an_oom_kill_is_the_hosts_finding_even_when_the_engines_record_missed_it(
    agent_image: str, docker_client, ending: str
) -> None:
    """The engine sets State.OOMKilled only when its OOM notice comes in before the exit's;
    under load the relay's exit (137, at once) can come first, and a run over its memory
    limit ended `failed`. The host's finding (`oom_killed`) also asks the engine's events:
    given the real container's state with the record cleared, as the engine leaves it then,
    an OOM kill is still found, and a process that killed itself is not one."""
    from orchestrator.backends.docker.sandbox import SIGKILL_EXIT, oom_killed

    api = docker_client.api
    command = ["python", "-c", OUTLIVED_CHILD, *(["self"] if ending == "self-kill" else [])]
    container = api.create_container(
        agent_image,
        command=command,
        labels={LABEL_KIND: "test"},
        host_config=api.create_host_config(
            init=True, mem_limit="64m", memswap_limit="64m", network_mode="none"
        ),
    )
    try:
        api.start(container)
        code = api.wait(container, timeout=120)["StatusCode"]
        state = api.inspect_container(container)["State"]
        assert code == SIGKILL_EXIT
        missed = {**state, "OOMKilled": False}  # as the engine leaves it when its notice is late
        assert oom_killed(api, container["Id"], code, missed) == (ending == "oom")
    finally:
        api.remove_container(container, force=True)


@pytest.mark.gvisor
@pytest.mark.parametrize(
    "limits",
    [{}, {"pids": 16, "memory_mb": 1024}],
    ids=["manifest-256MB-64-pids", "pids-16-1024MB"],
)
def test_fork_bomb_is_refused(agent_image: str, limits: dict, no_leftovers) -> None:
    """The process limit refuses a fork bomb's extra fork, and the run goes on to the tool's
    answer, on runc (the pids cgroup) and on gVisor (RLIMIT_NPROC in gVisor's kernel) alike:
    at the adversary's own limits (256 MB, 64 processes), where under gVisor the memory
    carries fewer processes than `pids` (about 30 MiB each there) and RLIMIT_NPROC is held
    to them; and with memory to spare, where `pids` itself is what holds. The record says
    which limit held, and on gVisor its figure and why."""
    spec = RunSpec(
        payload=ADVERSARY, additional_args={"mode": "forkbomb"}, timeout_seconds=60, **limits
    )
    result = run(spec)
    assert result.status == "succeeded", (result.status, result.error)
    assert str(result.answer).startswith("fork refused after"), result.answer
    children = int(str(result.answer).rsplit("after ", 1)[1].split()[0])
    pids, memory_mb = result.limits["pids"], result.limits["memory_mb"]
    assert children < pids
    if result.sandbox["runtime"] == "runc":
        assert result.sandbox["pids"] == PIDS_BY_CGROUP
        return
    nproc = gvisor_nproc(Limits(pids=pids, memory_mb=memory_mb))
    said = result.sandbox["pids"]
    assert said.startswith(f"RLIMIT_NPROC {nproc} in gVisor's kernel"), said
    if memory_mb == 256:
        assert nproc < pids and f"not pids {pids}: what memory_mb 256 carries" in said, said
    else:
        assert nproc == pids and "not pids" not in said, said


@pytest.mark.gvisor
def test_cpu_and_tmpfs_limits_hold(
    agent_image: str, docker_client, store_label: str, no_leftovers
) -> None:
    """One run, four busy processes under `cpus=0.5`: the kernel throttles the sandbox's
    cgroup (gVisor's own threads included), as the engine's stats say; then writing /tmp past
    `tmpfs_mb` (the default's, 256 MiB: not a run option) is refused with ENOSPC. Under
    gVisor the sandbox's own count of its CPU time is gVisor's, so the host's is read."""
    tmpfs_mb = Limits().tmpfs_mb
    run_id = new_run_id()
    spec = RunSpec(
        payload=ADVERSARY,
        additional_args={"mode": "hog"},
        cpus=0.5,
        memory_mb=1024,
        run_id=run_id,
    )
    thread, cancel, box = _run_in_thread(spec)
    try:
        # The run's own sandbox, running: not its gateway, nor one whose restore failed.
        container = wait_for(
            lambda: running_sandbox(docker_client, store_label, run_id), timeout=120
        )
        assert container["HostConfig"]["NanoCpus"] == 5 * 10**8

        def throttled() -> int:
            try:
                stats = docker_client.api.stats(container["Id"], stream=False, one_shot=True)
            except docker.errors.NotFound:
                raise AssertionError("the run ended, its sandbox never throttled") from None
            return int(stats["cpu_stats"].get("throttling_data", {}).get("throttled_periods", 0))

        assert wait_for(throttled, timeout=60, interval=0.5) > 0
    except BaseException:
        cancel.set()
        raise
    finally:
        thread.join(timeout=120)
    result = box["result"]
    assert result.status == "succeeded", (result.status, result.error)
    written, refusal = str(result.answer).removeprefix("/tmp refused after ").split(" MiB: ")
    assert refusal == "ENOSPC" and tmpfs_mb - 8 <= int(written) <= tmpfs_mb, result.answer


@pytest.mark.gvisor
def test_max_steps_ends_the_run(agent_image: str, no_leftovers) -> None:
    """An agent that has not answered after `max_steps` steps is stopped there."""
    result = run(RunSpec(payload=TEST_PAYLOADS / "forbidden_import", max_steps=1))
    assert result.status == "failed", (result.status, result.error)
    assert result.error and result.error.type == "AgentMaxStepsError", result.error
    ran = [e for e in events_of(result) if e["type"] == "step" and e.get("code")]
    assert [s["step_number"] for s in ran] == [1], ran  # the script holds three


def _start_cli_run(tmp_path: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "run", str(ADVERSARY), "--arg", 'mode="sleep"'],
        cwd=REPO,
        env=os.environ.copy(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_cancels_and_removes(
    sig: signal.Signals, tmp_path: Path, agent_image: str, docker_client, store_label, no_leftovers
) -> None:
    before = {r["run_id"] for r in Store().list_runs(limit=1000)}
    proc = _start_cli_run(tmp_path)
    try:
        wait_for(lambda: our_containers(docker_client, store_label), timeout=120)
        # Mid-run: once the runtime has started the run (its first event is in the record).
        row = wait_for(
            lambda: next(
                (r for r in Store().list_runs(limit=1000) if r["run_id"] not in before), None
            ),
            timeout=120,
        )
        events = Path(row["record_dir"]) / "events.jsonl"
        wait_for(lambda: events.is_file() and '"type": "run_start"' in events.read_text(), 120)
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, proc.stderr.read()
    wait_for(lambda: not our_containers(docker_client, store_label), timeout=5)
    (new,) = [r for r in Store().list_runs(limit=1000) if r["run_id"] not in before]
    assert new["status"] == "cancelled"


def test_sigkill_leaves_container_that_cleanup_removes(
    tmp_path: Path, agent_image: str, docker_client, store_label, no_leftovers
) -> None:
    proc = _start_cli_run(tmp_path)
    wait_for(lambda: our_containers(docker_client, store_label), timeout=120)
    proc.kill()
    proc.wait(timeout=10)
    assert our_containers(docker_client, store_label), "the orphan should still be there"
    out = cli("cleanup")
    assert out.returncode == 0, out.stderr
    assert "removed sandbox" in out.stdout
    assert not our_containers(docker_client, store_label)
    assert "infra_error" in out.stdout or "closed run" in out.stdout


def test_cleanup_keeps_sandboxes_of_live_runs(
    agent_image: str, docker_client, store_label, no_leftovers
) -> None:
    run_id = new_run_id()
    spec = RunSpec(payload=ADVERSARY, additional_args={"mode": "sleep"}, run_id=run_id)
    thread, cancel, box = _run_in_thread(spec)
    try:
        wait_for(lambda: run_containers(docker_client, store_label, run_id), timeout=120)
        out = cli("cleanup")
        assert "kept sandbox" in out.stdout, out.stdout
        assert run_containers(docker_client, store_label, run_id)
    finally:
        cancel.set()
        thread.join(timeout=60)


# --- bad input: a one-paragraph error, a non-zero exit code, and nothing started ----------


def _assert_clean_refusal(out, *needles: str) -> None:
    assert out.returncode not in (0, None)
    assert out.stderr.startswith("orchestrator: error: "), out.stderr
    assert "fix:" in out.stderr
    for needle in needles:
        assert needle in out.stderr
    assert "Traceback" not in out.stderr


def test_refusals_start_nothing(tmp_path: Path, docker_client, store_label, no_leftovers) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "manifest.toml").write_text('[payload]\nname = "Bad Name"\nentrypoint = "x:y"\n')
    _assert_clean_refusal(cli("run", str(bad)), "payload.name", str(bad / "manifest.toml"))
    _assert_clean_refusal(cli("run", str(EXAMPLES[0]), "--model", "nope:x"), "nope")
    leaky = TEST_PAYLOADS / "leaky"
    secret = load_manifest(leaky).secrets[0]
    env = {k: v for k, v in os.environ.items() if k != secret}
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator", "run", str(leaky)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    _assert_clean_refusal(out, secret)
    no_secrets = PAYLOADS / "research_team"  # so that the engine is the first thing missing
    assert not load_manifest(no_secrets).secrets
    out = cli("run", str(no_secrets), env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    _assert_clean_refusal(out, "Docker engine")
    assert not our_containers(docker_client, store_label)
