"""Build and reuse the hardened agent image, and the payload images derived from it.

Everything here is content-addressed and cached:

- the *base* (`python:3.12-slim`, or a Debian base made with debootstrap when no registry is
  reachable) is probed once for its interpreter (cached per image id);
- a *wheelhouse* is resolved on the host with the host's pip for that interpreter
  (`pip download --only-binary=:all: --python-version ... --platform ...`), once per
  requirements + interpreter + platform; images are then built offline (`--no-index`);
- the *agent image* is tagged `orchestrator-agent:<hash>` where the hash covers everything
  that goes into it (Dockerfile, base image id, wheels, runtime code), so unchanged inputs
  never rebuild and a cached `ensure_agent_image` is only file hashing and image inspections;
- a *payload image* `orchestrator-payload:<hash>` adds a payload's extra requirements on top
  of the agent image.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

import docker
import docker.errors
from filelock import FileLock

from .config import LABEL_KIND, LABEL_VERSION, VERSION, home_dir, repo_root
from .errors import ConfigError, ImageBuildError, OrchestratorError

log = logging.getLogger(__name__)

Progress = Callable[[str], None]

#: Repository names of the images this module makes.
AGENT_IMAGE = "orchestrator-agent"
PAYLOAD_IMAGE = "orchestrator-payload"
#: The base made by `bootstrap_base`, used when the configured base cannot be had.
BASE_IMAGE = "orchestrator-base:bookworm"
#: The base on ordinary machines.
DEFAULT_BASE = "python:3.12-slim"
BASE_IMAGE_ENV = "ORCHESTRATOR_BASE_IMAGE"
WHEELHOUSE_ENV = "ORCHESTRATOR_WHEELHOUSE"

#: Values of the `orchestrator.kind` label on images.
KIND_AGENT = "agent-image"
KIND_PAYLOAD = "payload-image"
KIND_BASE = "base-image"
#: Further labels on our images.
LABEL_CONTENT_HASH = "orchestrator.content-hash"
LABEL_BASE = "orchestrator.base"  # the base reference the agent image was built from
LABEL_BASE_ID = "orchestrator.base-id"
LABEL_PYTHON = "orchestrator.python"
LABEL_AGENT_IMAGE = "orchestrator.agent-image"  # on payload images: the agent image tag
LABEL_REQUIREMENTS = "orchestrator.requirements"  # on payload images: the extra requirements

#: Where the image definitions and the runtime live (read at call time, so tests can patch).
AGENT_IMAGE_DIR = repo_root() / "images" / "agent"
RUNTIME_DIR = repo_root() / "orchestrator_runtime"

#: How long a failed pull of the base is remembered before it is tried again.
PULL_RETRY_SECONDS = 3600.0
#: Build output lines quoted in an ImageBuildError.
ERROR_TAIL_LINES = 25

_PROBE = (
    "import json, platform, sys; print(json.dumps({'python': platform.python_version(), "
    "'implementation': sys.implementation.name, 'libc': platform.libc_ver(), "
    "'machine': platform.machine()}))"
)
_WHEELHOUSE_MANIFEST = "wheelhouse.json"  # written last: its presence marks completion
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the classic builder colours a step's stderr


def _report(progress: Progress | None, message: str) -> None:
    log.info("%s", message)
    if progress is not None:
        progress(message)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _digest(obj: Any) -> str:
    """A stable hash of a JSON-able value."""
    return _sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


def _write_json(path: Path, data: Any) -> None:
    """Write atomically (temp file + rename), so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _state_dir() -> Path:
    path = home_dir() / "images"
    path.mkdir(parents=True, exist_ok=True)
    return path


def wheelhouse_root() -> Path:
    """Where wheelhouses are kept: `$ORCHESTRATOR_WHEELHOUSE`, else `<home>/wheelhouse`."""
    path = Path(os.environ.get(WHEELHOUSE_ENV) or home_dir() / "wheelhouse")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _inspect(client: docker.DockerClient, ref: str) -> dict[str, Any] | None:
    try:
        return client.api.inspect_image(ref)
    except docker.errors.ImageNotFound:
        return None


# ---- the base image ------------------------------------------------------------------------


def bootstrap_base(
    client: docker.DockerClient,
    *,
    suite: str = "bookworm",
    mirror: str = "http://deb.debian.org/debian",
    tag: str = BASE_IMAGE,
    progress: Progress | None = None,
) -> str:
    """Make a Debian base image with debootstrap and `docker import` it; returns `tag`.

    Needs root and the `debootstrap` tool on the host, and Debian's mirror (about a minute,
    265 MB). The image has `python3`, `python3-venv` and `ca-certificates`, nothing more.
    """
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
        _report(progress, f"debootstrap {suite} from {mirror} (about a minute)")
        command = [
            "debootstrap",
            "--variant=minbase",
            "--include=python3,python3-venv,ca-certificates",
            suite,
            str(root),
            mirror,
        ]
        tail = _run_streaming(command, progress, prefix="debootstrap: ")
        if tail.returncode != 0:
            raise ImageBuildError(
                f"debootstrap of {suite} from {mirror} failed (exit {tail.returncode}). "
                "Last output:\n" + "\n".join(tail.lines),
                "Check that the mirror is reachable from this host (or pass another one) "
                "and that there is enough disk space.",
            )
        _report(progress, f"importing {root} as {tag}")
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
    if _inspect(client, tag) is None:
        raise ImageBuildError(
            f"`docker import` reported no error but {tag} does not exist.",
            "Check the Docker daemon's log.",
        )
    _report(progress, f"base image {tag} ready")
    return tag


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
    client: docker.DockerClient, base: str | None = None, progress: Progress | None = None
) -> str:
    """The base image to build on: `base`, else `$ORCHESTRATOR_BASE_IMAGE`, else the default.

    If that image is not present it is pulled; if the pull fails, the debootstrap base
    (`BASE_IMAGE`) is used instead, and made if it is missing too. A fallback is always
    reported through `progress` (and logged as a warning).
    """
    wanted = base or os.environ.get(BASE_IMAGE_ENV) or DEFAULT_BASE
    if _inspect(client, wanted) is not None:
        return wanted
    if wanted != BASE_IMAGE:
        reason = _pull(client, wanted, progress)
        if reason is None:
            return wanted
        message = (
            f"base image {wanted} is not available ({reason}); "
            f"falling back to {BASE_IMAGE} (set {BASE_IMAGE_ENV} to choose a base)"
        )
        if progress is not None:
            progress(message)
        else:
            log.warning("%s", message)
    if _inspect(client, BASE_IMAGE) is None:
        _report(progress, f"{BASE_IMAGE} is missing: making it with debootstrap")
        bootstrap_base(client, progress=progress)
    return BASE_IMAGE


def _pull(client: docker.DockerClient, ref: str, progress: Progress | None) -> str | None:
    """Pull `ref`; None on success, else why not. Failures are remembered for an hour."""
    failures_file = _state_dir() / "pull-failures.json"
    failures = _read_json(failures_file)
    failed = failures.get(ref)
    if failed and time.time() - failed.get("time", 0) < PULL_RETRY_SECONDS:
        minutes = int((time.time() - failed["time"]) / 60)
        return f"pull failed {minutes} min ago: {failed.get('error', '?')}"
    _report(progress, f"pulling {ref}")
    repository, _, tag = ref.rpartition(":")
    if not repository or "/" in tag:
        repository, tag = ref, "latest"
    try:
        client.images.pull(repository, tag=tag)
    except docker.errors.DockerException as exc:
        error = str(getattr(exc, "explanation", None) or exc).splitlines()[0][:300]
        failures[ref] = {"time": time.time(), "error": error}
        _write_json(failures_file, failures)
        return f"pull failed: {error}"
    failures.pop(ref, None)
    _write_json(failures_file, failures)
    return None


# ---- the image's interpreter ---------------------------------------------------------------


@dataclass(frozen=True)
class PythonTarget:
    """The interpreter of an image, as pip's `--python-version/--platform/--abi` need it."""

    version: str  # "3.11.2"
    glibc: str  # "2.36"
    machine: str  # "x86_64"

    @property
    def abis(self) -> list[str]:
        major, minor = self.version.split(".")[:2]
        return [f"cp{major}{minor}", "abi3", "none"]

    @property
    def platforms(self) -> list[str]:
        """Every manylinux tag the image's glibc accepts, newest first."""
        glibc_minor = int(self.glibc.split(".")[1])
        tags = [f"manylinux_2_{m}_{self.machine}" for m in range(glibc_minor, 4, -1)]
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        for minor, name in legacy.items():
            if glibc_minor >= minor and (minor == 17 or self.machine in ("x86_64", "i686")):
                tags.append(f"{name}_{self.machine}")
        return tags

    def describe(self) -> str:
        return f"CPython {self.version}, glibc {self.glibc}, {self.machine}"


def python_target(client: docker.DockerClient, image: str) -> PythonTarget:
    """The interpreter of `image`: asked once by running it, then cached per image id."""
    image_id = client.api.inspect_image(image)["Id"]
    cache_file = _state_dir() / "python-versions.json"
    cache = _read_json(cache_file)
    info = cache.get(image_id)
    if info is None:
        try:
            output = client.containers.run(
                image,
                entrypoint=["python3", "-c", _PROBE],
                command=[],
                user="65534:65534",
                network_disabled=True,
                remove=True,
                labels={LABEL_KIND: "image-probe", LABEL_VERSION: VERSION},
            )
            info = json.loads(output.decode().strip().splitlines()[-1])
        except (docker.errors.DockerException, ValueError, IndexError) as exc:
            raise ImageBuildError(
                f"Could not find the Python version of the base image {image} "
                f"(`python3 -c ...` in it failed: {exc}).",
                f"Use a base image with `python3` on its PATH ({BASE_IMAGE_ENV}).",
            ) from exc
        cache[image_id] = info
        _write_json(cache_file, cache)
    libc, libc_version = info["libc"]
    if info["implementation"] != "cpython" or libc != "glibc":
        raise ImageBuildError(
            f"The base image {image} has {info['implementation']} with libc {libc or '?'}; "
            "the agent image needs CPython on glibc (manylinux wheels).",
            f"Use a Debian- or Ubuntu-based image with python3 ({BASE_IMAGE_ENV}).",
        )
    return PythonTarget(version=info["python"], glibc=libc_version, machine=info["machine"])


# ---- wheelhouses ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Wheelhouse:
    """A complete folder of wheels for one requirements set and one interpreter."""

    path: Path
    key: str
    wheels: dict[str, str]  # file name -> sha256

    def pins(self) -> str:
        """`name==version` for every wheel: constraints that keep derived images consistent."""
        lines = []
        for name in sorted(self.wheels):
            project, version = name.split("-")[:2]
            lines.append(f"{project}=={version}")
        return "\n".join(lines) + "\n"

    def context_files(self) -> dict[str, Path]:
        """The wheels as build-context entries (`wheels/<name>`), checked against the manifest."""
        files = {}
        for name, digest in sorted(self.wheels.items()):
            path = self.path / name
            try:
                intact = _sha256(path.read_bytes()) == digest
            except OSError:
                intact = False
            if not intact:
                raise ImageBuildError(
                    f"The wheelhouse {self.path} is damaged: {name} is missing or changed.",
                    f"Delete {self.path}; it is downloaded again on the next build.",
                )
            files[f"wheels/{name}"] = path
        return files


def ensure_wheelhouse(
    requirements: str,
    target: PythonTarget,
    *,
    constraints: str = "",
    progress: Progress | None = None,
) -> Wheelhouse:
    """Binary wheels for `requirements` (plus pip itself) for `target`'s interpreter.

    Resolved with the host's pip (which reaches the package index, honouring the user's pip
    configuration), into `wheelhouse_root()/<key>`. A complete wheelhouse is reused without
    calling pip.
    """
    key = _digest(
        {
            "requirements": requirements,
            "constraints": constraints,
            "python": target.version,
            "abis": target.abis,
            "platforms": target.platforms,
        }
    )[:16]
    path = wheelhouse_root() / key
    found = _load_wheelhouse(path, key)
    if found is not None:
        return found
    with FileLock(str(wheelhouse_root() / f".{key}.lock")):
        found = _load_wheelhouse(path, key)
        if found is not None:
            return found
        return _download_wheelhouse(path, key, requirements, constraints, target, progress)


def _load_wheelhouse(path: Path, key: str) -> Wheelhouse | None:
    manifest = _read_json(path / _WHEELHOUSE_MANIFEST)
    if manifest.get("key") != key or not isinstance(manifest.get("wheels"), dict):
        return None
    return Wheelhouse(path=path, key=key, wheels=manifest["wheels"])


def _download_wheelhouse(
    path: Path,
    key: str,
    requirements: str,
    constraints: str,
    target: PythonTarget,
    progress: Progress | None,
) -> Wheelhouse:
    partial = path.with_name(f"{key}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)  # an incomplete one (no manifest)
    partial.mkdir(parents=True)
    (partial / "requirements.txt").write_text(requirements)
    command = [sys.executable, "-m", "pip", "download", "--only-binary=:all:"]
    command += ["--progress-bar", "off", "--disable-pip-version-check"]
    command += ["--python-version", target.version, "--implementation", "cp"]
    for abi in target.abis:
        command += ["--abi", abi]
    for platform in target.platforms:
        command += ["--platform", platform]
    command += ["--dest", str(partial), "-r", str(partial / "requirements.txt")]
    if constraints:
        (partial / "constraints.txt").write_text(constraints)
        command += ["-c", str(partial / "constraints.txt")]
    command.append("pip")  # run from its wheel in build stages; never installed
    _report(progress, f"resolving wheels for {target.describe()} with the host's pip")
    started = time.monotonic()
    result = _run_streaming(command, progress, prefix="pip: ")
    if result.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise ImageBuildError(
            f"pip could not download wheels for {target.describe()} "
            f"(requirements: {' '.join(_requirement_lines(requirements))}). "
            "Last output:\n" + "\n".join(result.lines),
            "Check the requirement names and versions: only packages with binary wheels for "
            "this interpreter can be installed (no source builds in images), and they must "
            "agree with the agent image's pins. Check too that this host's pip reaches the "
            "package index (PIP_INDEX_URL, PIP_CERT, proxy settings).",
        )
    wheels = {wheel.name: _sha256(wheel.read_bytes()) for wheel in sorted(partial.glob("*.whl"))}
    manifest = {
        "key": key,
        "python": target.version,
        "platforms": target.platforms,
        "requirements": requirements,
        "constraints": constraints,
        "wheels": wheels,
        "created": time.time(),
    }
    _write_json(partial / _WHEELHOUSE_MANIFEST, manifest)
    partial.rename(path)
    _report(progress, f"{len(wheels)} wheels ready in {time.monotonic() - started:.1f} s")
    return Wheelhouse(path=path, key=key, wheels=wheels)


@dataclass
class _Output:
    returncode: int
    lines: list[str]


def _run_streaming(command: list[str], progress: Progress | None, *, prefix: str) -> _Output:
    """Run a command, passing each output line to `progress`; keeps the last lines."""
    tail: deque[str] = deque(maxlen=ERROR_TAIL_LINES)
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            if line:
                tail.append(line)
                if progress is not None:
                    progress(prefix + line)
    return _Output(proc.returncode, list(tail))


def _requirement_lines(text: str) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line]


# ---- the agent image -----------------------------------------------------------------------


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


#: The files of the agent image's definition (in images/agent/): what goes into its content hash.
AGENT_DEFINITION_FILES = ("Dockerfile", "install.sh", "harden.sh")


def agent_image_definition() -> dict[str, bytes]:
    """The Dockerfile and the scripts it runs (shared with the E2B template)."""
    return {name: (AGENT_IMAGE_DIR / name).read_bytes() for name in AGENT_DEFINITION_FILES}


def runtime_files_of(root: Path) -> dict[str, bytes]:
    """The runtime package's files (relative path -> content): no bytecode, no dot-files."""
    if not root.is_dir():
        raise ImageBuildError(
            f"The in-sandbox runtime package is missing (no folder {root}).",
            "Run the orchestrator from a complete source checkout.",
        )
    files = {}
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        skipped = "__pycache__" in relative.parts or any(p.startswith(".") for p in relative.parts)
        if path.is_file() and not skipped and path.suffix not in (".pyc", ".pyo"):
            files[relative.as_posix()] = path.read_bytes()
    return files


def plan_agent_image(
    client: docker.DockerClient, *, base: str | None = None, progress: Progress | None = None
) -> AgentImagePlan:
    """Resolve the base, its interpreter and the wheelhouse, and compute the agent image tag.

    Builds nothing; may pull or bootstrap the base and resolve the wheelhouse the first time.
    """
    base = resolve_base(client, base, progress)
    base_id = client.api.inspect_image(base)["Id"]
    target = python_target(client, base)
    definition = agent_image_definition()
    requirements = (AGENT_IMAGE_DIR / "requirements.txt").read_text()
    wheelhouse = ensure_wheelhouse(requirements, target, progress=progress)
    runtime_files = runtime_files_of(RUNTIME_DIR)
    content_hash = _digest(
        {
            "version": VERSION,
            "definition": {name: _sha256(data) for name, data in definition.items()},
            "requirements": requirements,
            "base_id": base_id,
            "wheels": wheelhouse.wheels,
            "runtime": {name: _sha256(data) for name, data in runtime_files.items()},
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
    if _inspect(client, plan.tag) is None:
        with FileLock(str(_state_dir() / f".build-{plan.content_hash[:16]}.lock")):
            if _inspect(client, plan.tag) is None:
                _build_agent_image(client, plan, progress)
    requirements = normalize_requirements(extra_requirements)
    if not requirements:
        return plan.tag
    return _ensure_payload_image(client, plan, requirements, progress)


def _build_agent_image(
    client: docker.DockerClient, plan: AgentImagePlan, progress: Progress | None
) -> None:
    _report(progress, f"building {plan.tag} on {plan.base} ({plan.target.describe()})")
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
    _build(client, plan.tag, files, wheels, buildargs, progress)


# ---- payload images ------------------------------------------------------------------------


def normalize_requirements(requirements: Iterable[str]) -> tuple[str, ...]:
    """Sorted, de-duplicated requirement lines; pip options are refused."""
    lines: set[str] = set()
    for item in requirements:
        for line in _requirement_lines(item):
            if line.startswith("-") or not re.match(r"^[A-Za-z0-9]", line):
                raise ConfigError(
                    f"Extra requirement {line!r} is not a plain requirement "
                    "(pip options such as -e, -r or --index-url are not allowed).",
                    "List package requirements only, e.g. `tabulate==0.9.0`.",
                )
            lines.add(" ".join(line.split()))
    return tuple(sorted(lines))


def _ensure_payload_image(
    client: docker.DockerClient,
    plan: AgentImagePlan,
    requirements: tuple[str, ...],
    progress: Progress | None,
) -> str:
    requirements_text = "\n".join(requirements) + "\n"
    constraints = plan.wheelhouse.pins()
    wheelhouse = ensure_wheelhouse(
        requirements_text, plan.target, constraints=constraints, progress=progress
    )
    if set(wheelhouse.wheels) <= set(plan.wheelhouse.wheels):
        _report(progress, f"{' '.join(requirements)}: already in {plan.tag}")
        return plan.tag
    dockerfile = (AGENT_IMAGE_DIR / "payload.Dockerfile").read_text()
    content_hash = _digest(
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
    if _inspect(client, tag) is not None:
        return tag
    with FileLock(str(_state_dir() / f".build-{content_hash[:16]}.lock")):
        if _inspect(client, tag) is not None:
            return tag
        _report(progress, f"building {tag} from {plan.tag} with {' '.join(requirements)}")
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
        }
        _build(client, tag, files, wheels, buildargs, progress)
    return tag


# ---- building ------------------------------------------------------------------------------


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


def _build(
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
    """
    started = time.monotonic()
    tail: deque[str] = deque(maxlen=ERROR_TAIL_LINES)
    error = None
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
                if "error" in chunk:
                    error = chunk.get("errorDetail", {}).get("message") or chunk["error"]
        except docker.errors.DockerException as exc:
            error = f"{type(exc).__name__}: {exc}"
    if error is None and _inspect(client, tag) is None:
        error = "the build finished without producing the image"
    if error is not None:
        raise ImageBuildError(
            f"Building {tag} failed: {error.strip()}\nLast build output:\n" + "\n".join(tail),
            "Read the build output above for the failing step. The wheelhouse is in "
            f"{wheelhouse_root()}; delete it to resolve the wheels again, or set "
            f"{BASE_IMAGE_ENV} to try another base image.",
        )
    _report(progress, f"built {tag} in {time.monotonic() - started:.1f} s")


# ---- listing and pruning -------------------------------------------------------------------


def _tags(image: dict[str, Any]) -> list[str]:
    return [tag for tag in image.get("RepoTags") or [] if tag != "<none>:<none>"]


def _kind(image: dict[str, Any]) -> str | None:
    kind = (image.get("Labels") or {}).get(LABEL_KIND)
    if kind is None and BASE_IMAGE in _tags(image):
        return KIND_BASE
    return kind


def list_images(client: docker.DockerClient) -> list[dict[str, Any]]:
    """The orchestrator's tagged images (agent, payload and base), newest first.

    Each is `{tag, id, kind, created, size, in_use, labels}`; `in_use` means a container
    (running or not) was made from it. Untagged images left by multi-stage builds are the
    builder's layer cache, not listed here (`docker image prune` removes them).
    """
    used = {container["ImageID"] for container in client.api.containers(all=True)}
    rows = []
    for image in client.api.images():
        kind = _kind(image)
        if kind not in (KIND_AGENT, KIND_PAYLOAD, KIND_BASE):
            continue
        for tag in _tags(image):
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
    rows.sort(key=lambda row: row["created"], reverse=True)
    return rows


def prune_images(
    client: docker.DockerClient,
    *,
    keep_current: bool = True,
    dry_run: bool = False,
    include_base: bool = False,
    progress: Progress | None = None,
) -> list[str]:
    """Remove the orchestrator's images other than the current ones; returns what went.

    Current: the agent image the configured base would get now (working that out may
    resolve the base and the wheelhouse), its base, and the payload images built on it.
    Images in use by a container are kept. The debootstrap base is removed only with
    `include_base`. Payload images go before agent images, agent images before bases.
    """
    rows = list_images(client)
    keep: set[str] = set()
    if keep_current:
        plan = plan_agent_image(client, progress=progress)
        keep |= {plan.tag, plan.base}
        keep |= {row["tag"] for row in rows if row["labels"].get(LABEL_AGENT_IMAGE) == plan.tag}
    order = {KIND_PAYLOAD: 0, KIND_AGENT: 1, KIND_BASE: 2}
    removed = []
    for row in sorted(rows, key=lambda row: order[row["kind"]]):
        if row["tag"] in keep or row["in_use"]:
            continue
        if row["kind"] == KIND_BASE and not include_base:
            continue
        if not dry_run:
            try:
                client.api.remove_image(row["tag"], noprune=False)
            except docker.errors.APIError as exc:  # e.g. a child image still uses it
                _report(progress, f"kept {row['tag']}: {exc.explanation or exc}")
                continue
        _report(progress, f"{'would remove' if dry_run else 'removed'} {row['tag']}")
        removed.append(row["tag"])
    return removed
