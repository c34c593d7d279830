"""The `runsc-direct` sandbox runtime of the Docker backend: what a run gets (a new container
restored from its shape's snapshot), what it refuses yet, and what cleanup finds and removes.

A run: the image exported once (bundle.py), the sandbox's spec written from our policy
(ocispec.py), the snapshot of that spec made once (snapshot.py), then a new container
restored from it in a cgroup of its own (cgroup.py, sandbox.py), told at once that it was
restored (RESTORED_LINE: it reseeds, its keeper's idle time starts again).
"""

from __future__ import annotations

import docker

from orchestrator_runtime.protocol import RESTORED_LINE

from ....errors import ConfigError
from ....labels import LABEL_KIND
from ...base import Progress, SandboxInfo, SandboxSpec
from ..deadline import AGENT_KEEPER, restorable_kept, run_seconds
from ..runtimes import Placement
from ..snapshots import RESTORABLE_IDLE
from . import bundle, ocispec, records, snapshot
from .cgroup import Cgroup
from .records import SandboxRecord
from .sandbox import RunscSandbox, remove_left

#: The runtime's name, as `--sandbox-runtime` takes it.
RUNSC_DIRECT = "runsc-direct"


def refusal(spec: SandboxSpec) -> ConfigError | None:
    """Why this runtime cannot run `spec` yet (None: it can): only sandboxes without
    network, model gateway or bound secrets, until the sandbox joins a holder container's
    network namespace on the run's Docker network."""
    missing = []
    if spec.network.mode != "none":
        missing.append(f"network {spec.network.mode!r}")
    if spec.gateway is not None:
        missing.append("a model gateway (it needs a network)")
    if spec.bindings:
        missing.append("bound secrets (they need a network)")
    if not missing:
        return None
    return ConfigError(
        f"--sandbox-runtime {RUNSC_DIRECT} runs only sandboxes without network yet; this run "
        f"has {' and '.join(missing)}.",
        "Use --sandbox-runtime runsc (gVisor through the engine) or auto for this run, or "
        "--network none with a mock or --no-gateway model.",
    )


def create(
    client: docker.DockerClient, spec: SandboxSpec, progress: Progress, idle: float | None = None
) -> RunscSandbox:
    """The run's sandbox, restored from its snapshot (made first when there is none) and
    running, waiting for its request. `idle`: a pooled sandbox's time-to-live, which its
    keeper idles after the restore unless a run takes it (in the keeper's argv: pools and
    single runs have a snapshot each, one per time-to-live). Raises ConfigError for what
    `refusal` names."""
    refused = refusal(spec)
    if refused is not None:
        raise refused
    image = bundle.ensure(client, spec.image, progress)
    env = list(client.api.inspect_image(spec.image)["Config"].get("Env") or [])
    idle_seconds = RESTORABLE_IDLE if idle is None else idle
    argv = restorable_kept(AGENT_KEEPER, idle_seconds, run_seconds(spec.limits), list(spec.command))
    config = ocispec.config(image.rootfs, argv, env, spec.limits)
    ready = snapshot.ensure(image, config, spec.limits, progress)
    return restore(ready, spec)


def restore(ready: snapshot.Snapshot, spec: SandboxSpec) -> RunscSandbox:
    """A new container of `spec`'s run restored from `ready`, in its own cgroup, told it was
    restored. Everything of it is removed again when this fails."""
    container_id = records.new_id(spec.run_id)
    record = SandboxRecord(container_id, {**spec.labels, LABEL_KIND: "sandbox"})
    record.save()
    cgroup = Cgroup.of(container_id)
    sandbox = RunscSandbox(record, cgroup, spec)
    placement = Placement("runsc", RUNSC_DIRECT, spec.runtime)
    sandbox.isolation = {**placement.isolation(spec.limits), "snapshot": ready.key}
    try:
        cgroup.make(spec.limits)
        sandbox.launch(
            [
                "restore",
                f"--image-path={ready.checkpoint}",
                f"--bundle={ready.folder}",
                container_id,
            ]
        )
        sandbox.write(RESTORED_LINE.encode())
    except BaseException:
        sandbox.remove()
        raise
    snapshot.mark_used(ready)
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
