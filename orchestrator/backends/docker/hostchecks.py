"""The host's configuration as the Docker engine describes itself (`docker info`), checked
without a run (`DockerBackend.host_checks`, shown by `orchestrator doctor`): gVisor
registered, seccomp, cgroup limits, an engine log that holds no secret (no debug mode), and
two that are about speed only and never fail: whether gVisor runs start from snapshots, and
the engine's storage driver.

Each check takes the engine's info as data, so that a test can hand it a double (an engine
without gVisor, one without seccomp) instead of changing the real daemon.
"""

from __future__ import annotations

from typing import Any

import docker

from ..base import Backend, HostCheck, HostProblem
from . import snapshots
from .runtimes import OCI_SECCOMP, RUNSC, RUNSC_NET, SETUP_SCRIPT, without_seccomp
from .seccomp import PROFILE_NAME

#: How a user registers gVisor: the script the package ships, and its checkout's way in.
GVISOR_FIX = (
    f"Register gVisor with the engine, as root: `bash scripts/setup-gvisor.sh` in a checkout "
    f"(installed: `bash {SETUP_SCRIPT}`); it reloads dockerd without restarting containers. "
    "Then `orchestrator doctor` again."
)


def check_sandbox_kernel(info: dict[str, Any]) -> str:
    registered = info.get("Runtimes") or {}
    runtimes = sorted(registered)
    if {RUNSC, RUNSC_NET} <= set(runtimes):
        unfiltered = without_seccomp(registered)
        if unfiltered:
            raise HostProblem(
                f"gVisor is registered, but {' and '.join(unfiltered)} without {OCI_SECCOMP}: "
                "gVisor sandboxes run without our seccomp filter (gVisor ignores the engine's "
                "seccomp option unless asked), one layer instead of two",
                GVISOR_FIX,
            )
        return (
            f"gVisor is registered ({RUNSC}, {RUNSC_NET}, {OCI_SECCOMP}): runs on `auto` get "
            f"gVisor's kernel behind the seccomp profile {PROFILE_NAME}"
        )
    if direct_refusal() is None:
        return (
            f"gVisor is not registered with the engine (its runtimes: {', '.join(runtimes)}), "
            "but runsc is installed and this host can run it itself: runs on `auto` get "
            f"gVisor's kernel through runsc-direct, behind the seccomp profile {PROFILE_NAME} "
            "(--sandbox-runtime runsc, gVisor through the engine, needs "
            "scripts/setup-gvisor.sh)"
        )
    raise HostProblem(
        f"the engine has no gVisor (its runtimes: {', '.join(runtimes) or 'none'}): runs on "
        "`auto` get runc, whose sandboxes' system calls reach the host's kernel (behind "
        f"the seccomp profile {PROFILE_NAME})",
        GVISOR_FIX,
    )


def check_seccomp(info: dict[str, Any]) -> str:
    options = [str(o) for o in info.get("SecurityOptions") or []]
    seccomp = [o for o in options if o.startswith("name=seccomp")]
    if not seccomp:
        raise HostProblem(
            "the engine applies no seccomp filter (`docker info` lists no name=seccomp "
            f"under Security Options: {', '.join(options) or 'none'}): sandboxes on runc "
            "would reach every system call of the host's kernel",
            "Use a Docker engine built with seccomp on a kernel with CONFIG_SECCOMP_FILTER "
            "(Debian's docker.io is), or run every sandbox on gVisor "
            "(--sandbox-runtime runsc).",
        )
    return f"seccomp available ({seccomp[0]}); runc sandboxes get {PROFILE_NAME}"


def check_cgroup_limits(info: dict[str, Any]) -> str:
    missing = [name for name in ("MemoryLimit", "PidsLimit") if info.get(name) is False]
    if missing:
        raise HostProblem(
            f"the engine cannot enforce {' and '.join(missing)} (its cgroups lack them): a "
            "sandbox's memory or process limit would not hold",
            "Enable the memory and pids cgroup controllers (kernel command line "
            "`cgroup_enable=memory swapaccount=1`, then reboot).",
        )
    return f"memory and pids limits enforceable (cgroup v{info.get('CgroupVersion', '?')})"


def check_engine_log(info: dict[str, Any]) -> str:
    if info.get("Debug"):
        raise HostProblem(
            "the engine runs in debug mode: it writes the body of every API request to its "
            "own log, a container's environment among them (a run's gateway token, or the "
            "model key of a --no-gateway run)",
            'Turn the engine\'s debug mode off (`"debug": false` in /etc/docker/daemon.json, '
            "no `-D` on dockerd's command line), then reload or restart the engine.",
        )
    return (
        "the engine is not in debug mode: request bodies (containers' environment) stay out "
        "of its log; sandboxes have no engine-side log (log driver `none`)"
    )


def check_snapshots(info: dict[str, Any]) -> str:
    """Speed, never safety: says whether gVisor runs start from a snapshot, or why they start
    cold and what turns snapshots on; it does not fail (a cold start is as safe). Where this
    host can run runsc-direct, `auto` runs there, and restores from runsc's own snapshots
    whatever the engine's mode."""
    engine = engine_snapshots(info)
    refused = direct_refusal()
    if refused is None:
        return (
            "runs on `auto` start from a snapshot that runsc restores itself (runsc-direct; "
            "the engine's experimental mode is not needed), networked ones cold; runs that ask "
            f"for runsc (gVisor through the engine): {engine}"
        )
    if RUNSC not in (info.get("Runtimes") or {}):
        return engine
    return f"{engine}; runsc-direct (runsc's own snapshots) cannot run here: {refused}"


def engine_snapshots(info: dict[str, Any]) -> str:
    """Whether gVisor runs through the engine start from its checkpoints, or why not."""
    if RUNSC not in (info.get("Runtimes") or {}):
        return "no gVisor, nothing to restore: runs on runc start cold (no checkpoints there)"
    reason = snapshots.why_cold(info)
    if reason is not None:
        return f"gVisor runs start cold, about 1 s slower each: {reason}"
    return (
        "gVisor runs without network start from a snapshot of the ready runtime, restored "
        "into a new sandbox each time (`images list` shows the snapshots)"
    )


def direct_refusal() -> str | None:
    """Why this host cannot run runsc-direct (`direct.why_not_here`), None where it can."""
    from .runsc_direct import direct

    return direct.why_not_here()


#: Storage drivers that cost every sandbox CPU: fuse-overlayfs serves each file a container
#: opens from a FUSE process in user space (Python's imports open hundreds; measured:
#: benchmarks/results/code_figures.md#slow-storage-drivers), vfs copies the whole image for
#: each container.
SLOW_STORAGE = {
    "fuse-overlayfs": "serves each file a sandbox opens from a process in user space (FUSE)",
    "vfs": "copies the whole image for each sandbox",
}


def check_storage(info: dict[str, Any]) -> str:
    """Speed, never safety: names the engine's storage driver, and a slow one's cost and
    way out (overlay2, which Docker picks by itself where the kernel mounts it); it does
    not fail."""
    driver = str(info.get("Driver") or "unknown")
    if driver in SLOW_STORAGE:
        root = info.get("DockerRootDir") or "/var/lib/docker"
        return (
            f"the engine stores containers with {driver}, which {SLOW_STORAGE[driver]}: "
            "each run costs about a fifth more CPU than on overlay2. Where the kernel mounts "
            f'overlay on {root}\'s file system, `"storage-driver": "overlay2"` in '
            "/etc/docker/daemon.json and a restart of dockerd move it (images are rebuilt; "
            "in a checkout: `bash scripts/use-overlay2.sh`)"
        )
    return f"the engine stores containers with {driver}"


HOST_CHECKS: tuple[HostCheck, ...] = (
    HostCheck(
        "host.sandbox_kernel",
        "runs on `auto` get gVisor's kernel, behind our seccomp filter",
        check_sandbox_kernel,
    ),
    HostCheck("host.seccomp", "the engine applies seccomp filters", check_seccomp),
    HostCheck(
        "host.cgroup_limits", "the engine can enforce memory and pids limits", check_cgroup_limits
    ),
    HostCheck("host.engine_log", "the engine's own log holds no secret", check_engine_log),
    HostCheck(
        "host.snapshots",
        "gVisor runs start from a snapshot where the engine can checkpoint (speed only)",
        check_snapshots,
    ),
    HostCheck(
        "host.storage",
        "the engine's storage driver serves sandboxes' files at full speed (speed only)",
        check_storage,
    ),
)


class EngineHostChecks(Backend):
    """A backend on this host's Docker engine (`DockerBackend` and those built on it): the
    host checks above, judging the engine's own description."""

    host_checks = HOST_CHECKS
    client: docker.DockerClient

    def host_facts(self) -> dict[str, Any]:
        """The engine's own description (`docker info`), which `host_checks` judge."""
        info: dict[str, Any] = self.client.api.info()
        return info
