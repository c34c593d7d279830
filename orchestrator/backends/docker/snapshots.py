"""gVisor sandboxes restored from a snapshot: the runtime checkpointed once, ready (smolagents
and what a run needs imported, no request read), and each qualifying run restored into a NEW
container from it, which then reads its request on stdin as a cold one does.

What a snapshot holds, and what it must not. It is taken of a sandbox made exactly as a run's
(image, runtime, limits, seccomp, user, mounts, an empty environment: `none` networks carry no
proxy settings) whose runtime has imported everything and blocks on its first line of stdin.
No request, task, token or secret has reached the process yet: those arrive after the
restore, through stdin, as today. The first line the host writes, as soon as it restored
the sandbox (RESTORED_LINE), tells the runtime it was restored, and it reseeds `random`,
tempfile's names and OpenSSL's generator before anything else runs
(`orchestrator_runtime.idle.reseed`). Warm pools (batches,
`schedule serve`, cluster nodes) fill from snapshots too: a pooled sandbox is restored, then
waits for its run as a cold pooled one does (its keeper idles the pool's time-to-live).

Residual risk, accepted: every clone of a snapshot shares its memory layout (the addresses
ASLR chose when the snapshot was taken) and Python's string-hash seed (fixed at interpreter
start). An exploit that needs a leaked address learns it once for all clones; that helps
only code already running in a sandbox, which is the payload's own, inside gVisor's kernel
and our seccomp filter, with nothing of another run to reach (each clone is a new container
on its own tmpfs, and no two runs share one). The hash seed only orders sets and dicts.

The deadline keeper (PID 1) is checkpointed too: it runs in its restorable idle mode
(`orchestrator_runtime/deadline.py`, `--restorable-idle`), whose idle time starts again
at the restore (the runtime tells it when the restore line came; a keeper that wakes far
later than it asked notices by itself) and whose run deadline starts when the runtime has
read its request, so every restored sandbox stops on its own as a cold one does.

Which engines: only gVisor's `runsc` without network. runc's checkpoints need CRIU, which
fails on these hosts' kernels; gVisor with the host's network (`runsc-net`, hostinet) refuses
to checkpoint; gVisor's own network stack does not start with this runsc. Docker 20.10 needs
its experimental mode for `docker checkpoint` (scripts/enable-checkpoints.sh), and refuses
`--checkpoint-dir` for runsc: the checkpoint's files are therefore copied into the new
container's own checkpoint folder (`<data root>/containers/<id>/checkpoints/<name>`), which
needs write access to the engine's data root (root, a local engine). containerd's own API
(`containerd.services.tasks.v1.Tasks/Checkpoint` to an image, then a task created from it)
and Podman (`podman container checkpoint --export` / `restore --import`) restore a new
container from a checkpoint file without that copy.

Anything else starts cold (a fresh container): a run whose engine cannot (said once per
command on stderr, never an error), a run the snapshot path does not cover (runc, a
network), or a checkpoint or restore that fails.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

import docker
import docker.errors

from ...labels import run_labels
from ..base import Progress, SandboxSpec
from .runtimes import RUNSC, Placement
from .snapshot_store import (
    META_FILE,
    SNAPSHOTS_ENV,
    Snapshot,
    enabled,
    evict,
    find,
    keep_count,
    making_lock,
    mark_used,
    remove,
    snapshots_root,
)

#: The checkpoint's name, in the maker's folder and in each restored container's.
CHECKPOINT_NAME = "ready"
#: The file, beside gVisor's state file in a restored container's checkpoint folder, that
#: names the container (`Snapshots.restore`).
RESTORED_INTO = "restored-into"
#: The prefix of the folder containerd unpacks each restored checkpoint into: its task
#: service makes it with `os.MkdirTemp($XDG_RUNTIME_DIR, "ctrd-checkpoint")` (the temp dir
#: when that is unset) and never removes it (containerd 1.6 to 2.x; its size a restore:
#: benchmarks/results/code_figures.md#sizes-on-disk).
EXTRACTED_PREFIX = "ctrd-checkpoint"
#: A whole container id, as RESTORED_INTO holds it.
CONTAINER_ID = re.compile(r"[0-9a-f]{64}")
#: How long a restorable sandbox idles before its keeper stops it (seconds): the maker until
#: it is checkpointed, a restored one until its request is read (both take about a second).
RESTORABLE_IDLE = 60.0
#: How long the maker may take to import everything before it is given up.
MAKER_READY_TIMEOUT = 60.0
#: How long a pool's builder waits beyond that for another maker's checkpoint to be kept.
MAKER_CHECKPOINT_TIMEOUT = 30.0
#: The kind label of a snapshot's maker container (its owner's death makes it an orphan).
KIND_SNAPSHOT_MAKER = "snapshot-maker"


class Maker(Protocol):
    """What the snapshot path needs of a created (not started) sandbox container."""

    id: str
    isolation: dict[str, str]
    restored_from: str | None

    def prestart(self, checkpoint: str | None = None) -> None: ...

    def wait_idle(self, timeout: float) -> None: ...

    def remove_sandbox_only(self) -> None: ...


M = TypeVar("M", bound=Maker)


def covered(spec: SandboxSpec, placement: Placement) -> bool:
    """Whether the snapshot path covers a run at all: gVisor without network, no model
    gateway or secret interceptor beside it (those need a network). Others start cold
    without a word: that is how they are built, not something the engine lacks."""
    return (
        placement.engine_runtime == RUNSC
        and spec.network.mode == "none"
        and spec.gateway is None
        and not spec.bindings
    )


def engine_cannot(info: dict[str, Any], data_root_writable: bool) -> str | None:
    """Why the engine described by `info` (`docker info`) cannot restore sandboxes from
    snapshots, as a sentence for the user; None when it can."""
    if not info.get("ExperimentalBuild"):
        return (
            "the Docker engine's experimental mode is off, and `docker checkpoint` needs it "
            "(scripts/enable-checkpoints.sh turns it on)"
        )
    if any("rootless" in str(option) for option in info.get("SecurityOptions") or ()):
        return "the Docker engine is rootless, and its checkpoint folders are not ours to fill"
    if not data_root_writable:
        return (
            f"this user cannot write the engine's data root ({info.get('DockerRootDir')}), "
            "where a restored container's checkpoint must be placed"
        )
    return None


def containers_dir(info: dict[str, Any]) -> Path:
    """Where the engine described by `info` keeps its containers' folders (under its data
    root), a restored container's checkpoint among them."""
    return Path(str(info.get("DockerRootDir") or "/var/lib/docker")) / "containers"


def why_cold(info: dict[str, Any]) -> str | None:
    """Why gVisor runs on the engine described by `info` start cold, as a sentence; None
    when they are restored from snapshots."""
    if not enabled():
        return f"snapshots are turned off (${SNAPSHOTS_ENV})"
    return engine_cannot(info, os.access(containers_dir(info), os.W_OK))


@functools.cache
def extracted_roots() -> list[Path]:
    """Where containerd unpacks checkpoints to restore them: the XDG_RUNTIME_DIR (else TMPDIR)
    of each containerd process this process may read, and /tmp (its default, and where to
    look when its environment is not readable). Looked up once per process: it walks /proc."""
    roots = [Path("/tmp")]
    for comm in Path("/proc").glob("[0-9]*/comm"):
        with contextlib.suppress(OSError):
            if comm.read_text().strip() != "containerd":
                continue
            pairs = (comm.parent / "environ").read_bytes().split(b"\0")
            env = dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)
            roots.append(Path(env.get("XDG_RUNTIME_DIR") or env.get("TMPDIR") or "/tmp"))
    return list(dict.fromkeys(roots))


def remove_extracted(
    containers: Path, restored: str | None = None, roots: list[Path] | None = None
) -> int:
    """Remove the folders containerd unpacked our checkpoints into (EXTRACTED_PREFIX): that
    of the `restored` container (once it runs: gVisor has read its state by then), and
    those of containers that are gone (`containers`: the engine's containers folder; a
    restore that failed, or a process killed between the start and this call). A folder
    is ours only when it holds our RESTORED_INTO file, so nobody else's restore is
    touched. `roots`: where to look (`extracted_roots()`). Returns how many were removed;
    never raises."""
    removed = 0
    for root in extracted_roots() if roots is None else roots:
        with contextlib.suppress(OSError):
            for folder in root.glob(f"{EXTRACTED_PREFIX}*"):
                into = unpacked_for(folder)
                if into is not None and (into == restored or not (containers / into).exists()):
                    shutil.rmtree(folder, ignore_errors=True)
                    removed += 1
    return removed


def unpacked_for(folder: Path) -> str | None:
    """The container a folder containerd unpacked a checkpoint into was for (its
    RESTORED_INTO file); None when it is not ours, or its id is not whole yet (read while
    containerd unpacks it)."""
    try:
        into = (folder / RESTORED_INTO).read_text().strip()
    except OSError:
        return None
    return into if CONTAINER_ID.fullmatch(into) else None


def snapshot_id(image_id: str, runtime: dict[str, Any], config: dict[str, Any]) -> str:
    """The content address of a snapshot: a hash of the image's id, the engine runtime's
    registration (its path and flags) and the container's whole configuration except its
    name and labels (command line, user, environment, limits, seccomp, mounts)."""
    text = json.dumps(
        {"image": image_id, "runtime": runtime, "config": config}, sort_keys=True, default=str
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_said = threading.Lock()
_said_once: list[str] = []


def say_cold_once(reason: str) -> None:
    """One line on stderr per process (per command): gVisor runs start cold, and why."""
    with _said:
        if _said_once:
            return
        _said_once.append(reason)
    sys.stderr.write(f"orchestrator: gVisor sandboxes start cold (no snapshot): {reason}\n")
    sys.stderr.flush()


class Snapshots:
    """The snapshots of one engine: made on first need, restored into new containers."""

    def __init__(self, client: docker.DockerClient, info: Callable[[], dict[str, Any]]) -> None:
        self.client = client
        self.api = client.api
        self.info = info  # the engine's `docker info`, asked once (`EngineRuntimes.info`)
        self.keep = keep_count()  # a bad $ORCHESTRATOR_SNAPSHOTS_KEEP is refused up front
        self._image_ids: dict[str, str] = {}

    def restored(
        self,
        spec: SandboxSpec,
        placement: Placement,
        *,
        config: dict[str, Any],
        create: Callable[[SandboxSpec, str], M],
        progress: Progress,
        pooled: bool = False,
    ) -> M | None:
        """A covered run's sandbox, created by `create(spec, kind)` with `config` (a
        restorable sandbox's whole configuration but name and labels), restored from its
        snapshot (made first if there is none) and started; None when it must start cold:
        the engine cannot, or making or restoring failed (said once, never raised), or
        another process or thread is making the snapshot now and this is a run's own
        sandbox (a `pooled` one waits for it: no run waits for a pool's builder)."""
        reason = why_cold(self.info())
        if reason is not None:
            say_cold_once(reason)
            return None
        try:
            key = self.key(spec, placement, config)
            wait = MAKER_READY_TIMEOUT + MAKER_CHECKPOINT_TIMEOUT if pooled else 0.0
            snapshot = find(key) or self._make(spec, key, create, progress, wait)
        except (docker.errors.APIError, OSError, RuntimeError) as exc:
            say_cold_once(f"the snapshot could not be made ({explained(exc)})")
            return None
        if snapshot is None:
            return None
        sandbox = create(spec, "sandbox")
        try:
            self.restore(snapshot, sandbox)
        except BaseException as exc:
            sandbox.remove_sandbox_only()
            if not isinstance(exc, docker.errors.APIError | OSError | RuntimeError):
                raise
            say_cold_once(f"a sandbox could not be restored from {key} ({explained(exc)})")
            remove(snapshot)  # the next run makes it again rather than fail the same way
            return None
        mark_used(snapshot)
        sandbox.restored_from = key
        sandbox.isolation = {**sandbox.isolation, "snapshot": key}
        return sandbox

    def _make(
        self,
        spec: SandboxSpec,
        key: str,
        create: Callable[[SandboxSpec, str], Maker],
        progress: Progress,
        wait: float,
    ) -> Snapshot | None:
        """Snapshot `key` made from a sandbox created as `spec`'s would be (its own run id
        and labels: `cleanup` finds it if this process dies), or made meanwhile by another
        maker we waited up to `wait` seconds for; None when another is making it still."""
        with making_lock(key, wait) as mine:
            if not mine:
                return None
            found = find(key)
            if found is not None:
                return found
            progress(f"making gVisor snapshot {key} of the ready runtime (once)")
            maker_id = f"snapshot-{key}-{os.getpid()}"
            maker = create(
                replace(spec, run_id=maker_id, labels=run_labels(maker_id)), KIND_SNAPSHOT_MAKER
            )
            meta = {"image": spec.image, "runtime": RUNSC, "limits": asdict(spec.limits)}
            made = self.make(key, maker, meta)
            evict(self.keep)  # the new one is the most recently used: it stays
            return made

    def key(self, spec: SandboxSpec, placement: Placement, config: dict[str, Any]) -> str:
        """The id of the snapshot a container of `config` would be restored from."""
        image_id = self._image_ids.get(spec.image)
        if image_id is None:
            image_id = self._image_ids[spec.image] = self.api.inspect_image(spec.image)["Id"]
        info = self.info()
        runtime = dict((info.get("Runtimes") or {}).get(placement.engine_runtime) or {})
        # The engine and the kernel it runs on, and the runsc binary itself (an upgrade
        # keeps its path): a checkpoint restores only into the gVisor that made it.
        runtime["engine"] = [info.get("ServerVersion"), info.get("KernelVersion")]
        with contextlib.suppress(OSError):
            binary = os.stat(str(runtime.get("path") or ""))
            runtime["binary"] = [binary.st_size, binary.st_mtime_ns]
        return snapshot_id(image_id, runtime, config)

    def make(self, snapshot: str, maker: Maker, meta: dict[str, Any]) -> Snapshot:
        """Start `maker` (a restorable sandbox, created), wait until its runtime is ready,
        checkpoint it (it stops), and keep the checkpoint's files as `snapshot`. The maker
        is removed whatever happens. Raises docker.errors.APIError when the engine refuses
        the checkpoint, RuntimeError when the runtime never got ready, OSError when the
        files cannot be copied."""
        folder = snapshots_root() / snapshot
        started = time.monotonic()
        try:
            maker.prestart()
            maker.wait_idle(MAKER_READY_TIMEOUT)
            self._checkpoint(maker.id)
            source = self._checkpoints_of(maker.id) / CHECKPOINT_NAME
            partial = folder.with_name(f"{snapshot}.{os.getpid()}.partial")
            shutil.rmtree(partial, ignore_errors=True)
            shutil.copytree(source, partial / "checkpoint")
            size = sum(p.stat().st_size for p in partial.rglob("*") if p.is_file())
            took = round(time.monotonic() - started, 3)
            meta = {**meta, "id": snapshot, "created": time.time(), "size": size, "took": took}
            (partial / META_FILE).write_text(json.dumps(meta, indent=2))
            if find(snapshot) is None:  # else another process made it meanwhile: keep theirs
                shutil.rmtree(folder, ignore_errors=True)
                partial.rename(folder)
            shutil.rmtree(partial, ignore_errors=True)
        finally:
            maker.remove_sandbox_only()
        found = find(snapshot)
        if found is None:
            raise OSError(f"snapshot {snapshot} was not kept in {folder}")
        return found

    def restore(self, snapshot: Snapshot, sandbox: Maker) -> None:
        """Start `sandbox` (created with the snapshot's exact configuration) from the
        snapshot: its files placed in the container's own checkpoint folder, then started
        from them. Raises docker.errors.APIError when the engine refuses, OSError when the
        files cannot be placed, RuntimeError when the restored sandbox is not running."""
        target = self._checkpoints_of(sandbox.id) / CHECKPOINT_NAME
        shutil.copytree(snapshot.checkpoint, target)
        # The engine uploads a checkpoint's folder to containerd as one blob, named by its
        # hash, for each restore, and deletes it after: two restores of identical folders at
        # once collide ("content ... already exists"). A file naming the container makes
        # each folder's hash its own; gVisor reads only its state file.
        (target / RESTORED_INTO).write_text(sandbox.id)
        try:
            sandbox.prestart(checkpoint=CHECKPOINT_NAME)
        finally:  # containerd leaves its unpacked copy behind, whatever the start did
            remove_extracted(containers_dir(self.info()), sandbox.id)
        state = self.api.inspect_container(sandbox.id)["State"]
        if not state.get("Running"):
            raise RuntimeError(
                f"the restored sandbox is not running (exit code {state.get('ExitCode')})"
            )

    def sweep(self) -> int:
        """Remove what containerd unpacked for restores whose containers are gone
        (`remove_extracted`); how many. Never raises."""
        try:
            containers = containers_dir(self.info())
        except Exception:  # the engine is gone: nothing can be told apart
            return 0
        return remove_extracted(containers)

    def _checkpoints_of(self, container_id: str) -> Path:
        """A container's own checkpoint folder on the engine's host. This Docker refuses
        `--checkpoint-dir` for runsc, so the folder is the one place it reads from."""
        return containers_dir(self.info()) / container_id / "checkpoints"

    def _checkpoint(self, container_id: str) -> None:
        """`docker checkpoint create --leave-running=false` (the SDK has no call for it:
        the engine's endpoint, as the SDK's own calls reach theirs)."""
        url = self.api._url("/containers/{0}/checkpoints", container_id)
        response = self.api._post_json(url, data={"CheckpointID": CHECKPOINT_NAME, "Exit": True})
        self.api._raise_for_status(response)


def explained(exc: BaseException) -> str:
    """An engine error's own explanation, else the exception's text."""
    return str(getattr(exc, "explanation", None) or exc)


def start_from_checkpoint(api: docker.APIClient, container_id: str, checkpoint: str) -> None:
    """`docker start --checkpoint NAME` (the SDK's `start` takes no checkpoint). Raises
    docker.errors.APIError when the engine refuses."""
    url = api._url("/containers/{0}/start", container_id)
    response = api._post(url, params={"checkpoint": checkpoint})
    api._raise_for_status(response)
