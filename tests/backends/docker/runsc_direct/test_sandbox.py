"""gVisor sandboxes run by runsc itself (`--sandbox-runtime runsc-direct`,
orchestrator/backends/docker/runsc_direct/), against the real runsc and engine: two runs
restored from one snapshot share nothing, no secret is in a snapshot, and a restored sandbox
stops at its time limit, when cancelled and when its orchestrator was SIGKILLed, leaving
nothing behind (no sandbox record, cgroup or runsc state); a run on network `open` resolves
names as the engine's containers do and reaches servers by them, its /etc/resolv.conf
read-only; and the conformance kit, whole, networked runs included (in a holder container's
network namespace). Every run asks for runsc-direct itself, so these tests carry no
`gvisor` mark; they skip without runsc or without root (the sandbox's cgroup is made by
us)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator import Limits, RunResult, RunSpec, run
from orchestrator.backends.docker.gateway import GATEWAY_PORT, KIND_GATEWAY
from orchestrator.backends.docker.runsc_direct import bundle, cgroup
from orchestrator.backends.docker.runsc_direct.sandbox import RunscSandbox
from orchestrator.backends.docker.runsc_direct.snapshot import SNAPSHOTS_DIR, find
from orchestrator.labels import LABEL_RUN_ID
from orchestrator.policy import HOST_ALIAS
from orchestrator.testing import CHECKS, Kit, run_check
from tests.backends.docker.runsc_direct.conftest import nothing_of_ours_left
from tests.backends.docker.test_snapshots import checkpoint_bytes
from tests.backends.docker.test_snapshots import probe_run as snapshots_probe_run
from tests.conftest import files_holding
from tests.model_server import ScriptedModelServer, docker_bridge_address

RUNTIME = "runsc-direct"


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


def test_a_restored_sandbox_is_held_to_its_cpu_limit_before_its_request(
    agent_image: str, leaves_nothing: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The restore gets the host's cores (`cgroup.boot_cpus`); when the request is written
    (the payload's code runs only once the runtime has read it), the sandbox's cgroup holds
    it to the run's `cpus`, as the engine path's. Read from the real cgroup at each write to
    the sandbox's stdin: the restore line, then the request."""
    written: list[tuple[str, int]] = []
    write = RunscSandbox.write

    def noted(self: RunscSandbox, data: bytes, *, close: bool = False) -> None:
        written.append(("request" if close else "restore line", quota_of(self.cgroup)))
        write(self, data, close=close)

    monkeypatch.setattr(RunscSandbox, "write", noted)
    result, held = probe_run(tmp_path, "direct-s3cret-CPU-5150", cpus=0.5)
    assert result.status == "succeeded" and held, (result.error, result.output)
    assert result.sandbox.get("snapshot"), result.sandbox  # restored
    boot = int(cgroup.boot_cpus(Limits(cpus=0.5)) * cgroup.CPU_PERIOD_US)
    assert written == [("restore line", boot), ("request", 50_000)], written


def quota_of(group: cgroup.Cgroup) -> int:
    """A cgroup's CPU quota in microseconds a period."""
    if group.v2:
        return int((group.folders[0] / "cpu.max").read_text().split()[0])
    return int((group.folders[1] / "cpu.cfs_quota_us").read_text())


#: What a program run on `open` sees of names and the way out, from inside its sandbox: its
#: name files; for each NAME PORT of its arguments, the name resolved and the server there
#: reached by it (no proxy: `open`); whether /etc/resolv.conf can be written, and how it is
#: mounted.
OPEN_PROBE = """
import errno, json, socket, sys, urllib.error, urllib.request

seen = {path: open(path).read() for path in ("/etc/resolv.conf", "/etc/hosts")}
direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
for name, port in zip(sys.argv[1::2], sys.argv[2::2]):
    try:
        seen[name] = direct.open(f"http://{name}:{port}/reached", timeout=10).status
    except urllib.error.HTTPError as exc:  # reached: it answered
        seen[name] = exc.code
    seen[f"address of {name}"] = socket.gethostbyname(name)
try:
    with open("/etc/resolv.conf", "a") as handle:
        handle.write("nameserver 192.0.2.1\\n")
    seen["write"] = "written"
except OSError as exc:
    seen["write"] = errno.errorcode[exc.errno]
mounts = [line.split() for line in open("/proc/self/mounts")]
seen["mounted"] = [m[3] for m in mounts if m[1] == "/etc/resolv.conf"]
print(json.dumps(seen))
"""


@pytest.mark.parametrize("gateway", [False, True], ids=["bridge", "with-gateway"])
def test_network_open_resolves_names_as_the_engine_and_reaches_servers_by_them(
    gateway: bool,
    agent_image: str,
    leaves_nothing: None,
    openai_key: str,
    docker_client,
    tmp_path: Path,
) -> None:
    """An `open` run on runsc-direct: its sandbox, in the holder's network namespace, has
    the name files the engine wrote for the holder, and reaches servers by the names they
    give: the model server on this host by its alias (/etc/hosts); with a gateway, also the
    gateway container by its name, which only the engine's DNS on the run's network
    resolves (/etc/resolv.conf). Its /etc/resolv.conf is read-only: writing it fails."""
    program = tmp_path / "open_probe.py"
    program.write_text(OPEN_PROBE)
    run_id = f"r-open-{secrets.token_hex(4)}"
    names = [HOST_ALIAS]
    with ScriptedModelServer([]) as server:
        args = [HOST_ALIAS, str(server.port)]
        if gateway:
            names.append(f"orchestrator-{KIND_GATEWAY}-{run_id}")
            args += [names[-1], str(GATEWAY_PORT)]
        spec = RunSpec(
            payload=program,
            program_args=tuple(args),
            sandbox_runtime=RUNTIME,
            network="open",
            gateway=gateway,
            model="openai:scripted",
            api_base=server.api_base("localhost"),
            run_id=run_id,
        )
        result = run(spec)
    assert result.status == "succeeded", (result.error, result.output)
    assert result.sandbox.get("requested") == RUNTIME, result.sandbox
    seen = json.loads(str(result.output).strip().splitlines()[-1])
    if gateway:  # on the run's network too: the engine's own DNS server
        assert "nameserver 127.0.0.11" in seen["/etc/resolv.conf"], seen
    else:  # the default bridge only: what the engine gives any container there
        cat = {"entrypoint": ["cat"], "network_mode": "bridge", "remove": True}
        engines = docker_client.containers.run(agent_image, ["/etc/resolv.conf"], **cat)
        assert seen["/etc/resolv.conf"] == engines.decode(), seen
    alias = seen[f"address of {HOST_ALIAS}"]
    assert alias == docker_bridge_address(), seen  # host-gateway
    assert f"{alias}\t{HOST_ALIAS}" in seen["/etc/hosts"], seen
    assert seen[HOST_ALIAS] == 404, seen  # the model server's answer to a path it lacks
    (request,) = [r for r in server.requests if r["path"] == "/reached"]
    assert request["headers"]["Host"] == f"{HOST_ALIAS}:{server.port}"
    for name in names[1:]:  # the gateway: an answer (it serves only the run's token)
        assert isinstance(seen[name], int) and seen[name] >= 400, seen
        assert name not in seen["/etc/hosts"], seen
    assert seen["write"] in ("EROFS", "EACCES"), seen
    assert seen["mounted"] and "ro" in seen["mounted"][-1].split(","), seen
    assert not docker_client.api.networks(filters={"label": [f"{LABEL_RUN_ID}={run_id}"]})


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
