"""Listing and pruning the orchestrator's Docker images, and the gVisor snapshots made of
them (snapshot_store.py: kept in this state directory, each pruned with its image)."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import docker.errors

from ...images.imagedef import Progress, report
from ...labels import LABEL_KIND
from .base_image import BASE_IMAGE, KIND_BASE
from .egress import EGRESS_IMAGE, KIND_EGRESS_IMAGE, plan_egress_image
from .engine import inspect_image
from .images import (
    AGENT_IMAGE,
    KIND_AGENT,
    KIND_PAYLOAD,
    LABEL_AGENT_IMAGE,
    PAYLOAD_IMAGE,
    plan_agent_image,
)
from .interceptor import INTERCEPTOR_IMAGE, KIND_INTERCEPTOR_IMAGE, plan_interceptor_image
from .snapshot_store import Snapshot, list_snapshots
from .snapshot_store import find as find_snapshot
from .snapshot_store import remove as remove_snapshot

#: The repositories our images are tagged in. An image built FROM one of ours inherits its
#: labels; its name tells it apart (another project's image is not ours to list or prune).
REPOSITORIES = {
    AGENT_IMAGE,
    PAYLOAD_IMAGE,
    EGRESS_IMAGE,
    INTERCEPTOR_IMAGE,
    BASE_IMAGE.rpartition(":")[0],  # the bookworm base and the interceptor's trixie one
}
#: The kinds of image listed and pruned.
KINDS = (KIND_AGENT, KIND_PAYLOAD, KIND_EGRESS_IMAGE, KIND_INTERCEPTOR_IMAGE, KIND_BASE)
#: The kind of a gVisor snapshot's row; its `tag` is `snapshot:<id>`, its `image` the image
#: it was made of.
KIND_SNAPSHOT = "gvisor-snapshot"
SNAPSHOT_TAG = "snapshot:"


def _tags(image: dict[str, Any]) -> list[str]:
    return [tag for tag in image.get("RepoTags") or [] if tag != "<none>:<none>"]


def _kind(image: dict[str, Any]) -> str | None:
    kind = (image.get("Labels") or {}).get(LABEL_KIND)
    if kind is None and BASE_IMAGE in _tags(image):
        return KIND_BASE
    return kind


def list_images(client: docker.DockerClient) -> list[dict[str, Any]]:
    """The orchestrator's tagged images (agent, payload, egress, interceptor and bases), newest
    first.

    Each is `{tag, id, kind, created, size, in_use, labels}`; `in_use` means a container
    (running or not) was made from it. Untagged images are not listed (`prune_images`
    removes ours: `dangling_images`).
    """
    used = {container["ImageID"] for container in client.api.containers(all=True)}
    rows = []
    for image in client.api.images():
        kind = _kind(image)
        if kind not in KINDS:
            continue
        for tag in _tags(image):
            if tag.rpartition(":")[0] not in REPOSITORIES:
                continue
            rows.append(
                {
                    "tag": tag,
                    "id": image["Id"],
                    "kind": kind,
                    "created": datetime.fromtimestamp(image["Created"], timezone.utc).isoformat(),
                    "size": image["Size"],
                    "in_use": image["Id"] in used,
                    "labels": image.get("Labels") or {},
                }
            )
    rows += [snapshot_row(snapshot) for snapshot in list_snapshots()]
    rows += runsc_rows()
    rows.sort(key=lambda row: row["created"], reverse=True)
    return rows


def snapshot_row(snapshot: Snapshot) -> dict[str, Any]:
    """A snapshot as `list_images` lists it (in use: never, each run restores a copy)."""
    created = float(snapshot.meta.get("created") or 0)
    return {
        "tag": f"{SNAPSHOT_TAG}{snapshot.id}",
        "id": snapshot.id,
        "kind": KIND_SNAPSHOT,
        "created": datetime.fromtimestamp(created, timezone.utc).isoformat(),
        "size": int(snapshot.meta.get("size") or 0),
        "in_use": False,
        "labels": {},
        "image": snapshot.meta.get("image"),
    }


#: The kinds of an image exported for runsc-direct and of a snapshot made of it (tags
#: `runsc-export:<image id>`, `runsc-snapshot:<key>`); they go with their image
#: (`sweep_exported`).
KIND_RUNSC_EXPORT = "runsc-export"
KIND_RUNSC_SNAPSHOT = "runsc-snapshot"


def runsc_rows() -> list[dict[str, Any]]:
    """runsc-direct's exported images and their snapshots (runsc_direct/), as `list_images`
    lists them: what they take of the state directory's disk."""
    from .runsc_direct import bundle, snapshot

    rows: list[dict[str, Any]] = []
    for exported in bundle.list_bundles():
        meta = exported.meta
        rows.append(
            {
                "tag": f"{KIND_RUNSC_EXPORT}:{exported.folder.name[:12]}",
                "id": exported.image_id,
                "kind": KIND_RUNSC_EXPORT,
                "created": _iso(meta.get("created") or _made_at(exported.folder)),
                "size": int(meta.get("size") or 0),
                "in_use": False,
                "labels": {},
                "image": meta.get("image"),
            }
        )
    for made in snapshot.list_snapshots():
        meta = made.meta
        rows.append(
            {
                "tag": f"{KIND_RUNSC_SNAPSHOT}:{made.key}",
                "id": made.key,
                "kind": KIND_RUNSC_SNAPSHOT,
                "created": _iso(meta.get("created")),
                "size": int(meta.get("size") or 0),
                "in_use": False,
                "labels": {},
                "image": meta.get("image"),
            }
        )
    return rows


def _made_at(folder: Path) -> float:
    try:
        return folder.stat().st_mtime
    except OSError:
        return 0.0


def _iso(created: Any) -> str:
    return datetime.fromtimestamp(float(created or 0), timezone.utc).isoformat()


def dangling_images(client: docker.DockerClient) -> list[str]:
    """The ids of untagged images of ours (our kind label, inherited by whatever a build of
    ours left: a multi-stage build's earlier stage, an image whose tag a rebuild took) that no
    container uses."""
    used = {container["ImageID"] for container in client.api.containers(all=True)}
    return [
        image["Id"]
        for image in client.api.images(filters={"dangling": True})
        if _kind(image) in KINDS and not _tags(image) and image["Id"] not in used
    ]


def prune_images(
    client: docker.DockerClient,
    *,
    keep_current: bool = True,
    dry_run: bool = False,
    include_base: bool = False,
    progress: Progress | None = None,
) -> list[str]:
    """Remove the orchestrator's images other than the current ones; returns what went.

    A gVisor snapshot (this state directory's) goes unless its image is a current one.
    Current: the agent image the configured base would get now (working that out may
    resolve the base and the wheelhouse), its base, the payload images built on it, the
    egress image of that base, and the interceptor image of its trixie base (when that base
    exists: pruning never makes one).
    Images in use by a container are kept. The debootstrap base is removed only with
    `include_base`. Payload images go before agent images, agent images before bases; then
    the untagged images of ours (`dangling_images`), so that nothing we made is left.
    """
    rows = list_images(client)
    keep: set[str] = set()
    if keep_current:
        plan = plan_agent_image(client, progress=progress)
        keep |= {plan.tag, plan.base}
        keep |= {row["tag"] for row in rows if row["labels"].get(LABEL_AGENT_IMAGE) == plan.tag}
        keep.add(plan_egress_image(client, progress=progress).tag)
        interceptor = plan_interceptor_image(client, progress=progress, make_base=False)
        if interceptor is not None:
            keep.add(interceptor.tag)
    order = {
        KIND_RUNSC_SNAPSHOT: -1,
        KIND_RUNSC_EXPORT: -1,
        KIND_SNAPSHOT: -1,
        KIND_PAYLOAD: 0,
        KIND_AGENT: 1,
        KIND_EGRESS_IMAGE: 1,
        KIND_INTERCEPTOR_IMAGE: 1,
        KIND_BASE: 2,
    }
    removed = []
    for row in sorted(rows, key=lambda row: order[row["kind"]]):
        if row["tag"] in keep or row["in_use"]:
            continue
        if row["kind"] in (KIND_RUNSC_EXPORT, KIND_RUNSC_SNAPSHOT):
            continue  # they go with their image (`sweep_exported`, below)
        if row["kind"] == KIND_BASE and not include_base:
            continue
        if row["kind"] == KIND_SNAPSHOT:
            if row["image"] in keep and inspect_image(client, row["image"]) is not None:
                continue  # a snapshot of a current image is current
            found = find_snapshot(row["id"])
            if not dry_run and found is not None:
                remove_snapshot(found)
            report(progress, f"{'would remove' if dry_run else 'removed'} {row['tag']}")
            removed.append(row["tag"])
            continue
        if not dry_run:
            try:
                client.api.remove_image(row["tag"], noprune=False)
            except docker.errors.APIError as exc:  # e.g. a child image still uses it
                report(progress, f"kept {row['tag']}: {exc.explanation or exc}")
                continue
        report(progress, f"{'would remove' if dry_run else 'removed'} {row['tag']}")
        removed.append(row["tag"])
    removed += sweep_exported(client, dry_run=dry_run, progress=progress)
    for image_id in dangling_images(client):
        name = f"<none> ({image_id.removeprefix('sha256:')[:12]})"
        if not dry_run:
            try:
                client.api.remove_image(image_id, noprune=False)
            except docker.errors.APIError as exc:  # a child image or a build still uses it
                report(progress, f"kept {name}: {exc.explanation or exc}")
                continue
        report(progress, f"{'would remove' if dry_run else 'removed'} {name}")
        removed.append(name)
    return removed


def sweep_exported(
    client: docker.DockerClient, *, dry_run: bool, progress: Progress | None
) -> list[str]:
    """The images exported for runsc-direct (runsc_direct/bundle.py), with the snapshots made
    of them, whose image the engine no longer has: they go with it."""
    from .runsc_direct import bundle

    gone = bundle.orphaned(client)
    for exported in gone:
        if not dry_run:
            bundle.remove(exported)
        report(progress, f"{'would remove' if dry_run else 'removed'} runsc:{exported.image_id}")
    return [f"runsc:{exported.image_id}" for exported in gone]
