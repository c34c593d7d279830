"""The ready snapshot of a sandbox shape, made once with `runsc checkpoint`: a sandbox made
exactly as a run's (its config.json: image, keeper and runtime command line, limits,
seccomp, mounts) whose runtime has imported everything and blocks on its first line of
stdin, checkpointed. Kept beside its image's exported root (bundle.py), in a folder named by
its content address (`key`), which is also the bundle every restore of it reads
(`config.json` beside `checkpoint/`).

What waits for what, as on the engine path (backends/docker/snapshots.py, whose docstring
says what a snapshot holds and must not, and the residual risk of clones): the keeper
(PID 1) idles in its restorable mode; the runtime writes READY_LINE on stderr when it has
imported everything, then reads stdin; the host checkpoints it then. No request, task, token
or secret has reached the process: those arrive after each restore, on stdin.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ....labels import LABEL_KIND, run_labels
from ....spec import Limits
from ..snapshot_store import RECENT_USE, keep_count
from .binary import GLOBAL_FLAGS, NETWORK_FLAGS, runsc, runsc_path
from .bundle import Bundle, list_bundles, read_meta
from .cgroup import Cgroup, boot_cpus
from .records import SandboxRecord, new_id

if TYPE_CHECKING:
    from ...base import Progress

#: Each image's snapshots, under its bundle's folder (removed with it).
SNAPSHOTS_DIR = "snapshots"
META_FILE = "snapshot.json"
#: How long the maker may take to import everything before it is given up.
MAKER_READY_TIMEOUT = 60.0
#: The kind label of a snapshot's maker (its owner's death makes it an orphan).
KIND_MAKER = "snapshot-maker"


@dataclass(frozen=True)
class Snapshot:
    """A ready snapshot: its key and folder (an OCI bundle: config.json, and checkpoint/)."""

    key: str
    folder: Path

    @property
    def checkpoint(self) -> Path:
        return self.folder / "checkpoint"

    @property
    def meta(self) -> dict[str, Any]:
        """What the maker recorded (`bundle.read_meta`)."""
        return read_meta(self.folder / META_FILE)


def key(bundle: Bundle, config: dict[str, Any]) -> str:
    """The content address of a snapshot: the image, the sandbox's whole spec, runsc's flags
    and the runsc binary and kernel it runs on (a checkpoint restores only into the gVisor
    that made it)."""
    binary = os.stat(runsc_path())
    text = json.dumps(
        {
            "image": bundle.image_id,
            "config": config,
            "flags": [flag for flag, _ in GLOBAL_FLAGS] + [NETWORK_FLAGS["none"][0]],
            "runsc": [binary.st_size, binary.st_mtime_ns],
            "kernel": platform.release(),
        },
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def find(bundle: Bundle, snapshot_key: str) -> Snapshot | None:
    folder = bundle.folder / SNAPSHOTS_DIR / snapshot_key
    return Snapshot(snapshot_key, folder) if (folder / META_FILE).is_file() else None


def ensure(bundle: Bundle, config: dict[str, Any], limits: Limits, progress: Progress) -> Snapshot:
    """The snapshot of a sandbox of `config`, made now if there is none (one maker at a time
    across processes: the others wait for it). Raises RuntimeError when the maker never got
    ready, OSError or subprocess.CalledProcessError when runsc or the files fail."""
    snapshot_key = key(bundle, config)
    found = find(bundle, snapshot_key)
    if found is not None:
        return found
    with _lock(bundle, snapshot_key):
        found = find(bundle, snapshot_key)
        if found is not None:
            return found
        progress(f"making runsc snapshot {snapshot_key} of the ready runtime (once)")
        made = make(bundle, snapshot_key, config, limits)
        evict(keep_count())  # the new one is the most recently used: it stays
        return made


def remove(snapshot: Snapshot) -> None:
    """A snapshot's folder and its lock; gone already is fine."""
    shutil.rmtree(snapshot.folder, ignore_errors=True)
    snapshot.folder.with_name(f"{snapshot.key}.lock").unlink(missing_ok=True)


def mark_used(snapshot: Snapshot) -> None:
    """A restore's mark on its snapshot (its meta file's mtime), which eviction reads."""
    with contextlib.suppress(OSError):
        os.utime(snapshot.folder / META_FILE)


def list_snapshots() -> list[Snapshot]:
    """Every complete snapshot of every exported image of this state directory."""
    found = []
    for exported in list_bundles():
        for meta in sorted((exported.folder / SNAPSHOTS_DIR).glob(f"*/{META_FILE}")):
            found.append(Snapshot(meta.parent.name, meta.parent))
    return found


def evict(keep: int, now: float | None = None) -> list[str]:
    """Remove the least recently used snapshots beyond `keep` (one per image, limits and
    time-to-live used; ~13 MB each), never one used in the last RECENT_USE seconds (a
    restore may be reading it); the same number as the engine path's
    ($ORCHESTRATOR_SNAPSHOTS_KEEP). Returns the keys removed."""
    now = time.time() if now is None else now

    def used(snapshot: Snapshot) -> float:
        try:
            return (snapshot.folder / META_FILE).stat().st_mtime
        except OSError:
            return 0.0

    by_use = sorted(list_snapshots(), key=used, reverse=True)
    gone = []
    for snapshot in by_use[keep:]:
        if now - used(snapshot) >= RECENT_USE:
            remove(snapshot)
            gone.append(snapshot.key)
    return gone


def make(bundle: Bundle, snapshot_key: str, config: dict[str, Any], limits: Limits) -> Snapshot:
    """Start a maker from `config`, wait until its runtime is ready, checkpoint it (it
    stops), and keep the checkpoint as snapshot `snapshot_key`. The maker is removed whatever
    happens."""
    folder = bundle.folder / SNAPSHOTS_DIR / snapshot_key
    # Made under its final name (runsc restores with the bundle it was made with in view),
    # complete once META_FILE is written; a crash leaves a folder without it, made again.
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    from .sandbox import CALL_TIMEOUT, RunscSandbox  # here: head_start.py reads this module

    started = time.monotonic()
    maker_id = new_id(f"snapshot-{snapshot_key}")
    labels = {**run_labels(maker_id), LABEL_KIND: KIND_MAKER}
    record = SandboxRecord(maker_id, labels)
    record.save()
    cgroup = Cgroup.of(maker_id)
    maker = RunscSandbox(record, cgroup)
    try:
        cgroup.make(limits, boot_cpus(limits))  # it never runs a payload
        maker.launch(["run", f"--bundle={folder}", maker_id])
        maker.wait_idle(MAKER_READY_TIMEOUT)
        subprocess.run(
            runsc("checkpoint", f"--image-path={folder / 'checkpoint'}", maker_id),
            check=True,
            capture_output=True,
            timeout=CALL_TIMEOUT,
        )
        maker.wait(CALL_TIMEOUT)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        maker.remove()
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    meta = {
        "id": snapshot_key,
        "image": bundle.image_id,
        "limits": {"memory_mb": limits.memory_mb, "cpus": limits.cpus, "pids": limits.pids},
        "created": time.time(),
        "size": size,
        "took": round(time.monotonic() - started, 3),
    }
    (folder / META_FILE).write_text(json.dumps(meta, indent=2))
    return Snapshot(snapshot_key, folder)


@contextlib.contextmanager
def _lock(bundle: Bundle, snapshot_key: str) -> Iterator[None]:
    root = bundle.folder / SNAPSHOTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{snapshot_key}.lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
