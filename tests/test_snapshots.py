"""gVisor sandboxes restored from a snapshot (orchestrator/backends/docker/snapshots.py): when
the engine can, what a restored run has of its own, what a snapshot holds, and the deadline
of a restored sandbox. The decisions and the keeper's clock run without an engine; the
restores need gVisor with the engine's experimental mode (`docker checkpoint`)."""

from __future__ import annotations

import json
import struct
import time
import zlib
from pathlib import Path

import pytest

from orchestrator import RunResult, RunSpec, run
from orchestrator.backends.base import SandboxSpec
from orchestrator.backends.docker import DockerBackend, snapshots
from orchestrator.backends.docker.runtimes import RUNC, RUNSC, RUNSC_NET, Placement
from orchestrator.spec import Limits, NetworkPolicy
from orchestrator_runtime.deadline import FROZEN_AFTER, IDLE_SLICE, Deadline

from .conftest import cli, files_holding

#: A program that says what its sandbox holds that another run's could have left or shared:
#: its random state, fresh entropy, what is in /tmp (it leaves a file there, holding its
#: secret), and sleeps as long as its first argument asks.
PROBE = """\
# /// script
# [tool.orchestrator.secrets]
# required = ["SNAP_SECRET"]
# ///
import json, os, random, sys, time
from pathlib import Path

seen = sorted(p.name for p in Path("/tmp").iterdir())
Path("/tmp", f"mark-{random.random()}").write_text(os.environ["SNAP_SECRET"])
held = {"random": random.random(), "urandom": os.urandom(8).hex(), "seen_in_tmp": seen}
print("probe " + json.dumps(held), flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""

#: What `docker info` says of an engine that can checkpoint (the fields the decision reads).
CAN = {"ExperimentalBuild": True, "SecurityOptions": ["name=seccomp,profile=default"]}


def spec_of(network: str = "none") -> SandboxSpec:
    return SandboxSpec("r-1", "img", ("python",), Limits(), NetworkPolicy(mode=network))


def test_only_gvisor_without_network_is_covered() -> None:
    """runc (CRIU fails on these kernels) and networked gVisor (hostinet cannot be
    checkpointed) start cold without a word; gVisor under `none` is covered."""
    gvisor = Placement("runsc", RUNSC, "auto")
    assert snapshots.covered(spec_of(), gvisor)
    assert not snapshots.covered(spec_of(), Placement("runc", RUNC, "auto"))
    assert not snapshots.covered(spec_of("allowlist"), Placement("runsc", RUNSC_NET, "auto"))


def test_an_engine_without_experimental_mode_starts_cold_and_says_why() -> None:
    assert snapshots.engine_cannot(CAN, data_root_writable=True) is None
    said = snapshots.engine_cannot({**CAN, "ExperimentalBuild": False}, data_root_writable=True)
    assert said is not None and "experimental mode is off" in said
    assert "enable-checkpoints.sh" in said
    rootless = {**CAN, "SecurityOptions": ["name=seccomp,profile=default", "name=rootless"]}
    assert "rootless" in (snapshots.engine_cannot(rootless, data_root_writable=True) or "")
    assert "data root" in (snapshots.engine_cannot(CAN, data_root_writable=False) or "")


def test_the_cold_start_is_said_once_per_command(capsys: pytest.CaptureFixture[str]) -> None:
    snapshots._said_once.clear()
    snapshots.say_cold_once("the engine's experimental mode is off")
    snapshots.say_cold_once("something else")
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "orchestrator: gVisor sandboxes start cold (no snapshot): the engine's experimental "
        "mode is off"
    ]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_restored_keeper_starts_its_idle_time_again_and_a_run_never_moves() -> None:
    """The keeper of a snapshot's sandbox waits in slices while idle; woken long after its
    last wait (frozen in a checkpoint, restored later), it gives the restored sandbox its
    whole idle time again. Once the run has begun, its deadline stands."""
    clock = Clock()
    deadline = Deadline(clock() + 60, restorable_idle=60, clock=clock)
    assert deadline.wait_time() == IDLE_SLICE
    clock.now += IDLE_SLICE
    assert deadline.wait_time() == IDLE_SLICE  # on time: not a restore
    clock.now += 3600  # checkpointed, restored an hour later
    assert deadline.wait_time() == IDLE_SLICE
    assert deadline.at == clock.now + 60
    restored = clock.now
    while (wait := deadline.wait_time()) > 0:  # woken on time, slice after slice
        clock.now += wait
    assert clock.now == pytest.approx(restored + 60)  # then stopped at its idle deadline
    deadline.begin_run(30)
    clock.now += 3600  # a frozen run is not given more time
    assert deadline.wait_time() < 0


def test_a_plain_idle_keeper_is_never_moved_by_a_late_wake() -> None:
    clock = Clock()
    deadline = Deadline(clock() + 60, clock=clock)
    assert deadline.wait_time() == 60
    clock.now += 60 + FROZEN_AFTER * 10
    assert deadline.wait_time() < 0


@pytest.fixture(scope="module")
def checkpoints(docker_client) -> None:
    """gVisor registered and the engine in experimental mode, or the restore tests skip (the
    decision that sends such engines cold is tested above without one)."""
    info = docker_client.api.info()
    if RUNSC not in (info.get("Runtimes") or {}):
        pytest.skip("gVisor is not registered with this engine (setup-gvisor.sh)")
    if not info.get("ExperimentalBuild"):
        pytest.skip("the engine's experimental mode is off (scripts/enable-checkpoints.sh)")


def probe_run(
    folder: Path, secret: str, *, args: tuple[str, ...] = (), timeout: float = 60
) -> tuple[RunResult, dict]:
    program = folder / "probe.py"
    program.write_text(PROBE)
    env = folder / f"{secret}.env"
    env.write_text(f"SNAP_SECRET={secret}\n")
    spec = RunSpec(
        payload=program,
        sandbox_runtime="runsc",
        network="none",
        env_file=env,
        program_args=args,
        timeout_seconds=timeout,
    )
    result = run(spec, backend=DockerBackend())
    line = next((x for x in (result.output or "").splitlines() if x.startswith("probe ")), "")
    return result, json.loads(line.removeprefix("probe ") or "{}")


@pytest.mark.gvisor
def test_two_runs_restored_from_one_snapshot_share_nothing(
    agent_image: str, checkpoints: None, tmp_path: Path, no_leftovers
) -> None:
    """Both runs start from the same snapshot, yet each has its own random state and
    entropy, sees nothing the other left in /tmp, and the snapshot holds neither run's
    secret nor run id."""
    first, held_first = probe_run(tmp_path, "snap-s3cret-FIRST-4411")
    second, held_second = probe_run(tmp_path, "snap-s3cret-SECOND-9025")
    for result in (first, second):
        assert result.status == "succeeded", (result.error, result.output)
    snapshot = first.sandbox.get("snapshot")
    assert snapshot and second.sandbox.get("snapshot") == snapshot, (first.sandbox, second.sandbox)
    assert held_first["random"] != held_second["random"]
    assert held_first["urandom"] != held_second["urandom"]
    assert not [name for name in held_second["seen_in_tmp"] if name.startswith("mark-")]
    found = snapshots.find(snapshot)
    assert found is not None
    held = checkpoint_bytes(found.checkpoint)
    assert b"smolagents" in held  # the process's memory, readable
    for needle in ("snap-s3cret-FIRST-4411", "snap-s3cret-SECOND-9025", "SNAP_SECRET"):
        assert needle.encode() not in held, needle
        assert not files_holding(needle, found.folder), needle
    for run_id in (first.run_id, second.run_id):
        assert run_id.encode() not in held, run_id
    listed = json.loads(cli("images", "list", "--json").stdout)
    assert {"tag": f"snapshot:{snapshot}", "image": agent_image} in [
        {"tag": row["tag"], "image": row.get("image")} for row in listed
    ]


def checkpoint_bytes(folder: Path) -> bytes:
    """Everything a gVisor checkpoint holds (kernel state and memory), uncompressed: each
    file is runsc's state file, `gVisorSF`, an 8-byte metadata length, the metadata (JSON),
    its 32-byte HMAC, the chunk size (4 bytes), then chunks of a 4-byte length and raw
    deflate data. Searched compressed, a secret would never be found."""
    held = []
    for path in sorted(folder.iterdir()):
        data = path.read_bytes()
        assert data[:8] == b"gVisorSF", path
        at = 16 + struct.unpack(">Q", data[8:16])[0] + 32 + 4
        while at < len(data):
            size = struct.unpack(">I", data[at : at + 4])[0]
            chunk = zlib.decompressobj(-15)
            held.append(chunk.decompress(data[at + 4 : at + 4 + size]))
            assert chunk.eof, f"{path}: a chunk at {at} is not whole deflate data"
            at += 4 + size
    return b"".join(held)


@pytest.mark.gvisor
def test_a_restored_run_stops_at_its_time_limit_and_is_removed(
    agent_image: str, checkpoints: None, tmp_path: Path, no_leftovers
) -> None:
    started = time.monotonic()
    result, held = probe_run(tmp_path, "snap-s3cret-SLOW-7710", args=("120",), timeout=4)
    took = time.monotonic() - started
    assert result.sandbox.get("snapshot"), result.sandbox
    assert held, result.output  # it ran, restored, before its time ran out
    assert result.status == "timed_out", result.error
    assert took < 30, took
    assert not no_leftovers()


def test_only_whole_snapshots_are_listed_each_with_its_image() -> None:
    """A snapshot's folder counts once its metadata is written (made in a `.partial` folder
    and renamed); `images list` shows it with the image it was made of."""
    from orchestrator.backends.docker.prune import KIND_SNAPSHOT, snapshot_row

    root = snapshots.snapshots_root()
    whole, half = root / "0123456789abcdef", root / "fedcba9876543210"
    for folder in (whole, half):
        (folder / "checkpoint").mkdir(parents=True)
    meta = {"image": "orchestrator-agent:x", "created": 1.0e9, "size": 11 << 20}
    (whole / snapshots.META_FILE).write_text(json.dumps(meta))
    try:
        found = {s.id: s for s in snapshots.list_snapshots()}  # the session's others too
        assert whole.name in found and half.name not in found
        row = snapshot_row(found[whole.name])
        assert (row["kind"], row["image"], row["size"]) == (KIND_SNAPSHOT, meta["image"], 11 << 20)
        assert row["tag"] == f"snapshot:{whole.name}"
    finally:
        for folder in (whole, half):
            snapshots.remove(snapshots.Snapshot(folder.name, folder, {}))


@pytest.mark.gvisor
def test_a_restored_sandbox_stops_by_itself_when_no_host_watches(
    agent_image: str, checkpoints: None, tmp_path: Path, no_leftovers
) -> None:
    """The keeper restored with the runtime holds the run's deadline alone (as if every
    orchestrator process had died after the start): time limit + grace after the request
    was read, exit 124."""
    from orchestrator.backends.docker.deadline import GRACE_SECONDS
    from orchestrator.lifecycle.prepared import prepare
    from orchestrator.lifecycle.request import build_request, sandbox_spec
    from orchestrator_runtime.deadline import DEADLINE_EXIT_CODE

    program = tmp_path / "probe.py"
    program.write_text(PROBE)
    (tmp_path / "s.env").write_text("SNAP_SECRET=snap-s3cret-ALONE-5150\n")
    spec = RunSpec(
        payload=program,
        sandbox_runtime="runsc",
        network="none",
        env_file=tmp_path / "s.env",
        program_args=("120",),
        timeout_seconds=1,
    )
    prepared = prepare(spec)
    backend = DockerBackend()
    sandbox = backend.create(sandbox_spec(prepared, agent_image), lambda _: None)
    try:
        assert sandbox.restored_from
        sandbox.start(build_request(prepared), dict(prepared.secrets))
        started = time.monotonic()
        ended = sandbox.wait(timeout=60)  # nobody supervises it
        took = time.monotonic() - started
    finally:
        sandbox.remove()
    assert ended.exit_code == DEADLINE_EXIT_CODE, ended
    assert 1 + GRACE_SECONDS - 1 < took < 1 + GRACE_SECONDS + 5, took


@pytest.mark.gvisor
def test_an_old_snapshot_restores_and_a_broken_one_starts_the_run_cold(
    agent_image: str,
    checkpoints: None,
    tmp_path: Path,
    no_leftovers,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An old snapshot restores (its keeper, frozen past the end of its last wait, wakes
    late: what every snapshot older than a few seconds does). One the engine cannot restore
    (its state file cut short) costs the run nothing but its speed: it starts cold, the
    command says so once, and the broken snapshot is removed so that the next run makes a
    good one."""
    made, _ = probe_run(tmp_path, "snap-s3cret-MADE-1212")
    snapshot = snapshots.find(made.sandbox["snapshot"])
    assert snapshot is not None
    while time.time() - snapshot.meta["created"] < IDLE_SLICE + FROZEN_AFTER + 1:
        time.sleep(0.2)  # until the keeper's wait in the snapshot has long ended
    old, _ = probe_run(tmp_path, "snap-s3cret-OLD-5656")
    assert old.status == "succeeded", (old.error, old.output)
    assert old.sandbox.get("snapshot") == snapshot.id
    for state_file in snapshot.checkpoint.iterdir():
        state_file.write_bytes(state_file.read_bytes()[:4096])
    snapshots._said_once.clear()
    capsys.readouterr()
    cold, held = probe_run(tmp_path, "snap-s3cret-COLD-3434")
    assert cold.status == "succeeded", (cold.error, cold.output)
    assert "snapshot" not in cold.sandbox and held
    said = [line for line in capsys.readouterr().err.splitlines() if "start cold" in line]
    assert len(said) == 1 and "could not be restored" in said[0], said
    assert snapshots.find(snapshot.id) is None
