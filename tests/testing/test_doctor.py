"""`orchestrator doctor`: the kit's checks and the engine's configuration on this machine,
and what it says when the engine's info (a double: the real daemon is never changed) lacks
gVisor or seccomp."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from orchestrator.backends.docker import DockerBackend
from orchestrator.backends.docker.hostchecks import HOST_CHECKS
from orchestrator.backends.docker.runsc_direct import direct
from orchestrator.cli import main
from orchestrator.labels import LABEL_RUN_ID
from orchestrator.testing.doctor import check_names, doctor
from tests.conftest import cli

pytestmark = pytest.mark.docker

HOST = [c.name for c in HOST_CHECKS]


@pytest.fixture(scope="module")
def live_info(docker_client) -> dict[str, Any]:
    info: dict[str, Any] = docker_client.api.info()
    return info


def without_gvisor(info: dict[str, Any]) -> dict[str, Any]:
    double = copy.deepcopy(info)
    double["Runtimes"] = {k: v for k, v in (info.get("Runtimes") or {}).items() if "runsc" not in k}
    return double


def without_seccomp(info: dict[str, Any]) -> dict[str, Any]:
    double = copy.deepcopy(info)
    double["SecurityOptions"] = [o for o in info["SecurityOptions"] if "seccomp" not in o]
    return double


def by_name(outcomes: list[Any]) -> dict[str, Any]:
    return {o.name: o for o in outcomes}


def test_doctor_json_passes_on_this_machine_and_leaves_nothing(
    agent_image: str, docker_client, nothing_left: None
) -> None:
    """As a user's doctor runs, on gVisor through the engine (`runsc`): the kit's whole run
    on that path. `auto` picks runsc-direct where the host can run it (as CI can), whose
    whole run is tests/backends/docker/runsc_direct/test_sandbox.py's;
    tests/testing/test_conformance.py runs the kit on runc, check by check."""
    out = cli("doctor", "--json", "--sandbox-runtime", "runsc", timeout=1200)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] is True and report["counts"]["fail"] == 0
    assert [c["name"] for c in report["checks"]] == list(check_names("docker"))
    assert all(c["status"] == "pass" for c in report["checks"]), report["checks"]  # all apply
    assert len(report["runs"]) >= 8  # real runs, each one removed again:
    for run_id in report["runs"]:
        label = {"label": [f"{LABEL_RUN_ID}={run_id}"]}
        assert not docker_client.api.containers(all=True, filters=label), run_id
        assert not docker_client.api.networks(filters=label), run_id


def test_without_gvisor_the_kernel_check_fails_and_names_the_setup_script(
    live_info: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a host that cannot run runsc itself either (runsc-direct)."""
    monkeypatch.setattr(direct, "why_not_here", lambda: "no runsc, as this test has it")
    live = by_name(doctor("docker", only=HOST, facts=live_info).outcomes)
    report = doctor("docker", only=HOST, facts=without_gvisor(live_info))
    weakened = by_name(report.outcomes)
    changed = sorted(n for n in HOST if live[n].status != weakened[n].status)
    assert changed == ["host.sandbox_kernel"], changed
    kernel = weakened["host.sandbox_kernel"]
    assert live["host.sandbox_kernel"].status == "pass"
    assert kernel.status == "fail" and "runc" in kernel.detail
    assert "scripts/setup-gvisor.sh" in (kernel.fix or ""), kernel.fix
    assert not report.passed and not report.run_ids  # host checks need no run


def test_without_gvisor_registered_runsc_direct_still_gives_auto_gvisor(
    live_info: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """runsc installed and runnable by this host, but not registered with the engine: runs
    on `auto` get gVisor through runsc-direct, so the kernel check passes and says so."""
    monkeypatch.setattr(direct, "why_not_here", lambda: None)
    (kernel,) = doctor(
        "docker", only=["host.sandbox_kernel"], facts=without_gvisor(live_info)
    ).outcomes
    assert kernel.status == "pass" and "through runsc-direct" in kernel.detail, kernel
    assert "setup-gvisor.sh" in kernel.detail  # what --sandbox-runtime runsc still needs


def test_without_seccomp_the_cli_fails_that_check_and_exits_non_zero(
    live_info: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(DockerBackend, "host_facts", lambda self: without_seccomp(live_info))
    code = main(["doctor", "--json", *(f"--check={name}" for name in HOST)])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["ok"] is False
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert statuses == {
        "host.sandbox_kernel": "pass",
        "host.seccomp": "fail",
        "host.cgroup_limits": "pass",
        "host.engine_log": "pass",
        "host.snapshots": "pass",
        "host.storage": "pass",
    }
    (seccomp,) = [c for c in report["checks"] if c["name"] == "host.seccomp"]
    assert seccomp["fix"] and "seccomp" in seccomp["detail"]


def test_the_text_report_is_one_line_per_check_with_the_fix_under_a_failure(
    live_info: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(DockerBackend, "host_facts", lambda self: without_gvisor(live_info))
    monkeypatch.setattr(direct, "why_not_here", lambda: "no runsc, as this test has it")
    code = main(["doctor", *(f"--check={name}" for name in HOST)])
    lines = capsys.readouterr().out.splitlines()
    assert code == 1
    assert lines[0].startswith("FAIL") and "host.sandbox_kernel" in lines[0]
    assert lines[1].lstrip().startswith("fix:") and "setup-gvisor.sh" in lines[1]
    assert [line.split()[0] for line in lines[2:7]] == ["PASS"] * 5
    assert lines[-1].startswith("6 checks: 5 passed, 1 failed, 0 not applicable")


def test_gvisor_registered_without_the_filter_fails_the_kernel_check(
    live_info: dict[str, Any],
) -> None:
    """A runsc registered without --oci-seccomp (an older setup script, or by hand) runs
    gVisor sandboxes without our seccomp filter: the kernel check fails and says how to fix
    it; the live engine (CI runs setup-gvisor.sh) passes."""
    assert doctor("docker", only=["host.sandbox_kernel"], facts=live_info).passed
    double = copy.deepcopy(live_info)
    double["Runtimes"]["runsc"]["runtimeArgs"] = ["--network=none"]
    (outcome,) = doctor("docker", only=["host.sandbox_kernel"], facts=double).outcomes
    assert outcome.status == "fail" and "--oci-seccomp" in outcome.detail, outcome.detail
    assert "runsc-net" not in outcome.detail  # only the one registered without it
    assert outcome.fix and "setup-gvisor.sh" in outcome.fix


def test_the_snapshot_check_says_why_gvisor_runs_start_cold_and_never_fails(
    live_info: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speed, not safety: an engine without checkpoints passes, saying that gVisor runs
    through it start cold and what turns snapshots on; where the host can run runsc itself,
    that runs on `auto` start from runsc's own snapshots whatever the engine's mode."""
    from orchestrator.backends.docker import snapshot_store

    only = ["host.snapshots"]
    plain = {**live_info, "ExperimentalBuild": False}
    able = {**live_info, "ExperimentalBuild": True, "Runtimes": {"runsc": {}, "runsc-net": {}}}
    monkeypatch.setattr(direct, "why_not_here", lambda: "not root, as this test has it")
    (cold,) = doctor("docker", only=only, facts=plain).outcomes
    assert cold.status == "pass" and "start cold" in cold.detail, cold
    assert "enable-checkpoints.sh" in cold.detail
    assert "runsc-direct (runsc's own snapshots) cannot run here: not root" in cold.detail
    (none,) = doctor("docker", only=only, facts=without_gvisor(live_info)).outcomes
    assert none.status == "pass" and "no gVisor" in none.detail, none
    (restored,) = doctor("docker", only=only, facts=able).outcomes
    assert "start from a snapshot" in restored.detail, restored
    monkeypatch.setattr(direct, "why_not_here", lambda: None)
    (itself,) = doctor("docker", only=only, facts=plain).outcomes
    assert itself.status == "pass", itself
    assert itself.detail.startswith("runs on `auto` start from a snapshot that runsc restores")
    assert "experimental mode is not needed" in itself.detail
    assert "enable-checkpoints.sh" in itself.detail  # what `runsc` through the engine needs
    monkeypatch.setenv(snapshot_store.SNAPSHOTS_ENV, "off")
    (off,) = doctor("docker", only=only, facts=able).outcomes
    assert "turned off" in off.detail and snapshot_store.SNAPSHOTS_ENV in off.detail, off


def test_the_storage_check_names_a_slow_driver_and_the_way_out_and_never_fails(
    live_info: dict[str, Any],
) -> None:
    """Speed, not safety: fuse-overlayfs or vfs pass, saying what they cost and how to move
    to overlay2; overlay2 passes, named."""
    only = ["host.storage"]
    for slow in ("fuse-overlayfs", "vfs"):
        (outcome,) = doctor("docker", only=only, facts={**live_info, "Driver": slow}).outcomes
        assert outcome.status == "pass" and slow in outcome.detail, outcome
        assert '"storage-driver": "overlay2"' in outcome.detail and "use-overlay2.sh" in (
            outcome.detail
        )
    (native,) = doctor("docker", only=only, facts={**live_info, "Driver": "overlay2"}).outcomes
    assert native.detail == "the engine stores containers with overlay2", native


def test_an_engine_in_debug_mode_fails_the_log_check(live_info: dict[str, Any]) -> None:
    """Debug mode writes request bodies (a container's environment: its run token) to the
    engine's log; the double says so, the live engine does not."""
    assert doctor("docker", only=["host.engine_log"], facts=live_info).passed
    debugging = {**live_info, "Debug": True}
    report = doctor("docker", only=["host.engine_log"], facts=debugging)
    (outcome,) = report.outcomes
    assert outcome.status == "fail" and "debug" in outcome.detail
    assert outcome.fix and "daemon.json" in outcome.fix


def test_a_plugin_backend_offers_its_own_host_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook: a backend's class lists its host checks (names known before one is made),
    and judges its own facts; the doctor runs them before the kit."""
    from orchestrator_mirror import MirrorBackend

    from orchestrator.backends.base import HostCheck, HostProblem
    from orchestrator.testing.checks import CHECKS

    def quota(facts: dict[str, Any]) -> str:
        if facts["quota"] < 10:
            raise HostProblem(f"a quota of {facts['quota']} sandboxes", "Raise the quota.")
        return f"a quota of {facts['quota']} sandboxes"

    check = HostCheck("host.quota", "the account may run ten sandboxes", quota)
    monkeypatch.setattr(MirrorBackend, "host_checks", (check,))
    monkeypatch.setattr(MirrorBackend, "host_facts", lambda self: {"quota": 3})
    assert check_names("mirror")[0] == "host.quota"
    assert check_names("e2b") == tuple(c.name for c in CHECKS)  # E2B has none
    (outcome,) = doctor("mirror", only=["host.quota"]).outcomes
    assert outcome.status == "fail" and outcome.fix == "Raise the quota."
    assert doctor("mirror", only=["host.quota"], facts={"quota": 20}).passed


def test_an_unknown_check_is_refused_before_anything_runs(capsys) -> None:
    code = main(["doctor", "--check", "limits.memroy"])
    assert code == 2
    assert "limits.memory" in capsys.readouterr().err  # the fix lists the names
