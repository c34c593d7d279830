"""gVisor sandboxes run by runsc itself (`--sandbox-runtime runsc-direct`,
orchestrator/backends/docker/runsc_direct/), against the real runsc and engine: two runs
restored from one snapshot share nothing, no secret is in a snapshot, and a restored sandbox
stops at its time limit, when cancelled and when its orchestrator was SIGKILLed, leaving
nothing behind (no sandbox record, cgroup or runsc state); and the conformance kit, whole,
networked runs included (in a holder container's network namespace). Every run asks for runsc-direct
itself, so these tests carry no `gvisor` mark; they skip without runsc or without root (the
sandbox's cgroup is made by us)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator import RunResult
from orchestrator.backends.docker.runsc_direct import bundle, cgroup, records
from orchestrator.backends.docker.runsc_direct.binary import state_root
from orchestrator.backends.docker.runsc_direct.snapshot import SNAPSHOTS_DIR, find
from orchestrator.testing import CHECKS, Kit, run_check
from tests.backends.docker.test_snapshots import checkpoint_bytes
from tests.backends.docker.test_snapshots import probe_run as snapshots_probe_run
from tests.conftest import cli, files_holding

RUNTIME = "runsc-direct"


@pytest.fixture(scope="module")
def runsc_here() -> None:
    if shutil.which("runsc") is None:
        pytest.skip("no runsc on PATH (setup-gvisor.sh)")
    if os.geteuid() != 0:
        pytest.skip("runsc-direct makes each sandbox's cgroup: root only")


def nothing_of_ours_left() -> list[str]:
    """This path's sandbox records, cgroups and runsc container states still there."""
    left = [f"record {r.id}" for r in records.list_records({})]
    # this store's only: another test session on the host has cgroups of its own
    left += [f"cgroup {name}" for name in cgroup.leftovers() if records.of_this_store(name)]
    left += [f"runsc state {p.name}" for p in state_root().iterdir()]
    return left


@pytest.fixture
def leaves_nothing(runsc_here: None, no_leftovers) -> Iterator[None]:
    yield
    assert not nothing_of_ours_left()


def probe_run(folder: Path, secret: str, **options: Any) -> tuple[RunResult, dict]:
    """test_snapshots' probe, on runsc-direct."""
    return snapshots_probe_run(folder, secret, runtime=RUNTIME, **options)


def test_two_runs_restored_from_one_snapshot_share_nothing(
    agent_image: str, leaves_nothing: None, tmp_path: Path
) -> None:
    """Both runs are new containers restored from the same snapshot, yet each has its own
    random state and entropy, sees nothing the other left in /tmp, and the snapshot (and
    the image's exported root beside it) holds neither run's secret nor run id."""
    first, held_first = probe_run(tmp_path, "direct-s3cret-FIRST-4411")
    second, held_second = probe_run(tmp_path, "direct-s3cret-SECOND-9025")
    for result in (first, second):
        assert result.status == "succeeded", (result.error, result.output)
        assert result.sandbox.get("requested") == RUNTIME, result.sandbox
    key = first.sandbox.get("snapshot")
    assert key and second.sandbox.get("snapshot") == key, (first.sandbox, second.sandbox)
    assert held_first["random"] != held_second["random"]
    assert held_first["urandom"] != held_second["urandom"]
    assert not [name for name in held_second["seen_in_tmp"] if name.startswith("mark-")]
    (exported,) = [b for b in bundle.list_bundles() if find(b, key) is not None]
    snapshot = find(exported, key)
    assert snapshot is not None
    held = checkpoint_bytes(snapshot.checkpoint)
    assert b"smolagents" in held  # the process's memory, readable
    for needle in ("direct-s3cret-FIRST-4411", "direct-s3cret-SECOND-9025", "SNAP_SECRET"):
        assert needle.encode() not in held, needle
        assert not files_holding(needle, exported.folder / SNAPSHOTS_DIR), needle
    for run_id in (first.run_id, second.run_id):
        assert run_id.encode() not in held, run_id


def test_a_snapshot_runsc_cannot_restore_is_made_again(
    agent_image: str, leaves_nothing: None, tmp_path: Path
) -> None:
    """A broken checkpoint: the run ends `infra_error` saying runsc could not restore it (a
    batch retries those), the snapshot goes, and the next run makes it again and runs."""
    made, _ = probe_run(tmp_path, "direct-s3cret-MAKE-1357")
    key = made.sandbox.get("snapshot")
    (exported,) = [b for b in bundle.list_bundles() if find(b, key) is not None]
    broken = find(exported, key)
    assert broken is not None
    (broken.checkpoint / "checkpoint.img").write_bytes(b"not a checkpoint")
    failed, _ = probe_run(tmp_path, "direct-s3cret-BROKEN-2468")
    assert failed.status == "infra_error", (failed.status, failed.error)
    assert failed.error is not None and "could not restore" in failed.error.message
    assert find(exported, key) is None
    again, held = probe_run(tmp_path, "direct-s3cret-AGAIN-3579")
    assert again.status == "succeeded" and held, (again.error, again.output)
    assert again.sandbox.get("snapshot") == key


def test_with_snapshots_off_a_run_starts_cold(
    agent_image: str, leaves_nothing: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$ORCHESTRATOR_SNAPSHOTS=off, as on the engine path: `runsc run`, no snapshot."""
    monkeypatch.setenv("ORCHESTRATOR_SNAPSHOTS", "off")
    result, held = probe_run(tmp_path, "direct-s3cret-COLD-8642")
    assert result.status == "succeeded" and held, (result.error, result.output)
    assert result.sandbox.get("requested") == RUNTIME and "snapshot" not in result.sandbox


def test_a_restored_run_stops_at_its_time_limit(
    agent_image: str, leaves_nothing: None, tmp_path: Path
) -> None:
    result, held = probe_run(tmp_path, "direct-s3cret-SLOW-7710", args=("120",), timeout=4)
    assert held, result.output  # it ran, restored
    assert result.status == "timed_out", (result.status, result.error)
    assert result.timings["duration"] < 20, result.timings


def test_network_open_is_refused_before_any_sandbox(runsc_here: None, tmp_path: Path) -> None:
    """An `open` run on runsc-direct: exit 2 with the cause and the fix, nothing made."""
    program = tmp_path / "hello.py"
    program.write_text("print('hello')\n")
    done = cli("run", "--sandbox-runtime", RUNTIME, "--network", "open", str(program))
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "does not run sandboxes on network 'open' yet" in done.stderr, done.stderr
    assert "--sandbox-runtime auto" in done.stderr
    assert "record:" not in done.stderr  # refused while prepared: no run, no record


#: The kit's checks, every one: what a sandbox on this path must keep, networked ones
#: (allowlist, gateway) in a holder container's network namespace.
CHECKED = tuple(c.name for c in CHECKS)


@pytest.fixture(scope="module")
def kit(runsc_here: None, docker_client) -> Iterator[Kit]:
    made = Kit("docker", runtime=RUNTIME)
    yield made
    made.close()
    assert not nothing_of_ours_left()


@pytest.mark.parametrize("name", CHECKED)
def test_the_kits_checks_pass_on_runsc_direct(name: str, kit: Kit) -> None:
    (check,) = [c for c in CHECKS if c.name == name]
    outcome = run_check(kit, check)
    assert outcome.status == "pass", (outcome.detail, outcome.fix)
