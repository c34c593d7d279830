"""A sandbox's OCI runtime spec (config.json) for runsc: the hardening the Docker path asks the
engine for (hardening.py), written out as data, each line saying why.

What the engine would add on its own and we do here: the image's environment and a hostname;
the mounts every container has (proc, dev, sys); a networked sandbox's name files (its
holder's `/etc/resolv.conf`, `/etc/hosts`, `/etc/hostname`, read-only); the seccomp profile
turned from Docker's format (archMap, includes) into the OCI one (architectures, plain
rules). The memory, CPU and pids limits are not here: runsc runs with `--ignore-cgroups`
inside the run's own cgroup (cgroup.py).
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

from ....spec import Limits
from ..runtimes import gvisor_nproc
from ..seccomp import gvisor_profile_text

#: The unprivileged user of the agent image (images/agent/Dockerfile), as the engine path's.
SANDBOX_UID = SANDBOX_GID = 10001
#: The sandbox's host name, as the engine path's (`DockerBackend._config`).
HOSTNAME = "sandbox"
#: The runtime's working folder: one of the run's own tmpfs mounts.
WORKDIR = "/work"
#: Docker's names for this machine's architecture in a profile's `includes.arches`.
DOCKER_ARCHES = {"x86_64": ("amd64", "x32", "x86"), "aarch64": ("arm64", "arm")}


def tmpfs(destination: str, size_mb: int) -> dict[str, Any]:
    """A run's writable folder: memory-backed, sized, no devices, no set-uid, no exec (as the
    engine path's `--tmpfs`), writable by the sandbox user (mode 1777)."""
    options = ["rw", "nosuid", "nodev", "noexec", f"size={size_mb}m", "mode=1777"]
    return {"destination": destination, "type": "tmpfs", "source": "tmpfs", "options": options}


def read_only_file(destination: str, source: Path) -> dict[str, Any]:
    """A host file the sandbox reads at `destination` and never writes (as the engine's
    name files of a read-only container): a bind mount, read-only, no devices, no set-uid,
    no exec."""
    options = ["bind", "ro", "nosuid", "nodev", "noexec"]
    return {"destination": destination, "type": "bind", "source": str(source), "options": options}


def config(
    rootfs: Path,
    argv: list[str],
    env: list[str],
    limits: Limits,
    netns: str | None = None,
    files: dict[str, Path] | None = None,
) -> dict[str, Any]:
    """The whole config.json of a sandbox running `argv` (the keeper and the runtime) with
    `env` (the image's, and a networked run's proxy settings), on the read-only `rootfs`,
    with `limits`' mounts and rlimits; `netns`: the network namespace it joins (a holder
    container's), else one of its own with nothing in it; `files`: host files bound
    read-only over the root's (a networked sandbox's name files, by destination)."""
    network: dict[str, str] = {"type": "network"}
    if netns is not None:
        network["path"] = netns
    nproc = gvisor_nproc(limits)
    no_caps: list[str] = []
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,  # stdin, stdout, stderr are the host's pipes (sandbox.py)
            "user": {"uid": SANDBOX_UID, "gid": SANDBOX_GID, "additionalGids": []},
            "args": argv,
            "env": [*env, f"HOSTNAME={HOSTNAME}"],
            "cwd": WORKDIR,
            # No capabilities in any set: the engine path's cap-drop ALL.
            "capabilities": {
                "bounding": no_caps,
                "effective": no_caps,
                "inheritable": no_caps,
                "permitted": no_caps,
                "ambient": no_caps,
            },
            "rlimits": [
                {"type": "RLIMIT_NOFILE", "soft": 1024, "hard": 1024},  # as the engine path's
                {"type": "RLIMIT_CORE", "soft": 0, "hard": 0},  # no core dumps of the payload
                # gVisor's kernel holds the sandbox to its processes at clone (runtimes.py,
                # GVISOR_PROCESS_MB: what its memory carries); the user cannot raise it.
                {"type": "RLIMIT_NPROC", "soft": nproc, "hard": nproc},
            ],
            "noNewPrivileges": True,  # no privilege gained through a set-uid binary
        },
        # The exported image, shared by every sandbox of the image: never written.
        "root": {"path": str(rootfs), "readonly": True},
        "hostname": HOSTNAME,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {
                "destination": "/dev",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
            },
            {
                "destination": "/dev/shm",  # the engine path's private IPC's /dev/shm
                "type": "tmpfs",
                "source": "shm",
                "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
            },
            {
                "destination": "/sys",
                "type": "sysfs",
                "source": "sysfs",
                "options": ["nosuid", "noexec", "nodev", "ro"],
            },
            tmpfs("/tmp", limits.tmpfs_mb),
            tmpfs(WORKDIR, limits.tmpfs_mb),
            *(read_only_file(dest, source) for dest, source in (files or {}).items()),
        ],
        "linux": {
            # Namespaces of its own for gVisor's host processes too (a new network namespace:
            # not even loopback of the host's); the sandbox's own are gVisor's.
            "namespaces": [
                {"type": "pid"},
                network,
                {"type": "ipc"},
                {"type": "uts"},
                {"type": "mount"},
            ],
            "seccomp": oci_seccomp(),
        },
    }


def oci_seccomp(machine: str | None = None) -> dict[str, Any]:
    """Our profile as gVisor applies it (`seccomp.gvisor_profile_text`), in the OCI spec's
    form: the architectures flattened from `archMap`, the rules for other architectures
    left out (Docker's `includes.arches`), those that need a capability left out (the
    sandbox has none), and `errnoRet` kept (this gVisor answers EPERM regardless)."""
    arches = DOCKER_ARCHES.get(machine or platform.machine(), ())
    profile = json.loads(gvisor_profile_text())
    architectures = []
    for entry in profile.get("archMap") or ():
        architectures += [entry["architecture"], *entry.get("subArchitectures", ())]
    rules = []
    for rule in profile["syscalls"]:
        includes, excludes = rule.get("includes") or {}, rule.get("excludes") or {}
        if includes.get("caps"):
            continue
        if includes.get("arches") and not set(includes["arches"]) & set(arches):
            continue
        if excludes.get("arches") and set(excludes["arches"]) & set(arches):
            continue
        oci: dict[str, Any] = {"names": rule["names"], "action": rule["action"]}
        if "errnoRet" in rule:
            oci["errnoRet"] = rule["errnoRet"]
        if rule.get("args"):
            oci["args"] = [
                {
                    "index": arg["index"],
                    "value": arg["value"],
                    "valueTwo": arg.get("valueTwo", 0),
                    "op": arg["op"],
                }
                for arg in rule["args"]
            ]
        rules.append(oci)
    found = {"defaultAction": profile["defaultAction"], "architectures": architectures}
    return {**found, "syscalls": rules}
