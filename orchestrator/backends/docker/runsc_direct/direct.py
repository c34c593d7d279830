"""The `runsc-direct` sandbox runtime of the Docker backend: what a run gets (a new container
restored from its shape's snapshot, or a networked one started cold beside its holder), and
what cleanup finds and removes.

A run: the image exported once (bundle.py), the sandbox's spec written from our policy
(ocispec.py), the snapshot of that spec made once (snapshot.py), then a new container
restored from it in a cgroup of its own (cgroup.py, sandbox.py), told at once that it was
restored (RESTORED_ACK_LINE: it reseeds, its keeper's idle time starts again, and it says
when it is done, RESTORE_DONE_LINE: the run's CPU limit is set then).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import docker
import docker.errors

from orchestrator_runtime.protocol import RESTORED_ACK_LINE
from orchestrator_runtime.request import Request

from ....errors import ConfigError
from ....labels import LABEL_KIND
from ...base import Progress, SandboxInfo, SandboxSpec
from .. import snapshot_store, snapshots
from ..deadline import (
    AGENT_KEEPER,
    deadline_at,
    idle_kept,
    kept,
    restorable_kept,
    run_seconds,
)
from ..runtimes import RUNSC_DIRECT, SETUP_SCRIPT, Placement
from ..snapshots import RESTORABLE_IDLE
from . import bundle, head_start, ocispec, records, snapshot
from .cgroup import Cgroup, boot_cpus, unusable
from .records import SandboxRecord
from .sandbox import RunscSandbox, remove_left

if TYPE_CHECKING:
    from ..sandbox import DockerSandbox

#: How long a pooled sandbox's runtime may take to import everything (backend.py's).
IDLE_READY_TIMEOUT = 60.0


def why_not_here() -> str | None:
    """Why this host cannot run this runtime's sandboxes, as a clause (None: it can): no
    runsc on PATH, or sandbox cgroups this process cannot make (`cgroup.unusable`). Asked by
    `auto` (`DockerBackend.runtime_for`) and by doctor."""
    if shutil.which("runsc") is None:
        return "there is no `runsc` on PATH (setup-gvisor.sh installs it)"
    return unusable()


def unavailable() -> ConfigError | None:
    """The refusal of a run that asks for this runtime where it cannot run (`why_not_here`),
    before anything starts (exit 2) instead of failing half-made; None where it can."""
    reason = why_not_here()
    if reason is None:
        return None
    return ConfigError(
        f"--sandbox-runtime {RUNSC_DIRECT} cannot run here: {reason}. Nothing was started.",
        f"Set gVisor up once, as root: `bash {SETUP_SCRIPT}`, and run orchestrator as root on "
        "a host whose cgroups it can write; or choose --sandbox-runtime runsc (gVisor through "
        "the engine) or auto.",
    )


def create(
    client: docker.DockerClient, spec: SandboxSpec, progress: Progress, idle: float | None = None
) -> RunscSandbox:
    """The run's sandbox, restored from its snapshot (made first when there is none) and
    running, waiting for its request. `idle`: a pooled sandbox's time-to-live, which its
    keeper idles after the restore unless a run takes it (in the keeper's argv: pools and
    single runs have a snapshot each, one per time-to-live)."""
    if networked(spec):
        raise ValueError("a networked sandbox is made beside its holder (`beside`)")
    image = bundle.ensure(client, spec.image, progress)
    env = list(client.api.inspect_image(spec.image)["Config"].get("Env") or [])
    if not snapshot_store.enabled():  # $ORCHESTRATOR_SNAPSHOTS=off: every run cold, silently
        return cold(RunscSandbox(*_new(spec), spec), spec, image.rootfs, env, None, idle)
    idle_seconds = RESTORABLE_IDLE if idle is None else idle
    argv = restorable_kept(AGENT_KEEPER, idle_seconds, run_seconds(spec.limits), list(spec.command))
    config = ocispec.config(image.rootfs, argv, env, spec.limits)
    try:
        ready = snapshot.ensure(image, config, spec.limits, progress)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        said = getattr(exc, "stderr", None) or exc
        snapshots.say_cold_once(f"the runsc snapshot could not be made ({said!s:.300})")
        return cold(RunscSandbox(*_new(spec), spec), spec, image.rootfs, env, None, idle)
    return restore(ready, spec)


def _new(spec: SandboxSpec) -> tuple[SandboxRecord, Cgroup]:
    """A new sandbox's record (not saved yet) and cgroup (not made yet)."""
    container_id = records.new_id(spec.run_id)
    record = SandboxRecord(container_id, {**spec.labels, LABEL_KIND: "sandbox"})
    return record, Cgroup.of(container_id)


S = TypeVar("S", bound=RunscSandbox)


def cold(
    sandbox: S,
    spec: SandboxSpec,
    rootfs: Path,
    env: list[str],
    netns: str | None,
    idle: float | None,
    names: dict[str, bytes] | None = None,
) -> S:
    """`sandbox` started cold (`runsc run`) with a bundle folder of its own (its
    config.json, and a copy of each of `names`, bound read-only at its path: a networked
    sandbox's name files; the root is the image's): its keeper holds the run's deadline,
    or a pooled one's time-to-live (`idle`: it is ready when this returns). Everything of
    it is removed again when this fails."""
    command = list(spec.command)
    if idle is None:
        argv = kept(AGENT_KEEPER, deadline_at(spec.limits), command)
    else:
        argv = idle_kept(AGENT_KEEPER, time.time() + idle, run_seconds(spec.limits), command)
    if not sandbox.isolation:
        sandbox.isolation = Placement("runsc", RUNSC_DIRECT, spec.runtime).isolation(spec.limits)
    try:
        folder = records.bundle_dir(sandbox.id)
        folder.mkdir(parents=True)
        files = {}
        for destination, content in (names or {}).items():
            copy = folder / Path(destination).name
            copy.write_bytes(content)
            copy.chmod(0o644)  # root's: the sandbox's user reads it, as the engine's
            files[destination] = copy
        config = ocispec.config(rootfs, argv, env, spec.limits, netns, files)
        (folder / "config.json").write_text(json.dumps(config))
        sandbox.record.save()
        sandbox.cgroup.make(spec.limits, boot_cpus(spec.limits))
        sandbox.launch(["run", f"--bundle={folder}", sandbox.id])
        if idle is not None:
            sandbox.wait_idle(IDLE_READY_TIMEOUT)
    except BaseException:
        sandbox.remove()
        raise
    return sandbox


def restore(ready: snapshot.Snapshot, spec: SandboxSpec) -> RunscSandbox:
    """A new container of `spec`'s run restored from `ready`, in its own cgroup, told it was
    restored: the command's head start when it restores `ready` with these limits
    (head_start.py), else one restored now. Everything of it is removed again when this
    fails."""
    begun = head_start.take(ready.key, ready.folder, spec.limits, spec.labels)
    placement = Placement("runsc", RUNSC_DIRECT, spec.runtime)
    isolation = {**placement.isolation(spec.limits), "snapshot": ready.key}
    if begun is not None:
        record, cgroup, sandbox_process = begun
        sandbox = RunscSandbox(record, cgroup, spec)
        sandbox.proc = sandbox_process
        sandbox.isolation = {**isolation, "restore_begun": "at the command's start"}
    else:
        record, cgroup = _new(spec)
        record.save()
        sandbox = RunscSandbox(record, cgroup, spec)
        sandbox.isolation = isolation
        try:
            cgroup.make(spec.limits, boot_cpus(spec.limits))
            sandbox.launch(
                [
                    "restore",
                    f"--image-path={ready.checkpoint}",
                    f"--bundle={ready.folder}",
                    record.id,
                ]
            )
            sandbox.write(RESTORED_ACK_LINE.encode())  # its answer ends the restore (`start`)
        except BaseException:
            sandbox.remove()
            raise
    sandbox.restoring = True
    snapshot.mark_used(ready)
    # A snapshot runsc cannot restore (the run ends `infra_error`, which a batch retries) is
    # removed, so that the next run makes it again rather than fail the same way.
    sandbox.on_restore_failed = lambda: snapshot.remove(ready)
    return sandbox


def list_sandboxes(labels: dict[str, str]) -> list[SandboxInfo]:
    """This path's sandboxes (and snapshot makers) carrying all of `labels`: running while
    their runsc process runs."""
    found = []
    for record in records.list_records(labels):
        state = "running" if record.running() else "exited"
        found.append(SandboxInfo(record.id, record.id, record.labels, state, record.kind))
    return found


def remove(sandbox_id: str) -> None:
    """A sandbox `list_sandboxes` found (an orphan): its processes, runsc's state of it, its
    cgroup and its record. Gone already is fine."""
    remove_left(sandbox_id, Cgroup.of(sandbox_id))
    record = records.load(sandbox_id)
    if record is not None:
        record.forget()


#: The kind label of a networked sandbox's holder container.
KIND_HOLDER = "network-holder"


def networked(spec: SandboxSpec) -> bool:
    """Whether a sandbox needs the run's Docker network (a holder container): a network,
    a model gateway or bound secrets (both reached over it)."""
    return spec.network.mode != "none" or spec.gateway is not None or bool(spec.bindings)


#: What a holder container runs under its keeper (which stops it at the run's deadline):
#: nothing, until it is killed. It only holds its network namespace on the run's network.
HOLDER_COMMAND = ("python", "-I", "-S", "-c", "import signal; signal.pause()")


def beside(
    client: docker.DockerClient,
    spec: SandboxSpec,
    holder: DockerSandbox,
    progress: Progress,
    idle: float | None = None,
) -> HeldSandbox:
    """A networked run's sandbox: started cold by runsc (gVisor cannot checkpoint the host
    network stack it then uses) in the network namespace of `holder`, a created container
    on the run's Docker network with its egress proxy, gateway and interceptor beside it,
    as a Kubernetes pod's containers join its pause container's. The holder's environment
    (the image's and the proxy settings) and its name files (`holder_names`) are the
    sandbox's. `idle`: a pooled sandbox's time-to-live (it is ready when this returns).
    Everything is removed again when this fails."""
    sandbox = HeldSandbox(*_new(spec), spec, holder)
    try:
        image = bundle.ensure(client, spec.image, progress)
        if not holder.started:
            holder.prestart()
        state = client.api.inspect_container(holder.id)
        pid = int(state["State"].get("Pid") or 0)
        if pid <= 0:
            raise RuntimeError(f"the network holder {holder.id[:12]} is not running")
        names = holder_names(state)
    except BaseException:
        sandbox.remove()
        raise
    env = list(state["Config"].get("Env") or [])
    return cold(sandbox, spec, image.rootfs, env, f"/proc/{pid}/ns/net", idle, names)


#: The files the engine writes for each container on a network, which name resolution reads
#: (the exported image's are empty: Docker's mount points), and the field of the holder's
#: inspection that says where the engine keeps each.
NAME_PATHS = {
    "/etc/resolv.conf": "ResolvConfPath",
    "/etc/hosts": "HostsPath",
    "/etc/hostname": "HostnamePath",
}


def holder_names(state: dict[str, Any]) -> dict[str, bytes]:
    """The name files the engine wrote for the holder (`state`: its inspection): its
    resolver (the host's, or the engine's own DNS on a run's network), its hosts (with the
    run's extra hosts) and its host name, read from the engine's own copies (the paths its
    inspection names, in the engine's data root), never through the container's root,
    where an image's symlink would lead the read elsewhere on the host. In its network
    namespace the sandbox then resolves names exactly as the holder, and the engine path's
    sandbox, would. Copied, not bound: runsc's gofer serves only files of our state
    directory, and nothing the engine rewrites later reaches the sandbox. Raises OSError
    when a file is gone (the holder was removed), RuntimeError when the engine names none."""
    names = {}
    for destination, field in NAME_PATHS.items():
        source = state.get(field)
        if not source:
            raise RuntimeError(f"the engine names no {destination} for the network holder")
        names[destination] = Path(source).read_bytes()
    return names


class HeldSandbox(RunscSandbox):
    """A sandbox in a holder container's network namespace: what is beside it (egress
    proxy, gateway, interceptor) is the holder's, and goes with it."""

    def __init__(
        self, record: SandboxRecord, cgroup: Cgroup, spec: SandboxSpec, holder: DockerSandbox
    ) -> None:
        super().__init__(record, cgroup, spec, network="holder")
        self.holder = holder
        self.gateway = holder.gateway
        self.secrets_proxy = holder.secrets_proxy
        placement = Placement("runsc", RUNSC_DIRECT, spec.runtime)
        self.isolation = placement.isolation(spec.limits)

    def start(self, request: Request, secrets: dict[str, str]) -> None:
        """As a restored one's, once the holder's squid and gateway are ready."""
        if self.holder.egress is not None:
            self.holder.egress.wait_ready()
        if self.holder.gateway is not None:
            self.holder.gateway.wait_ready()
        super().start(request, secrets)

    def health(self) -> str | None:
        return self.holder.health()

    def egress_blocked(self, *, final: bool = False) -> list[dict[str, Any]]:
        """The holder's proxy's refusals (`final`: its log flushed first)."""
        return self.holder.egress_blocked(final=final)

    def remove_sandbox_only(self) -> None:
        super().remove()
        self.holder.remove_sandbox_only()

    def remove(self) -> None:
        self.remove_sandbox_only()
        self.holder.remove()
