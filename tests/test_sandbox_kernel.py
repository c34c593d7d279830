"""What stands between a payload and the host's kernel (issue 26): under runc, our own seccomp
profile (Docker's default minus io_uring) on every container of a run."""

from __future__ import annotations

import json

import pytest

from orchestrator import RunSpec, run
from orchestrator.backends.docker.seccomp import PROFILE_NAME, profile_text, security_options

from .conftest import TEST_PAYLOADS, events_of

pytestmark = pytest.mark.docker

KERNEL_PROBE = TEST_PAYLOADS / "kernel_probe"


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
    assert not allowed & {"ptrace", "bpf", "perf_event_open", "userfaultfd", "unshare", "mount",
                          "keyctl", "add_key", "setns", "process_vm_writev"}  # fmt: skip
    # What every Python program needs is there (threads, sockets, files).
    assert {"clone", "futex", "socket", "openat", "mmap", "execve", "epoll_wait"} <= allowed
    assert security_options() == ["no-new-privileges:true", f"seccomp={profile_text()}"]


def test_io_uring_is_refused_under_runc(agent_image: str, docker_client, no_leftovers) -> None:
    """Acceptance 1 (runc): the probe's io_uring_setup gets EPERM; the record names the
    runtime and the profile, and the engine shows the profile on the container."""
    seen: dict[str, object] = {}

    def on_event(event: dict) -> None:
        if event.get("type") == "sandbox_created" and "security" not in seen:
            info = docker_client.api.inspect_container(event["sandbox_id"])
            seen["security"] = info["HostConfig"]["SecurityOpt"]

    result = run(RunSpec(payload=KERNEL_PROBE, model="mock"), on_event=on_event)
    assert result.status == "succeeded", result.error
    answer = json.loads(result.answer)
    assert answer["io_uring_setup"] == {"allowed": False, "errno": "EPERM"}, answer
    assert "gVisor" not in answer["proc_version"]
    assert result.sandbox == {"runtime": "runc", "seccomp": PROFILE_NAME}
    assert seen["security"] == security_options()
    created = [e for e in events_of(result) if e["type"] == "sandbox_created"]
    assert created[0]["isolation"] == result.sandbox
