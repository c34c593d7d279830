"""Build and reuse the hardened agent image, and the payload images derived from it.

Everything here is content-addressed and cached:

- the *base* (`base_image.py`) is probed once for its interpreter (cached per image id);
- a *wheelhouse* (`orchestrator/images/wheelhouse.py`) is resolved on the host for that interpreter;
  images are then built offline (`--no-index`);
- the *agent image* is tagged `orchestrator-agent:<hash>` where the hash covers everything
  that goes into it (Dockerfile, base image id, wheels, runtime code), so unchanged inputs
  never rebuild and a cached `ensure_agent_image` is only file hashing and image inspections;
- a *payload image* `orchestrator-payload:<hash>` adds a payload's extra requirements on top
  of the agent image.
"""

from __future__ import annotations

import io
import re
import tarfile
import tempfile
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import docker.errors

from ...errors import ImageBuildError
from ...images.imagedef import (
    AGENT_IMAGE_DIR,
    BASE_IMAGE_ENV,
    ERROR_TAIL_LINES,
    RUNTIME_DIR,
    Progress,
    agent_image_definition,
    build_lock,
    digest,
    normalize_requirements,
    report,
    runtime_files_of,
    sha256,
)
from ...images.wheelhouse import (
    ProbeFailed,
    PythonTarget,
    Wheelhouse,
    ensure_wheelhouse,
    run_probe_container,
    wheelhouse_root,
)
from ...images.wheelhouse import python_target as probed_target
from ...paths import VERSION
from .base_image import resolved_base
from .engine import inspect_image

#: Repository names of the images this module makes.
AGENT_IMAGE = "orchestrator-agent"


PAYLOAD_IMAGE = "orchestrator-payload"


#: Values of the `orchestrator.kind` label on images.
KIND_AGENT = "agent-image"


KIND_PAYLOAD = "payload-image"


#: Further labels on our images.
LABEL_CONTENT_HASH = "orchestrator.content-hash"


LABEL_BASE_ID = "orchestrator.base-id"


LABEL_PYTHON = "orchestrator.python"


LABEL_AGENT_IMAGE = "orchestrator.agent-image"  # on payload images: the agent image tag


LABEL_REQUIREMENTS = "orchestrator.requirements"  # on payload images: the extra requirements


#: On payload images: the constraints (images/agent/constraints.txt) that bore on their
#: resolution, as the build said them, so a cached image still tells which held.
LABEL_CONSTRAINTS = "orchestrator.constraints"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the classic builder colours a step's stderr
#: The classic builder's step header and the image a step produced.
_STEP = re.compile(r"^Step (\d+)/(\d+) : (.*)$")
_PRODUCED = re.compile(r"^ ---> ([0-9a-f]{12,64})$")


@dataclass(frozen=True)
class AgentImagePlan:
    """What the agent image for one base is made of, and its content-addressed tag."""

    tag: str
    content_hash: str
    base: str
    base_id: str
    target: PythonTarget
    wheelhouse: Wheelhouse
    #: The image definition: the Dockerfile and the scripts it runs (name -> content).
    definition: dict[str, bytes]
    requirements: str
    runtime_files: dict[str, bytes]


def python_target(
    client: docker.DockerClient, image: str, image_id: str | None = None
) -> PythonTarget:
    """The interpreter of `image`, probed in a container of it (`wheelhouse.python_target`
    keeps the rule and the cache; running a container is this engine's part). `image_id`:
    the image's id when the caller has just inspected it (one engine round trip less)."""

    def run_probe() -> bytes:
        try:
            return run_probe_container(client, image)
        except docker.errors.DockerException as exc:
            raise ProbeFailed(str(exc)) from exc

    return probed_target(image, image_id or client.api.inspect_image(image)["Id"], run_probe)


def plan_agent_image(
    client: docker.DockerClient, *, base: str | None = None, progress: Progress | None = None
) -> AgentImagePlan:
    """Resolve the base, its interpreter and the wheelhouse, and compute the agent image tag.

    Builds nothing; may pull or bootstrap the base and resolve the wheelhouse the first time.
    """
    base, base_id = resolved_base(client, base, progress)
    target = python_target(client, base, base_id)
    definition = agent_image_definition()
    requirements = (AGENT_IMAGE_DIR / "requirements.txt").read_text()
    wheelhouse = ensure_wheelhouse(requirements, target, progress=progress)
    runtime_files = runtime_files_of(RUNTIME_DIR)
    content_hash = digest(
        {
            "version": VERSION,
            "definition": {name: sha256(data) for name, data in definition.items()},
            "requirements": requirements,
            "base_id": base_id,
            "wheels": wheelhouse.wheels,
            "runtime": {name: sha256(data) for name, data in runtime_files.items()},
        }
    )
    return AgentImagePlan(
        tag=f"{AGENT_IMAGE}:{content_hash[:12]}",
        content_hash=content_hash,
        base=base,
        base_id=base_id,
        target=target,
        wheelhouse=wheelhouse,
        definition=definition,
        requirements=requirements,
        runtime_files=runtime_files,
    )


def ensure_agent_image(
    client: docker.DockerClient,
    *,
    base: str | None = None,
    extra_requirements: Iterable[str] = (),
    progress: Progress | None = None,
) -> str:
    """The tag of an image to run: the agent image, or a payload image with extra packages.

    Builds only what is missing; with unchanged inputs this is file hashing and two image
    inspections (no pip, no container, no build).
    """
    plan = plan_agent_image(client, base=base, progress=progress)
    if inspect_image(client, plan.tag) is None:
        with build_lock(plan.content_hash):
            if inspect_image(client, plan.tag) is None:
                _build_agent_image(client, plan, progress)
    requirements = normalize_requirements(extra_requirements)
    if not requirements:
        return plan.tag
    return _ensure_payload_image(client, plan, requirements, progress)


def _build_agent_image(
    client: docker.DockerClient, plan: AgentImagePlan, progress: Progress | None
) -> None:
    report(progress, f"building {plan.tag} on {plan.base} ({plan.target.describe()})")
    files = {
        **plan.definition,
        "requirements.txt": plan.requirements.encode(),
        **{f"orchestrator_runtime/{name}": data for name, data in plan.runtime_files.items()},
    }
    wheels = plan.wheelhouse.context_files()
    # The base goes in by id: the image is exactly the one whose id is in the hash.
    buildargs = {
        "BASE_IMAGE": plan.base_id,
        "ORCHESTRATOR_BASE": plan.base,
        "ORCHESTRATOR_VERSION": VERSION,
        "ORCHESTRATOR_CONTENT_HASH": plan.content_hash,
        "ORCHESTRATOR_PYTHON": plan.target.version,
    }
    build_image(client, plan.tag, files, wheels, buildargs, progress)


def _ensure_payload_image(
    client: docker.DockerClient,
    plan: AgentImagePlan,
    requirements: tuple[str, ...],
    progress: Progress | None,
) -> str:
    from ...images.constraints import (  # here: only a payload with requirements reads them
        applicable,
        bearing,
        constraints_text,
        read_constraints,
        report_applied,
    )

    requirements_text = "\n".join(requirements) + "\n"
    in_force = applicable(requirements, read_constraints())
    constraints = constraints_text(plan.wheelhouse.pins(), in_force)
    wheelhouse = ensure_wheelhouse(
        requirements_text, plan.target, constraints=constraints, progress=progress
    )
    if set(wheelhouse.wheels) <= set(plan.wheelhouse.wheels):
        report(progress, f"{' '.join(requirements)}: already in {plan.tag}")
        return plan.tag
    dockerfile = (AGENT_IMAGE_DIR / "payload.Dockerfile").read_text()
    content_hash = digest(
        {
            "version": VERSION,
            "agent": plan.tag,
            "dockerfile": dockerfile,
            "requirements": requirements_text,
            "constraints": constraints,
            "wheels": wheelhouse.wheels,
        }
    )
    tag = f"{PAYLOAD_IMAGE}:{content_hash[:12]}"
    if inspect_image(client, tag) is not None:
        return tag
    with build_lock(content_hash):
        if inspect_image(client, tag) is not None:
            return tag
        report(progress, f"building {tag} from {plan.tag} with {' '.join(requirements)}")
        report_applied(in_force, wheelhouse.wheels, progress)
        files = {
            "Dockerfile": dockerfile.encode(),
            "requirements.txt": requirements_text.encode(),
            "constraints.txt": constraints.encode(),
        }
        wheels = wheelhouse.context_files()
        buildargs = {
            "AGENT_IMAGE": plan.tag,
            "ORCHESTRATOR_VERSION": VERSION,
            "ORCHESTRATOR_CONTENT_HASH": content_hash,
            "ORCHESTRATOR_REQUIREMENTS": " ".join(requirements),
            "ORCHESTRATOR_CONSTRAINTS": " ".join(
                c.line for c in bearing(in_force, wheelhouse.wheels)
            ),
        }
        build_image(client, tag, files, wheels, buildargs, progress)
    return tag


def _build_context(files: dict[str, bytes], paths: dict[str, Path]) -> IO[bytes]:
    """An uncompressed tar of the build context, with fixed owners, modes and times."""
    context = tempfile.TemporaryFile()
    with tarfile.open(fileobj=context, mode="w") as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
        for name, path in sorted(paths.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = path.stat().st_size, 0o644, 0
            with path.open("rb") as handle:
                tar.addfile(info, handle)
    context.seek(0)
    return context


def _remove_stage_images(client: docker.DockerClient, images: list[str]) -> None:
    """Remove the untagged images earlier build stages ended with (never a tagged one: a
    stage that is only `FROM` ends with its base, which stays)."""
    for image in images:
        info = inspect_image(client, image)
        if info is None or any(t != "<none>:<none>" for t in info.get("RepoTags") or []):
            continue
        try:
            client.api.remove_image(image, noprune=False)
        except docker.errors.APIError:  # in use by another build's next stage: left to prune
            pass


def build_image(
    client: docker.DockerClient,
    tag: str,
    files: dict[str, bytes],
    paths: dict[str, Path],
    buildargs: dict[str, str],
    progress: Progress | None,
) -> None:
    """Build with the classic builder, streaming its output; ImageBuildError on failure.

    Labels come in as build arguments of the Dockerfile's last LABEL step: the API's `labels`
    option would add one commit per label, seconds each on this storage driver.
    Each step is reported (a progress line with the step and the time so far; the builder's
    own output as `build:` details, shown with -v). The image each earlier stage of a
    multi-stage build ended with is removed afterwards (the classic builder leaves it
    untagged: a dangling `<none>` image nobody would remove).
    """
    started = time.monotonic()
    tail: deque[str] = deque(maxlen=ERROR_TAIL_LINES)
    error = None
    produced: str | None = None  # the image the latest step produced
    stages: list[str] = []  # the images earlier stages ended with
    with _build_context(files, paths) as context:
        try:
            for chunk in client.api.build(
                fileobj=context,
                custom_context=True,
                tag=tag,
                buildargs=buildargs,
                rm=True,
                forcerm=True,
                pull=False,
                decode=True,
            ):
                text = _ANSI.sub("", chunk.get("stream") or chunk.get("status") or "")
                for line in text.splitlines():
                    if line.strip():
                        tail.append(line.rstrip())
                        if progress is not None:
                            progress("build: " + line.rstrip())
                        if found := _PRODUCED.match(line.rstrip()):
                            produced = found.group(1)
                        elif step := _STEP.match(line.strip()):
                            number, total, instruction = step.groups()
                            if instruction.upper().startswith("FROM ") and produced:
                                stages.append(produced)
                            report(
                                progress,
                                f"building {tag}: step {number}/{total} after "
                                f"{time.monotonic() - started:.0f} s: {instruction[:70]}",
                            )
                if "error" in chunk:
                    error = chunk.get("errorDetail", {}).get("message") or chunk["error"]
        except docker.errors.DockerException as exc:
            error = f"{type(exc).__name__}: {exc}"
    _remove_stage_images(client, stages)
    if error is None and inspect_image(client, tag) is None:
        error = "the build finished without producing the image"
    if error is not None:
        raise ImageBuildError(
            f"Building {tag} failed: {error.strip()}\nLast build output:\n" + "\n".join(tail),
            "Read the build output above for the failing step. The wheelhouse is in "
            f"{wheelhouse_root()}; delete it to resolve the wheels again, or set "
            f"{BASE_IMAGE_ENV} to try another base image.",
        )
    report(progress, f"built {tag} in {time.monotonic() - started:.1f} s")
