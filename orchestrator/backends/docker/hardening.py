"""The engine options of every sandbox container: its hardening (capabilities, seccomp,
read-only root, limits, no log) and its network (none, the default bridge, or the run's
private network behind its egress proxy), as plain data rendered for `create_host_config`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from docker.types import LogConfig, Ulimit

from ...policy import HOST_ALIAS
from ...spec import NetworkPolicy
from ..base import SandboxSpec
from .runtimes import Placement

if TYPE_CHECKING:  # a run's helpers, imported only by the runs that have them
    from .egress import Egress


def host_config_options(
    spec: SandboxSpec, egress: Egress | None = None, placement: Placement | None = None
) -> dict[str, Any]:
    """The hardening of every sandbox, as `create_host_config` keyword arguments.

    CIS Docker Benchmark section 5, stricter: no capabilities at all, no host mounts; on
    `placement`'s runtime (default runc), under runc with our seccomp profile.
    """
    placement = placement or Placement("runc", "runc", spec.runtime)
    pids, ulimits = placement.pids_options(spec.limits)
    limits = spec.limits
    memory = f"{limits.memory_mb}m"
    tmpfs = f"rw,nosuid,nodev,noexec,size={limits.tmpfs_mb}m,mode=1777"
    return {
        "cap_drop": ["ALL"],
        "security_opt": placement.security_options(),
        "runtime": placement.engine_runtime,
        "read_only": True,
        "tmpfs": {"/tmp": tmpfs, "/work": tmpfs},
        "mem_limit": memory,
        "memswap_limit": memory,  # no swap: over the limit is an OOM kill, not a crawl
        "nano_cpus": int(limits.cpus * 1e9),
        "pids_limit": pids,
        "ulimits": [
            Ulimit(name="nofile", soft=1024, hard=1024),
            Ulimit(name="core", soft=0, hard=0),
            *ulimits,
        ],
        # PID 1 is the deadline keeper (deadline.py), not docker-init: it reaps and forwards
        # signals as an init does (kill is instant, no grace period), and it stops the
        # container at its deadline even when no orchestrator process is left.
        "init": False,
        "ipc_mode": "private",
        **network_options(spec.network, egress),
        # No engine-side log: what the sandbox prints (secrets a tool prints included) reaches
        # the host only through the attached streams, masked into the run record; nothing
        # lands in the engine's data directory, not even while the run is live or after its
        # orchestrator was killed.
        "log_config": LogConfig(type="none"),
        "auto_remove": False,  # removed by us after the exit state is read
    }


def network_options(policy: NetworkPolicy, egress: Egress | None) -> dict[str, Any]:
    """`none`: no network. `open`: the default bridge. `allowlist`: the run's private network
    only (its one way out is the egress proxy), and a DNS server that does not exist, so no
    outside name resolves."""
    if policy.mode == "none":
        return {"network_mode": "none"}
    if policy.mode == "open":
        hosts = {HOST_ALIAS: "host-gateway"} if policy.host_endpoints else None
        return {"network_mode": "bridge", "extra_hosts": hosts}
    if egress is None:
        raise ValueError("an allowlist sandbox needs its egress network")
    return {"network_mode": egress.network_name, "dns": ["127.0.0.1"]}
