"""The `runsc-direct` runtime's data, without runsc: the sandbox's OCI spec holds the engine
path's hardening (orchestrator/backends/docker/runsc_direct/ocispec.py), the run's cgroup
gets its limits in the files of its cgroup version (cgroup.py), and which sandboxes start
beside a holder container (direct.py)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from orchestrator.backends.base import SandboxSpec
from orchestrator.backends.docker.runsc_direct import cgroup, direct, ocispec, records
from orchestrator.backends.docker.runtimes import gvisor_nproc, gvisor_pids_limit
from orchestrator.spec import Limits, NetworkPolicy


def test_the_spec_holds_the_engine_paths_hardening(tmp_path: Path) -> None:
    limits = Limits(memory_mb=768, tmpfs_mb=48, pids=40)
    spec = ocispec.config(tmp_path / "rootfs", ["python", "-m", "x"], ["PATH=/bin"], limits)
    process = spec["process"]
    assert process["user"] == {"uid": 10001, "gid": 10001, "additionalGids": []}
    assert all(v == [] for v in process["capabilities"].values())
    assert process["noNewPrivileges"] is True
    assert process["terminal"] is False
    assert spec["root"] == {"path": str(tmp_path / "rootfs"), "readonly": True}
    rlimits = {r["type"]: (r["soft"], r["hard"]) for r in process["rlimits"]}
    nproc = gvisor_nproc(limits)
    assert rlimits == {
        "RLIMIT_NOFILE": (1024, 1024),
        "RLIMIT_CORE": (0, 0),
        "RLIMIT_NPROC": (nproc, nproc),
    }
    mounts = {m["destination"]: m for m in spec["mounts"]}
    for folder in ("/tmp", "/work"):
        assert mounts[folder]["type"] == "tmpfs"
        assert {"size=48m", "noexec", "nosuid", "nodev"} <= set(mounts[folder]["options"])
    assert process["cwd"] == "/work"
    assert {"type": "network"} in spec["linux"]["namespaces"]
    assert "PATH=/bin" in process["env"]


def test_the_seccomp_profile_is_ours_in_the_oci_form() -> None:
    """Docker's archMap flattened, rules of other architectures left out, our refusals kept
    (io_uring, ptrace not allowed; AF_VSOCK refused by argument)."""
    profile = ocispec.oci_seccomp("x86_64")
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    assert {"SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"} <= set(profile["architectures"])
    allowed = {
        n for r in profile["syscalls"] if r["action"] == "SCMP_ACT_ALLOW" for n in r["names"]
    }
    assert "arch_prctl" in allowed and "arm_fadvise64_64" not in allowed
    assert not {"io_uring_setup", "io_uring_enter", "ptrace", "process_vm_readv"} & allowed
    assert "pselect" in allowed  # gVisor's own name for pselect6 (seccomp.py)
    socket = next(r for r in profile["syscalls"] if r["names"] == ["socket"])
    assert socket["args"] == [{"index": 0, "value": 40, "valueTwo": 0, "op": "SCMP_CMP_NE"}]
    for rule in profile["syscalls"]:
        assert set(rule) <= {"names", "action", "errnoRet", "args"}, rule
    arm = ocispec.oci_seccomp("aarch64")
    arm_allowed = {
        n for r in arm["syscalls"] if r["action"] == "SCMP_ACT_ALLOW" for n in r["names"]
    }
    assert "arm_fadvise64_64" in arm_allowed and "arch_prctl" not in arm_allowed


def fake_v1(root: Path) -> None:
    for controller in cgroup.V1_CONTROLLERS:
        (root / controller).mkdir(parents=True)
        (root / controller / "cgroup.procs").write_text("")


def test_a_v1_cgroup_gets_memory_without_swap_cpu_and_pids(tmp_path: Path) -> None:
    fake_v1(tmp_path)
    group = cgroup.Cgroup.of("runsc-r1-abc", tmp_path)
    assert not group.v2
    limits = Limits(memory_mb=300, cpus=1.5, pids=50)
    group.make(limits)
    memory, cpu, pids = group.folders
    assert (memory / "memory.limit_in_bytes").read_text() == str(300 * 1024 * 1024)
    assert (memory / "memory.memsw.limit_in_bytes").read_text() == str(300 * 1024 * 1024)
    assert (cpu / "cpu.cfs_quota_us").read_text() == "150000"
    assert (cpu / "cpu.cfs_period_us").read_text() == "100000"
    assert (pids / "pids.max").read_text() == str(gvisor_pids_limit(50))
    assert cgroup.leftovers(tmp_path) == ["runsc-r1-abc"]
    (memory / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    assert not group.oom_killed()
    (memory / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    assert group.oom_killed()


def test_a_sandbox_boots_on_the_hosts_cores_and_runs_on_its_own(tmp_path: Path) -> None:
    """Its restore (or cold boot) gets every core of the host; `limit_cpus`, before its
    request is written, holds it to the run's figure; v1 and v2 alike."""
    limits = Limits(cpus=0.5)
    assert cgroup.boot_cpus(limits) == max(0.5, float(os.cpu_count() or 1))
    assert cgroup.boot_cpus(Limits(cpus=64)) == 64  # never less than the run's own
    fake_v1(tmp_path / "v1")
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "cgroup.controllers").write_text("cpu memory pids\n")
    for root, quota_file in ((tmp_path / "v1", "cpu.cfs_quota_us"), (tmp_path / "v2", "cpu.max")):
        group = cgroup.Cgroup.of("runsc-boot-abc", root)
        group.make(limits, 2.0)
        quota = group.folders[-1 if group.v2 else 1] / quota_file
        assert quota.read_text().split()[0] == "200000", root
        group.limit_cpus(limits.cpus)
        assert quota.read_text().split()[0] == "50000", root


def test_a_v2_cgroup_gets_the_same_limits_in_its_files(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    group = cgroup.Cgroup.of("runsc-r2-abc", tmp_path)
    assert group.v2
    group.make(Limits(memory_mb=256, cpus=0.5, pids=20))
    (folder,) = group.folders
    assert (folder / "memory.max").read_text() == str(256 * 1024 * 1024)
    assert (folder / "memory.swap.max").read_text() == "0"
    assert (folder / "cpu.max").read_text() == "50000 100000"
    (folder / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert group.oom_killed()


def test_a_host_that_cannot_make_sandbox_cgroups_says_why(tmp_path: Path) -> None:
    """Checked before a run starts (`DockerBackend.check_runtime`): root, and the memory,
    CPU and pids controllers there to write, in either cgroup version."""
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    fake_v1(v1)
    assert cgroup.unusable(v1, euid=0) is None
    reason = cgroup.unusable(v1, euid=1000)
    assert reason is not None and "needs root" in reason and "uid 1000" in reason
    shutil.rmtree(v1 / "pids")
    assert "controllers pids are not mounted" in (cgroup.unusable(v1, euid=0) or "")
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpuset cpu io memory\n")
    assert "controllers pids are not mounted" in (cgroup.unusable(v2, euid=0) or "")
    (v2 / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    assert cgroup.unusable(v2, euid=0) is None


def test_the_join_script_puts_the_process_into_the_cgroup_then_runs_it(tmp_path: Path) -> None:
    """The shell writes its own pid into each controller's procs file and becomes the
    command: the pid written is the command's own."""
    import subprocess

    fake_v1(tmp_path)
    group = cgroup.Cgroup.of("runsc-r3-abc", tmp_path)
    for folder in group.folders:
        folder.mkdir(parents=True)
    done = subprocess.run(group.joined(["sh", "-c", "echo $$"]), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for folder in group.folders:
        assert (folder / "cgroup.procs").read_text().strip() == done.stdout.strip()
    missing = cgroup.Cgroup.of("runsc-gone", tmp_path)
    assert subprocess.run(missing.joined(["true"]), capture_output=True).returncode == 125


def test_every_network_but_none_needs_a_holder() -> None:
    def spec(network: str, gateway: bool = False) -> SandboxSpec:
        from orchestrator.gateway import GatewaySpec

        made = GatewaySpec("http://x", "token", 1, 1, None) if gateway else None
        return SandboxSpec(
            "r", "img", ("python",), Limits(), NetworkPolicy(mode=network), gateway=made
        )

    for networked in (spec("open"), spec("allowlist"), spec("none", gateway=True)):
        assert direct.networked(networked)
    assert not direct.networked(spec("none"))


def test_a_networked_sandbox_gets_its_name_files_read_only(tmp_path: Path) -> None:
    """Bound over the root's empty ones, read-only, no exec; a sandbox without them (one a
    snapshot is made of) has no bind mount at all."""
    files = {name: tmp_path / Path(name).name for name in direct.NAME_PATHS}
    spec = ocispec.config(tmp_path / "rootfs", ["python"], [], Limits(), "/proc/1/ns/net", files)
    binds = {m["destination"]: m for m in spec["mounts"] if m["type"] == "bind"}
    assert set(binds) == {"/etc/resolv.conf", "/etc/hosts", "/etc/hostname"}
    for name, mount in binds.items():
        assert mount["source"] == str(tmp_path / Path(name).name)
        assert {"ro", "noexec", "nosuid", "nodev"} <= set(mount["options"])
        assert "rw" not in mount["options"]
    plain = ocispec.config(tmp_path / "rootfs", ["python"], [], Limits())
    assert not [m for m in plain["mounts"] if m["type"] == "bind"]


def test_the_name_files_are_read_from_the_engines_copies_never_through_the_holders_root(
    tmp_path: Path,
) -> None:
    """Each name file from the path the holder's inspection names (the engine's data root):
    an image's symlink at /etc/resolv.conf cannot lead the read to another host file. A
    holder the engine names no file for, or whose file is gone, is an error, not an empty
    resolver."""
    state: dict[str, str] = {}
    for destination, field in direct.NAME_PATHS.items():
        source = tmp_path / field
        source.write_text(f"content of {destination}")
        state[field] = str(source)
    names = direct.holder_names(state)
    assert names == {d: f"content of {d}".encode() for d in direct.NAME_PATHS}
    with pytest.raises(RuntimeError, match="no /etc/hosts"):
        direct.holder_names({**state, "HostsPath": ""})
    (tmp_path / "HostnamePath").unlink()
    with pytest.raises(OSError):
        direct.holder_names(state)


def fake_snapshot(key: str, used: float, image: str = "a" * 64) -> None:
    from orchestrator.backends.docker.runsc_direct import bundle, snapshot

    folder = bundle.images_root() / image
    (folder / "rootfs").mkdir(parents=True, exist_ok=True)
    (folder / bundle.META_FILE).write_text("{}")
    made = folder / snapshot.SNAPSHOTS_DIR / key
    (made / "checkpoint").mkdir(parents=True)
    (made / snapshot.META_FILE).write_text("{}")
    os.utime(made / snapshot.META_FILE, (used, used))


def test_snapshots_beyond_the_kept_number_go_least_recently_used_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Across every exported image, as the engine path's: a restore marks its snapshot
    used, and one used in the last RECENT_USE seconds is never removed."""
    from orchestrator.backends.docker.runsc_direct import snapshot

    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path))
    now = time.time()
    fake_snapshot("old", now - 5000)
    fake_snapshot("older", now - 9000, image="b" * 64)
    fake_snapshot("recent", now - 10)
    assert snapshot.evict(1, now=now) == ["old", "older"]
    assert [s.key for s in snapshot.list_snapshots()] == ["recent"]
    fake_snapshot("newer", now - 20)
    assert snapshot.evict(1, now=now) == []  # both used within RECENT_USE
    (newer,) = [s for s in snapshot.list_snapshots() if s.key == "newer"]
    snapshot.mark_used(newer)
    assert snapshot.evict(1, now=time.time() + snapshot.RECENT_USE + 15) == ["recent"]


def test_images_list_shows_the_exported_images_and_their_snapshots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What runsc-direct keeps in the state directory is listed with the images (an export
    is about as large as its image), each with the image it was made of."""
    import json

    from orchestrator.backends.docker import prune
    from orchestrator.backends.docker.runsc_direct import bundle

    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path))
    fake_snapshot("k1", time.time())
    meta = {"image": "orchestrator-agent:x", "size": 341 << 20, "created": time.time()}
    (bundle.images_root() / ("a" * 64) / bundle.META_FILE).write_text(json.dumps(meta))
    rows = {row["kind"]: row for row in prune.runsc_rows()}
    assert rows[prune.KIND_RUNSC_EXPORT]["size"] == 341 << 20
    assert rows[prune.KIND_RUNSC_EXPORT]["tag"] == "runsc-export:aaaaaaaaaaaa"
    assert rows[prune.KIND_RUNSC_EXPORT]["image"] == "orchestrator-agent:x"
    assert rows[prune.KIND_RUNSC_SNAPSHOT]["tag"] == "runsc-snapshot:k1"


def test_a_sandbox_id_says_which_state_directory_gave_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host's sandbox cgroups are named by id and shared by every store on it: the id's
    tag tells this store's from another's (what a leftover check or a cleanup may touch)."""
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "one"))
    mine = records.new_id("r-20261129-1")
    assert records.is_ours(mine) and records.of_this_store(mine)
    assert mine != records.new_id("r-20261129-1")  # attempts of one run differ
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(tmp_path / "two"))
    theirs = records.new_id("r-20261129-1")
    assert records.is_ours(theirs) and records.of_this_store(theirs)
    assert not records.of_this_store(mine)
