"""Wheelhouses: the wheels an image installs offline, resolved on the host for its interpreter.

The host's pip resolves once per requirements + interpreter + platform
(`pip download --only-binary=:all: --python-version ... --platform ...`); images are then
built with `--no-index`, reproducibly and without network.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ImageBuildError, ManifestError
from ..labels import LABEL_KIND, LABEL_OWNER, LABEL_STORE, LABEL_VERSION, owner_label, store_id
from ..paths import VERSION, home_dir
from .imagedef import (
    BASE_IMAGE_ENV,
    Progress,
    digest,
    images_state_dir,
    read_json,
    report,
    requirement_lines,
    run_streaming,
    sha256,
    write_json,
)

WHEELHOUSE_ENV = "ORCHESTRATOR_WHEELHOUSE"


_PROBE = (
    "import json, platform, sys; print(json.dumps({'python': platform.python_version(), "
    "'implementation': sys.implementation.name, 'libc': platform.libc_ver(), "
    "'machine': platform.machine()}))"
)


#: How long the interpreter probe of a base image may run.
PROBE_SECONDS = 60
#: The probe's command (its entrypoint): coreutils' timeout (in every Debian-like base), so
#: that it cannot outlive its deadline even if its owner dies.
PROBE_COMMAND = ("timeout", "-s", "KILL", str(PROBE_SECONDS), "python3", "-c", _PROBE)
#: The probe runs as nobody.
PROBE_USER = "65534:65534"
_WHEELHOUSE_MANIFEST = "wheelhouse.json"  # written last: its presence marks completion


def wheelhouse_root() -> Path:
    """Where wheelhouses are kept: `$ORCHESTRATOR_WHEELHOUSE`, else `<home>/wheelhouse`."""
    path = Path(os.environ.get(WHEELHOUSE_ENV) or home_dir() / "wheelhouse")
    path.mkdir(parents=True, exist_ok=True)
    return path


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


class ProbeFailed(Exception):
    """The interpreter probe could not run in an image (the backend's engine says why)."""


def run_probe_container(client: Any, image: str) -> bytes:
    """The probe's output from a container of `image` on a Docker engine's `client` (the
    caller's, so that this module needs no Docker SDK); the engine's errors pass through."""
    output: bytes = client.containers.run(
        image,
        entrypoint=list(PROBE_COMMAND),
        command=[],
        user=PROBE_USER,
        network_disabled=True,
        remove=True,
        labels=probe_labels(),
    )
    return output


def probe_labels() -> dict[str, str]:
    """The labels of a probe's container, so that cleanup finds one whose owner died."""
    return {
        LABEL_KIND: "image-probe",
        LABEL_VERSION: VERSION,
        LABEL_OWNER: owner_label(),
        LABEL_STORE: store_id(home_dir()),
    }


def python_target(image: str, image_id: str, run_probe: Callable[[], bytes]) -> PythonTarget:
    """The interpreter of `image` (whose engine id is `image_id`): asked once, then cached
    per image id. `run_probe` is the backend's: it runs `PROBE_COMMAND` in the image as
    `PROBE_USER`, without network, and returns its output (raises ProbeFailed); so this
    module needs no engine's SDK."""
    cache_file = images_state_dir() / "python-versions.json"
    cache = read_json(cache_file)
    info = cache.get(image_id)
    if info is None:
        try:
            info = json.loads(run_probe().decode().strip().splitlines()[-1])
        except (ProbeFailed, ValueError, IndexError) as exc:
            raise ImageBuildError(
                f"Could not find the Python version of the base image {image} "
                f"(`python3 -c ...` in it failed: {exc}).",
                f"Use a base image with `python3` on its PATH ({BASE_IMAGE_ENV}).",
            ) from exc
        cache[image_id] = info
        write_json(cache_file, cache)
    libc, libc_version = info["libc"]
    if info["implementation"] != "cpython" or libc != "glibc":
        raise ImageBuildError(
            f"The base image {image} has {info['implementation']} with libc {libc or '?'}; "
            "the agent image needs CPython on glibc (manylinux wheels).",
            f"Use a Debian- or Ubuntu-based image with python3 ({BASE_IMAGE_ENV}).",
        )
    return PythonTarget(version=info["python"], glibc=libc_version, machine=info["machine"])


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
        for name, expected in sorted(self.wheels.items()):
            path = self.path / name
            try:
                intact = sha256(path.read_bytes()) == expected
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
    key = digest(
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
    from filelock import FileLock  # only when wheels may be fetched (see imagedef.build_lock)

    with FileLock(str(wheelhouse_root() / f".{key}.lock")):
        found = _load_wheelhouse(path, key)
        if found is not None:
            return found
        return _download_wheelhouse(path, key, requirements, constraints, target, progress)


def _load_wheelhouse(path: Path, key: str) -> Wheelhouse | None:
    manifest = read_json(path / _WHEELHOUSE_MANIFEST)
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
    report(progress, f"resolving wheels for {target.describe()} with the host's pip")
    started = time.monotonic()
    result = run_streaming(command, progress, prefix="pip: ")
    if result.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        missing = not_on_index(result.lines)
        if missing is not None:
            raise missing_requirement(missing, target)
        raise ImageBuildError(
            f"pip could not download wheels for {target.describe()} "
            f"(requirements: {' '.join(requirement_lines(requirements))}). "
            "Last output:\n" + "\n".join(result.lines),
            "Check the requirement names and versions: only packages with binary wheels for "
            "this interpreter can be installed (no source builds in images), and they must "
            "agree with the agent image's pins. Check too that this host's pip reaches the "
            "package index (PIP_INDEX_URL, PIP_CERT, proxy settings).",
        )
    wheels = {wheel.name: sha256(wheel.read_bytes()) for wheel in sorted(partial.glob("*.whl"))}
    manifest = {
        "key": key,
        "python": target.version,
        "platforms": target.platforms,
        "requirements": requirements,
        "constraints": constraints,
        "wheels": wheels,
        "created": time.time(),
    }
    write_json(partial / _WHEELHOUSE_MANIFEST, manifest)
    partial.rename(path)
    report(progress, f"{len(wheels)} wheels ready in {time.monotonic() - started:.1f} s")
    return Wheelhouse(path=path, key=key, wheels=wheels)


#: pip's last word when no release of a requirement fits ("not on the index" or "no such
#: version"): the user's mistake. pip says the same after it failed to reach the index, so
#: the words of an unreachable index (below) make it an infrastructure fault again.
_NOT_FOUND = re.compile(r"No matching distribution found for (\S+)")
_UNREACHABLE = (
    "NewConnectionError",
    "ConnectTimeout",
    "ReadTimeout",
    "Max retries exceeded",
    "ProxyError",
    "SSLError",
    "Temporary failure in name resolution",
    "Retrying (",
)


def not_on_index(lines: list[str]) -> str | None:
    """The requirement pip found no release of, when the index was reached; else None."""
    if any(word in line for line in lines for word in _UNREACHABLE):
        return None
    for line in reversed(lines):
        found = _NOT_FOUND.search(line)
        if found:
            return found.group(1)
    return None


def missing_requirement(requirement: str, target: PythonTarget) -> ManifestError:
    """Bad input (exit 2), not a fault to retry: no release of `requirement` fits."""
    name = re.split(r"[^\w.-]", requirement)[0]
    error = ManifestError(
        f"field `python.requirements`: no release of {requirement!r} is on the package index "
        f"as a binary wheel for {target.describe()} (pip: No matching distribution found).",
        f"Check the name and version (`pip index versions {name}` lists the versions there), "
        "then fix `python.requirements` in the payload's manifest.toml.",
    )
    error.field = "python.requirements"
    return error
