"""gVisor sandboxes restored from a snapshot (orchestrator/backends/docker/snapshots.py): when
the engine can, what a restored run has of its own, what a snapshot holds, and the deadline
of a restored sandbox. The decisions and the keeper's clock run without an engine; the
restores need gVisor with the engine's experimental mode (`docker checkpoint`). Every restore
asks for gVisor itself (`sandbox_runtime="runsc"`), so these tests carry no `gvisor` mark: the
docker tier already runs them on gVisor, and CI's gVisor tier would only repeat them."""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
import zlib
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator import Pool, RunResult, RunSpec, run
from orchestrator.backends.base import SandboxSpec
from orchestrator.backends.docker import DockerBackend, snapshot_store, snapshots
from orchestrator.backends.docker.runtimes import RUNC, RUNSC, RUNSC_NET, Placement
from orchestrator.errors import ConfigError
from orchestrator.spec import Limits, NetworkPolicy
from orchestrator_runtime.deadline import FROZEN_AFTER, IDLE_SLICE, Deadline
from tests.conftest import cli, events_of, files_holding, wait_for

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


def test_only_our_unpacked_checkpoints_of_gone_or_restored_containers_are_removed(
    tmp_path: Path,
) -> None:
    """containerd unpacks each restored checkpoint into a temp folder and never removes it:
    ours (they hold RESTORED_INTO) go once their container runs or is gone; a folder
    without the file (someone else's restore, or one being unpacked) stays."""
    containers = tmp_path / "containers"
    alive, gone, restored = ("a" * 64, "b" * 64, "d" * 64)
    (containers / alive).mkdir(parents=True)
    (containers / restored).mkdir()
    folders = {}
    cases = [("a", alive), ("b", gone), ("c", None), ("d", restored), ("e", gone[:40])]
    for name, into in cases:
        folder = folders[name] = tmp_path / f"{snapshots.EXTRACTED_PREFIX}{name}"
        folder.mkdir()
        (folder / "checkpoint.img").write_bytes(b"gVisorSF")
        if into is not None:
            (folder / snapshots.RESTORED_INTO).write_text(into)
    removed = snapshots.remove_extracted(containers, restored, roots=[tmp_path])
    assert removed == 2  # "e": a partial id, read while containerd writes it, stays
    assert {name for name, folder in folders.items() if folder.exists()} == {"a", "c", "e"}
    assert snapshots.remove_extracted(containers, roots=[tmp_path]) == 0


def fake_snapshot(name: str, used: float) -> None:
    folder = snapshot_store.snapshots_root() / name
    (folder / "checkpoint").mkdir(parents=True)
    (folder / snapshot_store.META_FILE).write_text(json.dumps({"id": name}))
    os.utime(folder / snapshot_store.META_FILE, (used, used))


def test_snapshots_beyond_the_kept_number_go_least_recently_used_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each image, limits and time-to-live has its snapshot (~13 MB): a state directory
    keeps the most recently used few, and never removes one a restore may be copying."""
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path))
    now = time.time()
    for name, age in [("old", 5000), ("older", 9000), ("recent", 10), ("oldish", 1000)]:
        fake_snapshot(name, now - age)
    assert snapshot_store.evict(2, now=now) == ["old", "older"]
    assert [s.id for s in snapshot_store.list_snapshots()] == ["oldish", "recent"]
    fake_snapshot("also-recent", now - 20)
    assert snapshot_store.evict(1, now=now) == ["oldish"]  # the two in use stay beyond 1
    assert [s.id for s in snapshot_store.list_snapshots()] == ["also-recent", "recent"]
    snapshot_store.mark_used(snapshot_store.find("also-recent"))  # type: ignore[arg-type]
    assert snapshot_store.evict(1, now=now + snapshot_store.RECENT_USE + 15) == ["recent"]


def test_the_number_of_snapshots_kept_has_a_default_and_refuses_nonsense(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(snapshot_store.KEEP_ENV, raising=False)
    assert snapshot_store.keep_count() == snapshot_store.DEFAULT_KEEP
    monkeypatch.setenv(snapshot_store.KEEP_ENV, "3")
    assert snapshot_store.keep_count() == 3
    for bad in ("0", "-2", "many", "2.5"):
        monkeypatch.setenv(snapshot_store.KEEP_ENV, bad)
        with pytest.raises(ConfigError) as caught:
            snapshot_store.keep_count()
        assert snapshot_store.KEEP_ENV in caught.value.cause and repr(bad) in caught.value.cause
        assert caught.value.exit_code == 2


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


def test_the_runtimes_word_restarts_a_restored_keepers_idle_time_once_and_only_while_idle() -> None:
    """Restored soon after the checkpoint (no late wake to notice), the keeper hears it from
    the runtime: its whole idle time starts again from then, once; the word is ignored by a
    keeper that is not restorable, and once the run has begun."""
    clock = Clock()
    deadline = Deadline(clock() + 60, restorable_idle=60, clock=clock)
    clock.now += 50  # the snapshot's maker spent 50 s of its idle time
    deadline.restart_idle()
    assert deadline.at == clock.now + 60
    clock.now += 30
    deadline.restart_idle()  # a second word counts for nothing
    assert deadline.at == clock.now + 30
    deadline.begin_run(10)
    deadline.restart_idle()
    assert deadline.at == clock.now + 10

    plain = Deadline(clock() + 60, clock=clock)
    clock.now += 50
    plain.restart_idle()
    assert plain.at == clock.now + 10


def test_the_runtime_tells_the_keeper_on_its_pipe_restored_then_run_begun(monkeypatch) -> None:
    """Over a real pipe: a restored runtime, when the host's restore line came, writes
    RESTORED_BYTE and keeps the pipe; the keeper's thread restarts its idle time and reads
    on; the run's byte then starts the run's deadline and the runtime closes the pipe."""
    import io
    import select
    import sys

    from orchestrator_runtime.deadline import KEEPER_FD_ENV, RESTORABLE_ENV
    from orchestrator_runtime.idle import await_restore, start_deadline
    from orchestrator_runtime.protocol import RESTORED_LINE

    clock = Clock()
    deadline = Deadline(clock() + 60, restorable_idle=60, clock=clock)
    wake, handed = os.pipe()
    end = os.dup(wake)  # to see the write end closed: readable, with nothing to read
    monkeypatch.setenv(KEEPER_FD_ENV, str(handed))
    monkeypatch.setenv(RESTORABLE_ENV, "1")
    request = b'{"the": "request"}'
    stdin = io.TextIOWrapper(io.BytesIO(RESTORED_LINE.encode() + request))
    monkeypatch.setattr(sys, "stdin", stdin)
    deadline.watch(wake, run_seconds=30)
    clock.now += 50  # the maker's idle time, spent before the checkpoint
    await_restore()
    wait_for(lambda: deadline.at == clock.now + 60, timeout=10, interval=0.01)
    assert sys.stdin.buffer.read() == request  # the request stays for read_request
    assert os.environ[KEEPER_FD_ENV] == str(handed)  # the pipe stays open for the run's byte
    clock.now += 5
    start_deadline()
    wait_for(lambda: deadline.running, timeout=10, interval=0.01)
    assert deadline.at == clock.now + 30
    assert KEEPER_FD_ENV not in os.environ
    try:
        assert select.select([end], [], [], 10)[0], "the runtime's end of the pipe is open"
        assert os.read(end, 1) == b""  # closed before any payload code exists
    finally:
        os.close(end)


@pytest.mark.parametrize("asks", [False, True], ids=["restored", "restored-say-when"])
def test_the_runtime_says_its_restore_is_over_when_asked(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], asks: bool
) -> None:
    """runsc-direct's restore line asks the runtime to say when it has reseeded
    (RESTORE_DONE_LINE on stderr, which the host waits for before the run's CPU limit and
    the request); the engine path's does not, and hears nothing."""
    import io
    import sys

    from orchestrator_runtime.deadline import KEEPER_FD_ENV, RESTORABLE_ENV
    from orchestrator_runtime.idle import await_restore
    from orchestrator_runtime.protocol import RESTORE_DONE_LINE, RESTORED_ACK_LINE, RESTORED_LINE

    monkeypatch.delenv(KEEPER_FD_ENV, raising=False)
    monkeypatch.setenv(RESTORABLE_ENV, "1")
    line = RESTORED_ACK_LINE if asks else RESTORED_LINE
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(line.encode() + b"{}")))
    await_restore()
    assert (capfd.readouterr().err == RESTORE_DONE_LINE) == asks
    assert sys.stdin.buffer.read() == b"{}"  # the request stays for read_request


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
    folder: Path,
    secret: str,
    *,
    args: tuple[str, ...] = (),
    timeout: float = 60,
    runtime: str = "runsc",
    cpus: float | None = None,
) -> tuple[RunResult, dict]:
    """PROBE run on `runtime` with `secret` (and `cpus`, else the default), and what it
    printed of its sandbox."""
    # Each call its own folder: runs started at once must not rewrite one file while
    # another run reads it (an empty program, or one whose secrets were not declared).
    folder = folder / secret
    folder.mkdir()
    program = folder / "probe.py"
    program.write_text(PROBE)
    env = folder / f"{secret}.env"
    env.write_text(f"SNAP_SECRET={secret}\n")
    spec = RunSpec(
        payload=program,
        sandbox_runtime=runtime,
        network="none",
        env_file=env,
        program_args=args,
        timeout_seconds=timeout,
        cpus=cpus,
    )
    result = run(spec, backend=DockerBackend())
    line = next((x for x in (result.output or "").splitlines() if x.startswith("probe ")), "")
    return result, json.loads(line.removeprefix("probe ") or "{}")


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
    found = snapshot_store.find(snapshot)
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


def test_a_warm_pool_fills_from_the_snapshot(
    agent_image: str, checkpoints: None, tmp_path: Path, no_leftovers
) -> None:
    """Pooled sandboxes (batches, `schedule serve`, cluster nodes) are restored from a
    snapshot as single runs are: the pool's two builders do not race to make it (one makes
    it, the other waits and restores), each warm run says so and has its own random state
    and entropy, and the pool leaves nothing when it closes."""
    from orchestrator.lifecycle.prepared import prepare

    program = tmp_path / "probe.py"
    program.write_text(PROBE)
    (tmp_path / "s.env").write_text("SNAP_SECRET=snap-s3cret-POOL-8080\n")
    spec = RunSpec(
        payload=program, sandbox_runtime="runsc", network="none", env_file=tmp_path / "s.env"
    )
    with Pool(size=2, ttl=90) as pool:  # its own snapshot: the idle time differs
        pool.keep_ready(prepare(spec))
        wait_for(lambda: pool.stats()["idle"] == 2, timeout=120)
        results = [pool.run(spec) for _ in range(2)]
    held = []
    for result in results:
        assert result.status == "succeeded", (result.error, result.output)
        assert result.warm and result.sandbox.get("snapshot"), result.sandbox
        line = next(x for x in (result.output or "").splitlines() if x.startswith("probe "))
        held.append(json.loads(line.removeprefix("probe ")))
    assert held[0]["random"] != held[1]["random"]
    assert held[0]["urandom"] != held[1]["urandom"]
    assert not no_leftovers()


def test_a_restored_warm_sandbox_nobody_takes_stops_at_its_time_to_live(
    agent_image: str, checkpoints: None, docker_client, tmp_path: Path, no_leftovers
) -> None:
    """Nothing outlives its deadline, restored warm sandboxes included: with the host alive
    but doing nothing, a pooled sandbox restored from a snapshot stops by itself (its keeper,
    exit 124) its whole time-to-live after its restore, no more: the first restored just
    after the snapshot was made (its keeper told by the runtime, since no late wake shows
    the freeze), the other from an older snapshot (its keeper also finds it was frozen)."""
    from orchestrator.backends.docker.engine import engine_time
    from orchestrator.lifecycle.prepared import prepare
    from orchestrator.lifecycle.request import sandbox_spec
    from orchestrator_runtime.deadline import DEADLINE_EXIT_CODE

    program = tmp_path / "quiet.py"
    program.write_text("print('never run')\n")
    ttl = 12.0
    prepared = prepare(RunSpec(payload=program, sandbox_runtime="runsc", network="none"))
    backend = DockerBackend(docker_client)
    fresh = backend.create_idle(sandbox_spec(prepared, agent_image), lambda _: None, ttl)
    older = None
    try:
        assert fresh.restored_from, "the pooled sandbox was not restored"
        snapshot = snapshot_store.find(fresh.restored_from)
        assert snapshot is not None
        while time.time() - snapshot.meta["created"] < IDLE_SLICE + FROZEN_AFTER + 1:
            time.sleep(0.2)  # until a keeper in the snapshot would wake late
        later = sandbox_spec(replace(prepared, run_id=prepared.run_id + "-o"), agent_image)
        older = backend.create_idle(later, lambda _: None, ttl)
        assert older.restored_from == snapshot.id
        lived = {}
        for sandbox in (fresh, older):
            state = wait_for(
                lambda s=sandbox: (
                    (st := docker_client.api.inspect_container(s.id)["State"])["Running"] is False
                    and st
                ),
                timeout=ttl + IDLE_SLICE + 30,
            )
            assert state["ExitCode"] == DEADLINE_EXIT_CODE, state
            lived[sandbox.id] = engine_time(state["FinishedAt"]) - engine_time(state["StartedAt"])
    finally:
        fresh.remove()
        if older is not None:
            older.remove()
    # From the restore line, written as soon as the engine started the restored container;
    # the snapshot's maker spent `took` of the keeper's idle time, which must not count.
    for sandbox_id, seconds in lived.items():
        assert ttl - 1 <= seconds <= ttl + IDLE_SLICE, (sandbox_id, lived, snapshot.meta["took"])
    assert not no_leftovers()


def test_a_restore_leaves_nothing_in_the_engines_temp_folder(
    agent_image: str, checkpoints: None, tmp_path: Path, no_leftovers
) -> None:
    """containerd unpacks the checkpoint of every restore into a temp folder (about 13 MB)
    and never removes it: the restore removes its own, and those a killed process left
    (planted here: one naming a container that no longer exists)."""
    planted = Path("/tmp") / f"{snapshots.EXTRACTED_PREFIX}-left-by-a-killed-run"  # looked at
    planted.mkdir(exist_ok=True)
    (planted / snapshots.RESTORED_INTO).write_text("0" * 64)
    try:
        probe_run(tmp_path, "snap-s3cret-MAKE-1357")  # the snapshot, made
        result, held = probe_run(tmp_path, "snap-s3cret-TEMP-2468")
        assert result.status == "succeeded" and held and result.sandbox.get("snapshot"), result
        created = next(e for e in events_of(result) if e["type"] == "sandbox_created")
        assert not [
            folder
            for base in snapshots.extracted_roots()
            for folder in base.glob(f"{snapshots.EXTRACTED_PREFIX}*")
            if snapshots.unpacked_for(folder) == created["sandbox_id"]
        ]
        assert not planted.exists()
    finally:
        shutil.rmtree(planted, ignore_errors=True)  # when the assertion above failed
    assert not no_leftovers()


def test_runs_restored_at_the_same_moment_all_run(
    agent_image: str, checkpoints: None, tmp_path: Path, no_leftovers
) -> None:
    """Three runs restored from one snapshot at once (as a batch starts them): the engine
    uploads the same checkpoint for each and refuses all but one ("already exists"); each
    is started again and runs, restored, rather than hang or go cold."""
    from concurrent.futures import ThreadPoolExecutor

    probe_run(tmp_path, "snap-s3cret-FIRST-2468")  # the snapshot, made
    secrets = [f"snap-s3cret-SAME-{i}" for i in range(3)]
    with ThreadPoolExecutor(3) as threads:
        done = list(threads.map(lambda secret: probe_run(tmp_path, secret), secrets))
    for result, held in done:
        assert result.status == "succeeded", (result.error, result.output)
        assert result.sandbox.get("snapshot") and held, result.sandbox
    assert len({held["random"] for _, held in done}) == 3
    assert not no_leftovers()


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

    root = snapshot_store.snapshots_root()
    whole, half = root / "0123456789abcdef", root / "fedcba9876543210"
    for folder in (whole, half):
        (folder / "checkpoint").mkdir(parents=True)
    meta = {"image": "orchestrator-agent:x", "created": 1.0e9, "size": 11 << 20}
    (whole / snapshot_store.META_FILE).write_text(json.dumps(meta))
    try:
        found = {s.id: s for s in snapshot_store.list_snapshots()}  # the session's others too
        assert whole.name in found and half.name not in found
        row = snapshot_row(found[whole.name])
        assert (row["kind"], row["image"], row["size"]) == (KIND_SNAPSHOT, meta["image"], 11 << 20)
        assert row["tag"] == f"snapshot:{whole.name}"
    finally:
        for folder in (whole, half):
            snapshot_store.remove(snapshot_store.Snapshot(folder.name, folder, {}))


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
    snapshot = snapshot_store.find(made.sandbox["snapshot"])
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
    assert snapshot_store.find(snapshot.id) is None
