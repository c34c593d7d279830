"""What a run's helper containers share (squid's egress proxy in egress.py, the model gateway
in gateway.py, the secret interceptor in interceptor.py): their hardening and shape
(`create_helper`), how one with an attached stdin starts (`start_attached`), the error that
stops a run without one (`HelperError`) and how a helper's content-addressed image is made
(`HelperImagePlan`, `ensure_helper_image`).

They run our code, not the payload's: runc with our seccomp profile (no gVisor, runtimes.py),
a read-only root with memory-only scratch directories, no capability (their ports are above
1024), small limits, the run's labels with their kind, and the deadline keeper as PID 1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from docker.types import LogConfig

from ...errors import OrchestratorError
from ...images.imagedef import Progress, build_lock, report
from ...labels import LABEL_KIND
from ...paths import VERSION
from .engine import inspect_image
from .images import build_image
from .seccomp import security_options

if TYPE_CHECKING:
    import docker

#: Their scratch directories: memory only, nothing executable.
TMPFS = "rw,nosuid,nodev,noexec,size=16m,mode=1777"
#: No engine-side log (a key, a secret's value or a model call would stay on the disk).
NO_LOG = LogConfig(type="none")


class HelperError(OrchestratorError):
    """A helper container could not be started (the run never starts without it)."""

    exit_code = 5


@dataclass(frozen=True)
class HelperLimits:
    """A helper's limits: small, it only relays."""

    memory: str = "256m"
    pids: int = 64
    cpus: float = 1.0


def create_helper(
    api: docker.APIClient,
    *,
    kind: str,
    run_id: str,
    image: str,
    entrypoint: list[str],
    labels: dict[str, str],
    network_mode: str,
    limits: HelperLimits,
    user: str | None = None,
    scratch: Sequence[str] = ("/tmp",),
    extra_hosts: dict[str, str] | None = None,
    log_config: LogConfig | dict[str, Any] = NO_LOG,
) -> str:
    """Create (not start) the run's helper of `kind` (its label, host name and part of its
    name), hardened as above, its stdin open; returns its id. `user`: its working directory
    is then /tmp. Raises the engine's errors."""
    host_config = api.create_host_config(
        network_mode=network_mode,
        cap_drop=["ALL"],
        security_opt=security_options(),
        runtime="runc",
        read_only=True,
        tmpfs={path: TMPFS for path in scratch},
        mem_limit=limits.memory,
        memswap_limit=limits.memory,
        nano_cpus=int(limits.cpus * 1e9),
        pids_limit=limits.pids,
        ipc_mode="private",
        init=False,  # PID 1 is the deadline keeper (deadline.py)
        extra_hosts=extra_hosts,
        log_config=log_config,
    )
    container = api.create_container(
        image=image,
        entrypoint=entrypoint,
        command=[],
        name=f"orchestrator-{kind}-{run_id}",
        user=user,
        working_dir="/tmp" if user else None,
        labels={**labels, LABEL_KIND: kind},
        hostname=kind,
        stdin_open=True,  # its configuration comes on stdin, never its environment
        tty=False,
        host_config=host_config,
    )
    return str(container["Id"])


def container_ip(api: docker.APIClient, container_id: str, network_name: str) -> str:
    """The container's address on `network_name`."""
    networks = api.inspect_container(container_id)["NetworkSettings"]["Networks"]
    return str(networks[network_name]["IPAddress"])


def start_attached(api: docker.APIClient, container_id: str, network_name: str) -> tuple[Any, str]:
    """Attach to the helper's stdin, stdout and stderr, start it, and return the attached
    socket and its address on `network_name`; the socket is closed again on failure."""
    params = {"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
    attached = api.attach_socket(container_id, params=params)
    try:
        api.start(container_id)
        return attached, container_ip(api, container_id, network_name)
    except BaseException:
        with contextlib.suppress(Exception):
            attached.close()
        raise


@dataclass(frozen=True)
class HelperImagePlan:
    """What a helper's image is made of, and its content-addressed tag."""

    tag: str
    content_hash: str
    base: str
    base_id: str
    files: dict[str, bytes]
    #: The base's Python, for an image that installs wheels for it ("": none).
    python: str = ""
    wheels: dict[str, Path] = field(default_factory=dict)


def ensure_helper_image(
    client: docker.DockerClient, plan: HelperImagePlan, what: str, progress: Progress | None
) -> str:
    """The plan's image, built once (under the plan's build lock) when missing; `what` names
    it in the progress line."""
    if inspect_image(client, plan.tag) is not None:
        return plan.tag
    with build_lock(plan.content_hash):
        if inspect_image(client, plan.tag) is None:
            report(progress, f"building {plan.tag} ({what}) on {plan.base}")
            buildargs = {
                "BASE_IMAGE": plan.base_id,
                "ORCHESTRATOR_BASE": plan.base,
                "ORCHESTRATOR_VERSION": VERSION,
                "ORCHESTRATOR_CONTENT_HASH": plan.content_hash,
            }
            if plan.python:
                buildargs["ORCHESTRATOR_PYTHON"] = plan.python
            build_image(client, plan.tag, plan.files, plan.wheels, buildargs, progress)
    return plan.tag
