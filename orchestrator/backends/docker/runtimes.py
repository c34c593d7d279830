"""Which runtime runs a sandbox's container: gVisor's `runsc` (the sandbox's system calls
reach gVisor's kernel, a user-space kernel, not the host's) or `runc` (the host's kernel,
behind our seccomp profile, `seccomp.py`).

The engine knows gVisor once `setup-gvisor.sh` (beside this file) registered two runtimes:
`runsc` (`--network=none`, for sandboxes without network) and `runsc-net`
(`--network=host`: gVisor uses the network stack of the container's own namespace, which
Docker still creates, for sandboxes on a network). Debian's runsc 0.0~20221219 cannot run
with its default network mode, hence the two. Both are registered with `--oci-seccomp`, so
gVisor applies the container's seccomp filter (our profile) to the sandbox's processes too:
two layers, gVisor's kernel and the filter in front of it. A runsc registered without it
(by hand, or by an older setup script) still runs sandboxes; the record then says the filter
is not in force, and `orchestrator doctor` says how to fix it.

Only the sandbox runs on gVisor. The egress proxy (squid) and the model gateway run our own
code, never the payload's, and their job is the network itself: they stay on runc with the
seccomp profile, which costs them no start-up time and no memory (a gVisor sandbox takes both).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import ConfigError
from ...spec import Limits
from .seccomp import (
    GVISOR_PROFILE_NAME,
    PROFILE_NAME,
    gvisor_security_options,
    security_options,
)

if TYPE_CHECKING:  # the SDK is imported where it is used: runsc_direct's head start needs
    import docker  # this module's figures before anything loads the SDK
    from docker.types import Ulimit

#: The engine's names for gVisor, without network and with the container's own network.
RUNSC, RUNSC_NET = "runsc", "runsc-net"
#: The engine's default runtime (with our seccomp profile).
RUNC = "runc"
#: gVisor run by runsc itself, without the engine (runsc_direct/): named here, so that a
#: run on runc or on gVisor through the engine never imports runsc_direct/
#: (benchmarks/results/code_figures.md#import-costs-on-the-start-path).
RUNSC_DIRECT = "runsc-direct"
#: Under gVisor, the sandbox's processes are held to the run's `pids` by gVisor's kernel:
#: RLIMIT_NPROC, which it enforces per user at clone (EAGAIN past the soft limit without
#: CAP_SYS_ADMIN or CAP_SYS_RESOURCE). The engine sets it, soft = hard, before the sandbox
#: starts: the sandbox user (non-root, no capabilities) can lower it, never raise it. The
#: container's pids cgroup cannot do it there: it counts gVisor's own host threads, not the
#: sandbox's processes.
#:
#: The cgroup stays, as a bound on gVisor's host threads, with room for them: about 512 at
#: rest and under blocking network calls (fewer starved a networked sandbox, "failed to
#: create new OS thread", exit 2), and, on this runsc's ptrace platform, stub threads that
#: grow with the square of the sandbox's live processes (each address space gets one per
#: sentry thread that runs it); with fewer, gVisor itself dies (exit 2) before the sandbox
#: meets its own limit (measured with a fork bomb:
#: benchmarks/results/code_figures.md#gvisor-host-threads). Hence 512 + pids**2 / 2, at most
#: GVISOR_HOST_THREADS_MAX: one sandbox never takes more of the host's threads (an eighth of
#: a kernel's default pid_max, 32768; room for about 80 busy processes).
GVISOR_HOST_THREADS = 512
GVISOR_HOST_THREADS_MAX = 4096
#: What one more process costs a gVisor sandbox's memory: a Python process forked by a tool
#: from the runtime's agent process (smolagents and the runtime imported), in MiB. gVisor
#: breaks copy-on-write in 2 MiB pieces where Linux copies 4 KiB pages, so each such process
#: costs far more than on runc (measured:
#: benchmarks/results/code_figures.md#gvisor-memory-per-process), rounded up here because
#: what a process touches after its fork varies. RLIMIT_NPROC holds a gVisor sandbox to what
#: its memory carries at this price (`gvisor_nproc`), so that a fork bomb is refused a fork,
#: as on runc, rather than killed for memory.
GVISOR_PROCESS_MB = 32
#: A gVisor sandbox's memory before any process of the payload's, in MiB: gVisor's own, the
#: deadline keeper, the runtime's relay and its agent process (a trivial run's peak,
#: measured: benchmarks/results/code_figures.md#gvisor-memory-per-process; the rest is room
#: for the agent's own work). GVISOR_RUNTIME_TASKS: the tasks those three processes are,
#: which RLIMIT_NPROC counts as it counts every thread.
GVISOR_RUNTIME_MB = 176
GVISOR_RUNTIME_TASKS = 3
#: The least RLIMIT_NPROC of a gVisor sandbox, whatever its memory: the runtime's own tasks
#: and the keeper's idle thread, still alive for a moment as the run begins.
GVISOR_NPROC_FLOOR = GVISOR_RUNTIME_TASKS + 1
#: The runsc flag that makes gVisor apply the OCI seccomp filter inside the sandbox (without
#: it the engine's `seccomp=` option is accepted and silently has no effect).
OCI_SECCOMP = "--oci-seccomp"
#: The set-up step a run that asks for runsc names when the engine lacks it.
SETUP_SCRIPT = Path(__file__).with_name("setup-gvisor.sh")


def gvisor_pids_limit(pids: int) -> int:
    """The pids cgroup of a gVisor sandbox held to `pids` processes: room for gVisor's own
    host threads as they grow with them (see GVISOR_HOST_THREADS)."""
    return pids + min(GVISOR_HOST_THREADS + pids * pids // 2, GVISOR_HOST_THREADS_MAX)


def gvisor_nproc(limits: Limits) -> int:
    """The RLIMIT_NPROC of a gVisor sandbox: its `pids`, held to the processes its
    `memory_mb` carries (see GVISOR_PROCESS_MB), never under GVISOR_NPROC_FLOOR."""
    room = max(0, limits.memory_mb - GVISOR_RUNTIME_MB) // GVISOR_PROCESS_MB
    return min(limits.pids, max(GVISOR_NPROC_FLOOR, GVISOR_RUNTIME_TASKS + room))


def pids_by_gvisor(limits: Limits) -> str:
    """What the record says holds a gVisor sandbox to its processes: RLIMIT_NPROC, its
    figure, and why when it is less than `pids`."""
    nproc = gvisor_nproc(limits)
    said = f"RLIMIT_NPROC {nproc} in gVisor's kernel"
    if nproc < limits.pids:
        said += (
            f", not pids {limits.pids}: what memory_mb {limits.memory_mb} carries under gVisor "
            f"(about {GVISOR_RUNTIME_MB} MiB for the runtime's {GVISOR_RUNTIME_TASKS} "
            f"processes, then {GVISOR_PROCESS_MB} MiB a process)"
        )
    return said


class EngineRuntimes:
    """The runtimes registered with the engine, asked once (an engine round trip worth
    saving: benchmarks/results/code_figures.md#engine-calls; `prefetch` asks in the
    background, so that a run on `auto` waits for nothing)."""

    def __init__(self, client: docker.DockerClient) -> None:
        self.client = client
        self._runtimes: dict[str, dict[str, Any]] | None = None
        self._info: dict[str, Any] = {}
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._started = False

    def prefetch(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        threading.Thread(target=self._fetch, name="engine-runtimes", daemon=True).start()

    def _fetch(self) -> None:
        try:
            self._info = dict(self.client.api.info())
            self._runtimes = dict(self._info.get("Runtimes") or {})
        except Exception:  # an engine that cannot say has no gVisor for us
            self._runtimes = {}
        finally:
            self._done.set()

    def registered(self) -> dict[str, dict[str, Any]]:
        """The engine's runtimes by name, each as `docker info` gives it (path,
        runtimeArgs)."""
        self.prefetch()
        self._done.wait(timeout=60)
        return self._runtimes or {}

    def info(self) -> dict[str, Any]:
        """The engine's whole `docker info` as asked (empty when it could not say)."""
        self.registered()
        return self._info

    def names(self) -> set[str]:
        return set(self.registered())

    def has_gvisor(self) -> bool:
        return {RUNSC, RUNSC_NET} <= self.names()

    def gvisor_applies_seccomp(self) -> bool:
        """Whether both gVisor runtimes are registered with `--oci-seccomp`."""
        return not without_seccomp(self.registered())


def without_seccomp(registered: dict[str, Any]) -> list[str]:
    """The gVisor runtimes among the engine's (`docker info`'s `Runtimes`) registered without
    `--oci-seccomp`: their sandboxes would run without our seccomp filter."""
    return [
        name
        for name in (RUNSC, RUNSC_NET)
        if OCI_SECCOMP not in ((registered.get(name) or {}).get("runtimeArgs") or [])
    ]


def gvisor_missing(names: set[str]) -> ConfigError:
    """The error of a run that asks for runsc on an engine without it."""
    return ConfigError(
        "The Docker engine has no gVisor runtime (runsc and runsc-net); it has: "
        f"{', '.join(sorted(names)) or 'none it would name'}.",
        f"Set gVisor up once, as root: `bash {SETUP_SCRIPT}` (installs Debian's runsc and "
        "registers it with the engine without restarting it; docs/guides/kernel.md), or run on "
        "runc with --sandbox-runtime runc (or auto).",
    )


def check_requested(runtime: str, runtimes: EngineRuntimes) -> None:
    """Raise ConfigError for runsc on an engine without it (the name itself is checked
    against `DockerBackend.capabilities` first); `auto` starts asking the engine in the
    background."""
    if runtime == "runsc" and not runtimes.has_gvisor():
        raise gvisor_missing(runtimes.names())
    if runtime == "auto":
        runtimes.prefetch()


#: What the record says holds a runc sandbox to its `pids` processes (`pids_by_gvisor`
#: under gVisor).
PIDS_BY_CGROUP = "the pids cgroup"
#: What the record says of a gVisor sandbox whose runsc was registered without OCI_SECCOMP.
NO_FILTER_IN_GVISOR = "none: runsc registered without --oci-seccomp (run setup-gvisor.sh again)"


@dataclass(frozen=True)
class Placement:
    """Where a sandbox runs: `runtime` (runc or runsc), the engine's name for it, what was
    asked for, and whether our seccomp profile is in force (always under runc; under gVisor
    when runsc applies it, `--oci-seccomp`)."""

    runtime: str
    engine_runtime: str
    requested: str
    seccomp: bool = True

    def security_options(self) -> list[str]:
        """Our seccomp profile wherever it takes effect (as gVisor reads it, under gVisor);
        none claimed where it would not."""
        if not self.seccomp:
            return ["no-new-privileges:true"]
        return security_options() if self.runtime == "runc" else gvisor_security_options()

    def pids_options(self, limits: Limits) -> tuple[int, list[Ulimit]]:
        """The container's pids limit and the ulimits beyond the common ones that hold a
        sandbox to its `pids` processes: under gVisor RLIMIT_NPROC, at most what its memory
        carries (`gvisor_nproc`), and a pids cgroup with room for gVisor's own threads (see
        GVISOR_HOST_THREADS)."""
        if self.runtime == "runc":
            return limits.pids, []
        nproc = gvisor_nproc(limits)
        from docker.types import Ulimit

        return gvisor_pids_limit(limits.pids), [Ulimit(name="nproc", soft=nproc, hard=nproc)]

    def isolation(self, limits: Limits) -> dict[str, str]:
        """What the run record says (`Sandbox.isolation`) of a sandbox with `limits`."""
        if not self.seccomp:
            seccomp = NO_FILTER_IN_GVISOR
        else:
            seccomp = PROFILE_NAME if self.runtime == "runc" else GVISOR_PROFILE_NAME
        pids = PIDS_BY_CGROUP if self.runtime == "runc" else pids_by_gvisor(limits)
        found = {
            "runtime": self.runtime,
            "seccomp": seccomp,
            "pids": pids,
            "requested": self.requested,
        }
        if self.engine_runtime != self.runtime:
            found["engine_runtime"] = self.engine_runtime
        return found


def place(requested: str, runtimes: EngineRuntimes, *, networked: bool) -> Placement:
    """The engine runtime of a sandbox asked to run on `requested`: auto (which
    `DockerBackend.runtime_for` sends to runsc-direct first, where the host can run it) is
    runsc when the engine has it, else runc. Raises ConfigError for runsc on an engine
    without it."""
    gvisor = requested == "runsc" or (requested == "auto" and runtimes.has_gvisor())
    if not gvisor:
        return Placement("runc", "runc", requested)
    if not runtimes.has_gvisor():
        raise gvisor_missing(runtimes.names())
    return Placement(
        "runsc",
        RUNSC_NET if networked else RUNSC,
        requested,
        seccomp=runtimes.gvisor_applies_seccomp(),
    )
