"""The conformance kit (`orchestrator.testing`) against the backends we ship and register:
docker (runc; gVisor through tests/testing/test_doctor.py's doctor run), the `mirror` plugin, and
deliberately broken copies of the mirror, each of which must fail the check of the promise
it breaks."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from orchestrator.backends.base import Capabilities
from orchestrator.testing import CHECKS, Kit, open_kit, run_check
from orchestrator.testing.kit import PARTS
from orchestrator.testing.plugin import conformance_tests
from orchestrator.testing.probe import write_probe
from tests.conftest import REPO

# ---- the list itself ---------------------------------------------------------------------


def test_each_check_is_named_once_and_needs_a_real_capability() -> None:
    names = [c.name for c in CHECKS]
    assert len(names) == len(set(names)), names
    capability_names = {f.name for f in fields(Capabilities)}
    for check in CHECKS:
        assert check.promise and callable(check.function), check.name
        needs = check.needs
        assert needs is None or needs in PARTS or needs.partition("=")[0] in capability_names


def test_a_check_is_not_applicable_only_where_the_capability_is_declared_absent() -> None:
    (memory,) = [c for c in CHECKS if c.needs == "resource_limits"]
    ran: list[str] = []
    check = memory.__class__(
        memory.name, memory.promise, memory.needs, lambda k: ran.append("x") or "ok"
    )

    def kit(**declared: Any) -> Kit:
        return cast(Kit, SimpleNamespace(capabilities=Capabilities(**declared), backend_name="x"))

    absent = run_check(kit(resource_limits=False), check)
    assert absent.status == "not_applicable" and not ran
    assert "resource_limits=False" in absent.detail  # says which capability, not just "skip"
    present = run_check(kit(resource_limits=True), check)
    assert present.status == "pass" and ran == ["x"]


def test_a_check_needing_an_optional_part_is_not_applicable_without_it() -> None:
    """A backend that implements only what `Backend` requires has no warm sandboxes: the
    warm check is not applicable there, and says which part it needs."""
    from orchestrator.backends.base import Backend

    class Plain(Backend):
        name = "plain"
        prepare_image = create = list_sandboxes = remove_sandbox = None  # type: ignore[assignment]

    (warm,) = [c for c in CHECKS if c.needs == "WarmSandboxes"]
    kit = cast(Kit, SimpleNamespace(capabilities=Capabilities(), backend=Plain(), backend_name="x"))
    absent = run_check(kit, warm)
    assert absent.status == "not_applicable" and "needs WarmSandboxes" in absent.detail


def test_the_old_name_of_a_checks_verdict_still_works_with_a_warning() -> None:
    """`orchestrator.testing.Outcome` became `CheckOutcome` (a run's `Outcome` is another
    idea): a backend package's import of the old name keeps working, and is told."""
    import orchestrator.testing as testing

    with pytest.warns(DeprecationWarning, match="now CheckOutcome"):
        old = testing.Outcome  # type: ignore[attr-defined]
    assert old is testing.CheckOutcome
    with pytest.raises(AttributeError):
        testing.NoSuchName  # type: ignore[attr-defined]  # noqa: B018


# ---- real backends -----------------------------------------------------------------------

#: On runc, as the rest of the docker tier; on gVisor the whole kit runs in
#: tests/testing/test_doctor.py (`doctor --sandbox-runtime auto`: gVisor where registered,
#: as in CI), not a second time here.
test_docker = pytest.mark.docker(conformance_tests("docker"))
test_mirror = pytest.mark.docker(conformance_tests("mirror"))

#: Every check but the one that waits out a dead orchestrator's deadline (15 s a backend): a
#: broken copy changes how sandboxes are made, not the keeper inside them, which `test_mirror`
#: and `test_docker` check on the same code.
ALL_BUT_DEADLINE = {c.name for c in CHECKS} - {"deadline.orchestrator_killed"}
#: Each broken copy of the mirror (tests/plugins/orchestrator_broken): the checks it fails,
#: and the checks it runs. The first runs all of them (the kit fails exactly that one and
#: passes all others: a broken promise does not spill into other checks' verdicts); the
#: others, to keep CI short, their own checks and a neighbour that must still pass on the
#: same backend (each check's pass on an unbroken copy is test_mirror's).
BROKEN: dict[str, tuple[set[str], set[str]]] = {
    "mirror-nomemory": ({"limits.memory"}, ALL_BUT_DEADLINE),
    # left behind after any end: a run that ended, and one cancelled
    "mirror-leaky": (
        {"lifecycle.sandbox_removed", "lifecycle.cancel"},
        {"lifecycle.one_sandbox_per_run", "lifecycle.sandbox_removed", "lifecycle.cancel"},
    ),
    # on the default bridge: the host, the metadata address (this machine answers there) and DNS
    "mirror-open": (
        {"egress.none.host", "egress.none.metadata", "egress.none.dns"},
        {"egress.none.host", "egress.none.metadata", "egress.none.dns", "sandbox.no_engine_socket"},
    ),
    "mirror-nopids": ({"limits.pids"}, {"limits.pids", "limits.memory"}),
    "mirror-sharedwarm": ({"warm.one_run"}, {"warm.one_run", "lifecycle.cancel"}),
    # no proxy: the unlisted endpoint reached, nothing recorded; the listed one still reached
    "mirror-openallow": (
        {"egress.allowlist.refused", "egress.allowlist.recorded"},
        {"egress.allowlist.allowed", "egress.allowlist.refused", "egress.allowlist.recorded"},
    ),
    "mirror-unmetered": (
        {"gateway.tokens_measured"},
        {"gateway.key_absent", "gateway.tokens_measured"},
    ),
}


@pytest.mark.docker
@pytest.mark.parametrize("backend", sorted(BROKEN))
def test_a_broken_backend_fails_exactly_the_check_of_its_promise(
    backend: str, agent_image: str, nothing_left: None
) -> None:
    expected, runs = BROKEN[backend]
    with open_kit(backend) as kit:
        outcomes = [run_check(kit, c) for c in CHECKS if c.name in runs]
    for o in outcomes:  # the report, shown when the test fails (and in -s runs)
        print(f"{o.status.upper():15} {o.name:30} {o.detail}")
    failed = {o.name for o in outcomes if o.status == "fail"}
    assert failed == expected
    assert all(o.status == "pass" for o in outcomes if o.name not in failed)
    for o in outcomes:
        if o.status == "fail":
            assert o.fix, o.name  # every failure says what to do


@pytest.mark.docker
def test_the_pytest_plugin_runs_the_kit_for_a_named_backend(
    agent_image: str, nothing_left: None
) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "orchestrator.testing.plugin",
            "-q",
            "--backend-under-test",
            "mirror",
            "-k",
            "forged_end or read_only_root",
            "-p",
            "no:cacheprovider",
        ],
        cwd=REPO / "orchestrator",  # no tests/conftest.py: the plugin alone
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 passed" in out.stdout, out.stdout


@pytest.mark.docker
def test_the_key_check_would_see_a_key_put_into_the_sandbox(
    agent_image: str, nothing_left: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control of `gateway.key_absent`: the same probe, on a run whose key goes into the
    sandbox (--no-gateway), finds it; so its finding nothing through the gateway means it."""
    from orchestrator.testing.gateway import KEY_ENV, KEY_PREFIX, secret_sought
    from orchestrator.testing.model_stub import ModelStub

    key = f"{KEY_PREFIX}control-0123456789abcdef"
    monkeypatch.setenv(KEY_ENV, key)
    stub = ModelStub()
    try:
        with open_kit("docker") as kit:
            result = kit.run(
                "control",
                "find",
                secret_sought(key),
                model="openai:conformance",
                api_base=stub.api_base(),
                network=None,
                gateway=False,
            )
            found = kit.answer(result)["found"]
    finally:
        stub.close()
    assert any(place.endswith("/mem") for place in found), found  # the model holds it


@pytest.mark.docker
def test_a_kit_removes_what_a_leaky_backend_left_and_its_probe(
    agent_image: str, nothing_left: None
) -> None:
    with open_kit("mirror-leaky") as kit:
        result = kit.run("ok", "ok")
        assert kit.left_of(result.run_id)  # the broken backend left its sandbox...
        folder = kit.folder
    assert not kit.left_of(result.run_id)  # ...and the kit removed it
    assert not folder.exists()


def test_the_probe_sees_ptrace_and_vsock_where_nothing_refuses_them(tmp_path: Path) -> None:
    """The control of `sandbox.ptrace_refused` and `sandbox.vsock_refused`: the probe's own
    functions, run in this process (no seccomp filter here), see both allowed; so a sandbox's
    "refused" is the filter's doing, not the probe's blindness."""
    module = write_probe(tmp_path) / "probe.py"
    spec = importlib.util.spec_from_file_location("conformance_probe_here", module)
    assert spec is not None and spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    assert probe.ptrace() == {"allowed": True, "errno": None}
    if not Path("/dev/vsock").exists():
        pytest.skip("this host has no vsock device: AF_VSOCK is refused here by the kernel alone")
    assert probe.vsock() == {"allowed": True, "errno": None}


@pytest.mark.docker
def test_a_shipping_check_fails_when_the_payload_is_shipped(
    agent_image: str, nothing_left: None
) -> None:
    """The control of the shipping checks: the same check, given a payload with nothing to
    refuse (a regular file inside it), sees the run go ahead and fails."""
    from orchestrator.testing.kit import CheckFailed
    from orchestrator.testing.runs import refused

    def harmless(folder: Path) -> None:
        (folder / "notes.txt").write_text("inside the folder")

    with open_kit("docker") as kit, pytest.raises(CheckFailed, match="was shipped"):
        refused(kit, "a regular file", harmless)
