"""An image's root filesystem as runsc reads it: exported once from the engine into a
content-addressed folder of the state directory (`runsc/images/<image id>/rootfs`), beside
the snapshots made of it (snapshot.py), and removed with the image (`sweep`).

The folder is keyed by the image's id (its content address), so a rebuilt image gets a new
one and an unchanged one is never exported twice. It is made in a `.partial` folder and
renamed whole; a crash leaves only a partial folder, which the next export replaces. The
sandbox mounts it read-only (ocispec.py): nothing a run does reaches it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ....labels import LABEL_KIND, run_labels
from ....paths import home_dir

if TYPE_CHECKING:  # the SDK is imported where it is used: head_start.py reads this module
    import docker  # before anything loads it

    from ...base import Progress

#: Where the exported images live, under the state directory.
IMAGES_DIR = "runsc/images"
#: What each image's folder records (its id and the name it was exported for).
META_FILE = "image.json"
#: The kind label of the short-lived container the export reads from.
KIND_EXPORT = "runsc-export"
#: Mount points the sandbox's spec needs that an image may lack (Docker makes them in the
#: container's own layer; an exported root is read-only to the sandbox, so they are made here).
MOUNT_POINTS = ("work", "tmp", "proc", "dev", "sys")


@dataclass(frozen=True)
class Bundle:
    """An image exported for runsc: its id, its folder, and the root filesystem in it."""

    image_id: str
    folder: Path

    @property
    def rootfs(self) -> Path:
        return self.folder / "rootfs"

    @property
    def meta(self) -> dict[str, Any]:
        """What the export recorded: the image's name, its size, when and how long."""
        return read_meta(self.folder / META_FILE)


def read_meta(path: Path) -> dict[str, Any]:
    """A folder's JSON note (an export's, a snapshot's), or {} when it is missing or torn: a
    note only describes, so a bad one never stops a run."""
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def images_root() -> Path:
    return home_dir() / IMAGES_DIR


def folder_of(image_id: str) -> Path:
    return images_root() / image_id.removeprefix("sha256:")


def find(image_id: str) -> Bundle | None:
    folder = folder_of(image_id)
    if not (folder / META_FILE).is_file():
        return None
    return Bundle(image_id, folder)


def ensure(client: docker.DockerClient, image: str, progress: Progress) -> Bundle:
    """The bundle of `image` (a tag or id), exported now if this state directory has none.
    Raises docker.errors.APIError when the engine cannot export it, OSError when the folder
    cannot be written, RuntimeError when `tar` fails."""
    image_id = client.api.inspect_image(image)["Id"]
    found = find(image_id)
    if found is not None:
        return found
    with _lock(image_id):
        found = find(image_id)
        if found is not None:
            return found
        progress(f"exporting {image} for runsc (once per image)")
        return _export(client, image, image_id)


def _export(client: docker.DockerClient, image: str, image_id: str) -> Bundle:
    import docker.errors

    folder = folder_of(image_id)
    partial = folder.with_name(f"{folder.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "rootfs").mkdir(parents=True)
    started = time.monotonic()
    # Labelled as a run's container, so `cleanup` removes it if this process dies mid-way.
    labels = {**run_labels(f"export-{os.getpid()}"), LABEL_KIND: KIND_EXPORT}
    container = client.api.create_container(image, entrypoint=["true"], labels=labels)
    try:
        # tar as root keeps owners and modes numerically: root-owned code stays root's.
        untar = subprocess.Popen(
            ["tar", "-x", "--numeric-owner", "-C", str(partial / "rootfs")],
            stdin=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert untar.stdin is not None
        try:
            for chunk in client.api.export(container["Id"]):
                untar.stdin.write(chunk)
        finally:
            untar.stdin.close()
            said = untar.stderr.read() if untar.stderr else b""
            if untar.wait() != 0:
                raise RuntimeError(f"tar failed exporting {image}: {said.decode(errors='replace')}")
    finally:
        with contextlib.suppress(docker.errors.NotFound):
            client.api.remove_container(container["Id"], force=True)
    for point in MOUNT_POINTS:
        (partial / "rootfs" / point).mkdir(exist_ok=True)
    size = sum(p.lstat().st_size for p in (partial / "rootfs").rglob("*"))
    took = round(time.monotonic() - started, 3)
    meta = {"image": image, "id": image_id, "took": took, "size": size, "created": time.time()}
    (partial / META_FILE).write_text(json.dumps(meta, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return Bundle(image_id, folder)


@contextlib.contextmanager
def _lock(image_id: str) -> Iterator[None]:
    """One export of an image at a time, across processes (the others wait, then find it)."""
    root = images_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{image_id.removeprefix('sha256:')}.lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def list_bundles() -> list[Bundle]:
    root = images_root()
    if not root.is_dir():
        return []
    found = [find(f"sha256:{p.name}") for p in sorted(root.iterdir()) if p.is_dir()]
    return [bundle for bundle in found if bundle is not None]


def orphaned(client: docker.DockerClient) -> list[Bundle]:
    """The bundles (with the snapshots in them) of images the engine no longer has."""
    import docker.errors

    gone = []
    for bundle in list_bundles():
        try:
            client.api.inspect_image(bundle.image_id)
        except docker.errors.ImageNotFound:
            gone.append(bundle)
    return gone


def remove(bundle: Bundle) -> None:
    """A bundle, its snapshots and its lock; partial exports a dead process left go too."""
    shutil.rmtree(bundle.folder, ignore_errors=True)
    bundle.folder.with_name(f"{bundle.folder.name}.lock").unlink(missing_ok=True)
    root = images_root()
    for partial in root.glob("*.partial") if root.is_dir() else ():
        pid = partial.name.rsplit(".", 2)[-2]
        if not Path(f"/proc/{pid}").exists():
            shutil.rmtree(partial, ignore_errors=True)
