"""The base every Docker image is built on: the configured one, pulled, or made offline.

On hosts with no registry, a Debian base is made with debootstrap and `docker import`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import docker.errors

from ...errors import ImageBuildError, OrchestratorError
from ...images.imagedef import (
    BASE_IMAGE_ENV,
    DEFAULT_BASE,
    Progress,
    build_lock,
    images_state_dir,
    read_json,
    report,
    run_streaming,
    sha256,
    write_json,
)
from ...labels import LABEL_KIND, LABEL_VERSION
from ...paths import VERSION
from .engine import inspect_image

log = logging.getLogger(__name__)

#: The base made by `bootstrap_base`, used when the configured base cannot be had.
BASE_IMAGE = "orchestrator-base:bookworm"


KIND_BASE = "base-image"


#: How long a failed pull of the base is remembered before it is tried again.
PULL_RETRY_SECONDS = 3600.0


def bootstrap_base(
    client: docker.DockerClient,
    *,
    suite: str = "bookworm",
    mirror: str = "http://deb.debian.org/debian",
    tag: str | None = None,
    progress: Progress | None = None,
) -> str:
    """Make a Debian base image with debootstrap and `docker import` it; returns `tag`
    (by default `debian_base(suite)`: bookworm's is `BASE_IMAGE`, the agent's fallback;
    trixie's the secret interceptor's).

    Needs root and the `debootstrap` tool on the host, and Debian's mirror (its time and
    size: benchmarks/results/code_figures.md#sizes-on-disk). The image has `python3`,
    `python3-venv` and `ca-certificates`, nothing more.
    """
    tag = tag or debian_base(suite)
    if shutil.which("debootstrap") is None:
        raise OrchestratorError(
            f"Cannot make the base image {tag}: the `debootstrap` tool is not installed.",
            "Install it (`apt-get install debootstrap`, as root), or make a base image "
            f"available some other way: `docker pull {DEFAULT_BASE}`, or set "
            f"{BASE_IMAGE_ENV} to a local Debian-based image with python3.",
        )
    if os.geteuid() != 0:
        raise OrchestratorError(
            f"Cannot make the base image {tag}: debootstrap must run as root.",
            "Run this once as root (e.g. `sudo orchestrator images bootstrap`), or set "
            f"{BASE_IMAGE_ENV} to a local Debian-based image with python3.",
        )
    repository, _, version = tag.rpartition(":")
    if not repository or "/" in version:
        repository, version = tag, "latest"
    root = Path(tempfile.mkdtemp(prefix="orchestrator-debootstrap-"))
    try:
        report(progress, f"debootstrap {suite} from {mirror} (about a minute)")
        command = [
            "debootstrap",
            "--variant=minbase",
            "--include=python3,python3-venv,ca-certificates",
            suite,
            str(root),
            mirror,
        ]
        tail = run_streaming(command, progress, prefix="debootstrap: ")
        if tail.returncode != 0:
            raise ImageBuildError(
                f"debootstrap of {suite} from {mirror} failed (exit {tail.returncode}). "
                "Last output:\n" + "\n".join(tail.lines),
                "Check that the mirror is reachable from this host (or pass another one) "
                "and that there is enough disk space.",
            )
        report(progress, f"importing {root} as {tag}")
        with subprocess.Popen(
            ["tar", "--numeric-owner", "-C", str(root), "-cf", "-", "."],
            stdout=subprocess.PIPE,
        ) as tar:
            assert tar.stdout is not None
            client.api.import_image_from_stream(
                _chunks(tar.stdout),
                repository=repository,
                tag=version,
                changes=[
                    f"LABEL {LABEL_KIND}={KIND_BASE}",
                    f"LABEL {LABEL_VERSION}={VERSION}",
                    "ENV LANG=C.UTF-8",
                    'CMD ["python3"]',
                ],
            )
        if tar.returncode != 0:
            raise ImageBuildError(
                f"Packing the debootstrap tree for {tag} failed (tar exit {tar.returncode}).",
                "Check the disk space of the temporary directory and try again.",
            )
    finally:
        _remove_tree(root)
    if inspect_image(client, tag) is None:
        raise ImageBuildError(
            f"`docker import` reported no error but {tag} does not exist.",
            "Check the Docker daemon's log.",
        )
    report(progress, f"base image {tag} ready")
    return tag


def debian_base(suite: str) -> str:
    """The tag of the debootstrapped base of Debian `suite`: `orchestrator-base:<suite>`."""
    return f"{BASE_IMAGE.rpartition(':')[0]}:{suite}"


def _debian_base(
    client: docker.DockerClient, suite: str, progress: Progress | None
) -> tuple[str, str]:
    """The debootstrapped base of Debian `suite`, made once per host (`bootstrap_base`) when
    missing (no registry needed): its tag and image id (from the inspection that found
    it)."""
    tag = debian_base(suite)
    found = inspect_image(client, tag)
    if found is None:
        with build_lock(sha256(tag.encode())):
            if inspect_image(client, tag) is None:
                report(progress, f"making {tag} with debootstrap (once per host)")
                bootstrap_base(client, suite=suite, tag=tag, progress=progress)
        found = client.api.inspect_image(tag)
    return tag, found["Id"]


def _chunks(stream: IO[bytes], size: int = 1 << 20) -> Iterator[bytes]:
    while chunk := stream.read(size):
        yield chunk


def _remove_tree(root: Path) -> None:
    """Remove a debootstrap tree, unmounting anything a failed run left mounted inside."""
    with contextlib.suppress(OSError):
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
        for mount in sorted((m for m in mounts if m.startswith(f"{root}/")), reverse=True):
            subprocess.run(["umount", "-l", mount], check=False)
    shutil.rmtree(root, ignore_errors=True)


def resolve_base(
    client: docker.DockerClient,
    base: str | None = None,
    progress: Progress | None = None,
    *,
    suite: str = "bookworm",
) -> str:
    """The base image to build on: `base`, else `$ORCHESTRATOR_BASE_IMAGE`, else the default.

    If that image is not present it is pulled; if the pull fails, the debootstrap base of
    Debian `suite` (`debian_base(suite)`; bookworm's is `BASE_IMAGE`) is used instead, and
    made if it is missing too. A fallback is always reported through `progress` (and logged
    as a warning).
    """
    return resolved_base(client, base, progress, suite=suite)[0]


def resolved_base(
    client: docker.DockerClient,
    base: str | None = None,
    progress: Progress | None = None,
    *,
    suite: str = "bookworm",
) -> tuple[str, str]:
    """`resolve_base`'s image and its id, read from the inspection that found it: a caller
    that needs the id (the agent image's hash covers it) asks the engine once, not twice."""
    wanted = base or os.environ.get(BASE_IMAGE_ENV) or DEFAULT_BASE
    fallback = debian_base(suite)
    found = inspect_image(client, wanted)
    if found is not None:
        return wanted, found["Id"]
    if wanted != fallback:
        reason, remembered = _pull(client, wanted, progress)
        if reason is None:
            return wanted, client.api.inspect_image(wanted)["Id"]
        choose = f"set {BASE_IMAGE_ENV} to choose a base; " if fallback == BASE_IMAGE else ""
        message = (
            f"{wanted} cannot be pulled here, so images are built on {fallback}, the "
            "Debian base orchestrator makes itself: the designed path on a host without a "
            f"registry ({choose}{reason})"
        )
        if remembered:  # said when the pull failed; a repeat is a detail (shown with -v)
            message = f"note: {message}"
        if progress is not None:
            progress(message)
        else:
            log.warning("%s", message)
    return _debian_base(client, suite, progress)


def _pull(
    client: docker.DockerClient, ref: str, progress: Progress | None
) -> tuple[str | None, bool]:
    """Pull `ref`: (None, False) on success, else (why not, whether the failure is one
    remembered from an earlier try). Failures are remembered for an hour."""
    failures_file = images_state_dir() / "pull-failures.json"
    failures = read_json(failures_file)
    failed = failures.get(ref)
    if failed and time.time() - failed.get("time", 0) < PULL_RETRY_SECONDS:
        minutes = int((time.time() - failed["time"]) / 60)
        return f"pull failed {minutes} min ago: {failed.get('error', '?')}", True
    report(progress, f"pulling {ref}")
    repository, _, tag = ref.rpartition(":")
    if not repository or "/" in tag:
        repository, tag = ref, "latest"
    try:
        client.images.pull(repository, tag=tag)
    except docker.errors.DockerException as exc:
        error = str(getattr(exc, "explanation", None) or exc).splitlines()[0][:300]
        failures[ref] = {"time": time.time(), "error": error}
        write_json(failures_file, failures)
        return f"pull failed: {error}", False
    failures.pop(ref, None)
    write_json(failures_file, failures)
    return None, False
