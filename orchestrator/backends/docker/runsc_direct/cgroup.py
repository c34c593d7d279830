"""A sandbox's own cgroup: its memory (no swap), CPU and pids limits, made by us before runsc
starts and joined by the runsc process itself, so that gVisor's sandbox and gofer processes
(runsc's children) are in it from their first instruction.

Why ours and not runsc's (`--ignore-cgroups`): runsc removes the cgroups it made when its
container is gone, and with them the one fact the host needs afterwards, whether the
kernel's OOM killer ended the sandbox (`oom_killed`). Ours is removed after that is read.
Its name is the container's id, so what a dead orchestrator left is found by name, its
processes killed and the folder removed (`Cgroup.remove`).

cgroup v1 (one hierarchy per controller; this project's engines) and v2 (one unified
hierarchy) are both written: the same limits, each in its own files.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from ....spec import Limits
from ..runtimes import gvisor_pids_limit

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: The parent of every sandbox's cgroup, in each hierarchy.
PARENT = "orchestrator-runsc"
#: The CPU period the quota is a share of (microseconds; the kernel's default).
CPU_PERIOD_US = 100_000
#: The controllers a v1 sandbox's cgroup is made in.
V1_CONTROLLERS = ("memory", "cpu", "pids")
#: The shell that puts itself into the cgroup and then becomes runsc: a process can only
#: move itself safely before it has threads, and a Python `preexec_fn` is unsafe in a
#: process with threads (the orchestrator has them).
JOIN_SCRIPT = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


def boot_cpus(limits: Limits) -> float:
    """The CPU a sandbox's cgroup gives it before its run's request: every core of the host
    (never less than `limits.cpus`). What runs then is runsc restoring gVisor (or booting
    it, cold) and our runtime waiting on stdin, never the payload, whose code runs only
    once the request is read; `RunscSandbox.start` holds the sandbox to `limits.cpus`
    before it writes the request. runsc restores gVisor's memory on several threads: held
    to one CPU from the start, a restore took 0.73 s to its exit against 0.48 s with this
    2-core host's two (benchmarks/results/code_figures.md#a-restore-on-the-hosts-cores)."""
    return max(limits.cpus, float(os.cpu_count() or 1))


def unified(root: Path = CGROUP_ROOT) -> bool:
    """Whether this host mounts cgroup v2 alone (one hierarchy)."""
    return (root / "cgroup.controllers").is_file()


def unusable(root: Path = CGROUP_ROOT, euid: int | None = None) -> str | None:
    """Why this process cannot make sandbox cgroups here (None: it can): it must be root
    (`euid`, default its own), and the memory, CPU and pids controllers must be there to
    write. Checked before a run starts, so that a run that cannot have its limits is refused
    instead of failing half-made."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        return (
            "it makes each sandbox's cgroup and runs runsc itself, which needs root "
            f"(this process runs as uid {euid})"
        )
    if unified(root):
        controllers = set((root / "cgroup.controllers").read_text().split())
        missing = [c for c in V1_CONTROLLERS if c not in controllers]
        folders = [root]
    else:
        missing = [c for c in V1_CONTROLLERS if not (root / c).is_dir()]
        folders = [root / c for c in V1_CONTROLLERS if c not in missing]
    if missing:
        return f"the cgroup controllers {', '.join(missing)} are not mounted under {root}"
    read_only = [str(f) for f in folders if not os.access(f, os.W_OK)]
    if read_only:
        return f"{', '.join(read_only)} cannot be written (a read-only cgroup mount)"
    return None


@dataclass(frozen=True)
class Cgroup:
    """The folders of one sandbox's cgroup (one per v1 controller, or the one v2 folder)."""

    name: str
    folders: tuple[Path, ...]
    v2: bool

    @classmethod
    def of(cls, name: str, root: Path = CGROUP_ROOT) -> Cgroup:
        if unified(root):
            return cls(name, (root / PARENT / name,), True)
        return cls(name, tuple(root / c / PARENT / name for c in V1_CONTROLLERS), False)

    def make(self, limits: Limits, cpus: float | None = None) -> None:
        """Make the folders and write `limits` into them, the CPU quota `cpus` when given
        (`boot_cpus`, until `limit_cpus`). Raises OSError when the cgroup file system
        refuses (not root, a controller missing); what was made is removed."""
        try:
            if self.v2:
                self._make_v2(limits)
            else:
                self._make_v1(limits)
            self.limit_cpus(limits.cpus if cpus is None else cpus)
        except OSError:
            self.remove()
            raise

    def limit_cpus(self, cpus: float) -> None:
        """Hold the cgroup's processes to `cpus` cores (a CFS quota of that many periods).
        Raises OSError when the file cannot be written (the cgroup is gone)."""
        quota = int(cpus * CPU_PERIOD_US)
        if self.v2:
            (self.folders[0] / "cpu.max").write_text(f"{quota} {CPU_PERIOD_US}")
        else:
            cpu = self.folders[1]
            (cpu / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
            (cpu / "cpu.cfs_quota_us").write_text(str(quota))

    def _make_v1(self, limits: Limits) -> None:
        memory, _, pids = self.folders  # the CPU quota: limit_cpus
        for folder in self.folders:
            folder.mkdir(parents=True, exist_ok=True)
        limit = str(limits.memory_mb * 1024 * 1024)
        (memory / "memory.limit_in_bytes").write_text(limit)
        # memory and swap together at the same figure: no swap, over the limit is an OOM
        # kill, not a crawl (as the engine path's memswap_limit)
        with contextlib.suppress(FileNotFoundError):  # a kernel without swap accounting
            (memory / "memory.memsw.limit_in_bytes").write_text(limit)
        # room for gVisor's own host threads; the sandbox's processes are held by
        # RLIMIT_NPROC in gVisor's kernel (runtimes.py, ocispec.py)
        (pids / "pids.max").write_text(str(gvisor_pids_limit(limits.pids)))

    def _make_v2(self, limits: Limits) -> None:
        (folder,) = self.folders
        parent = folder.parent
        parent.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):  # enabled already, or by the host's manager
            (parent / "cgroup.subtree_control").write_text("+memory +cpu +pids")
        folder.mkdir(exist_ok=True)
        (folder / "memory.max").write_text(str(limits.memory_mb * 1024 * 1024))
        (folder / "memory.swap.max").write_text("0")  # no swap (see _make_v1)
        (folder / "pids.max").write_text(str(gvisor_pids_limit(limits.pids)))

    def joined(self, argv: list[str]) -> list[str]:
        """`argv` run from inside this cgroup (JOIN_SCRIPT): exit status 125 when the shell
        cannot join it."""
        procs = [str(folder / "cgroup.procs") for folder in self.folders]
        return ["/bin/sh", "-c", JOIN_SCRIPT, "sh", *procs, "--", *argv]

    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer killed a process of this cgroup (read before
        `remove`; False when it cannot be read)."""
        name = "memory.events" if self.v2 else "memory.oom_control"
        try:
            text = (self.folders[0] / name).read_text()
        except OSError:
            return False
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip() not in ("", "0"):
                return True
        return False

    def pids(self) -> list[int]:
        """The processes in this cgroup now (none when it is gone)."""
        try:
            text = (self.folders[0] / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(pid) for pid in text.split()]

    def kill(self) -> None:
        """SIGKILL every process in it (runsc, gVisor's sandbox and gofer): nothing of the
        sandbox survives, whatever state runsc is in."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def remove(self, timeout: float = 5.0) -> bool:
        """Kill what is left in it and remove its folders (a folder goes once its last
        process is reaped, so this retries for up to `timeout` seconds). True when gone."""
        give_up = time.monotonic() + timeout
        while True:
            self.kill()
            for folder in self.folders:
                with contextlib.suppress(FileNotFoundError):
                    try:
                        folder.rmdir()
                    except OSError:
                        pass
            if not any(folder.exists() for folder in self.folders):
                return True
            if time.monotonic() >= give_up:
                return False
            time.sleep(0.02)


def leftovers(root: Path = CGROUP_ROOT) -> list[str]:
    """The names of the sandbox cgroups on this host (cleanup compares them with live runs)."""
    parent = (root / PARENT) if unified(root) else (root / V1_CONTROLLERS[0] / PARENT)
    if not parent.is_dir():
        return []
    return sorted(p.name for p in parent.iterdir() if p.is_dir())
