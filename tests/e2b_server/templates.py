"""E2B template builds on Docker's classic builder.

The SDK's `Template.build` asks for a build (`POST /v3/templates`), uploads each COPY step's
files as a tar to the URL the API hands out, starts the build with its steps
(`POST /v2/templates/{id}/builds/{build}`) and polls its status and logs. Here the steps
become a Dockerfile, built by the classic builder (the only one on the test machines) from a
context holding each uploaded archive in its own folder; the image it makes is what sandboxes
of the template run. Steps follow E2B's template manager where Docker can express it (see
README.md for what is not faithful).
"""

from __future__ import annotations

import copy
import io
import json
import os
import posixpath
import re
import secrets
import shutil
import string
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import IO, TYPE_CHECKING, Any

import docker
import docker.errors

from .docker_sandbox import (
    LABEL,
    LABEL_INSTANCE,
    LABEL_KEEP,
    LABEL_OWNER_PID,
    LABEL_SANDBOX,
    ContainerGone,
    SandboxContainer,
    list_containers,
    list_images,
    remove_images,
)
from .errors import ApiError

if TYPE_CHECKING:
    from .cloud import FakeE2BCloud

IMAGE_REPOSITORY = "e2b-test-server"
"""Built images are tagged `e2b-test-server/<templateID>:<buildID>`."""
UPLOAD_PREFIX = "/_uploads/"
"""Path of the upload URLs the API hands out (served by the same server, like S3 would)."""
DEFAULT_TAG = "default"
MAX_LOG_ENTRIES = 100
START_TIMEOUT = 60.0
BASE_STEP = "base"
FINALIZE_STEP = "finalize"

_FILES_HASH = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^(?:[a-z0-9_-]+/)?[a-z0-9_-]+$")
_TAG = re.compile(r"^[a-z0-9_.-]+$")
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_NUMERIC_USER = re.compile(r"^\d+(:\d+)?$")
_DOCKER_STEP = re.compile(r"^Step (\d+)/(\d+) : ")
_BUILDER_NOISE = (
    " ---> ",
    "Removing intermediate container",
    "Successfully built",
    "Successfully tagged",
)
_LEVELS = {"debug": 0, "info": 1, "warn": 2, "error": 3}
_ID_ALPHABET = string.ascii_lowercase + string.digits

# USER creates a missing user, as E2B's template manager does (it runs `adduser -D`).
_ENSURE_USER = 'id -u "$1" >/dev/null 2>&1 || useradd -m "$1" 2>/dev/null || adduser -D "$1"'
_ADD_SUDO = (
    '; { usermod -aG sudo "$1" || addgroup "$1" sudo; } >/dev/null 2>&1; '
    'passwd -d "$1" >/dev/null 2>&1; '
    'grep -qs "^$1 ALL=(ALL:ALL) NOPASSWD: ALL" /etc/sudoers || '
    'echo "$1 ALL=(ALL:ALL) NOPASSWD: ALL" >> /etc/sudoers'
)


class BuildFailed(Exception):
    """A build ends in `error`; `step` is E2B's step name ("base", "1", ..., "finalize")."""

    def __init__(self, message: str, step: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.step = step


@dataclass
class BuildLogEntry:
    """One `BuildLogEntry` of the status endpoint."""

    timestamp: float
    level: str  # debug | info | warn | error
    message: str
    step: str | None = None

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "timestamp": _iso(self.timestamp),
            "level": self.level,
            "message": self.message,
        }
        if self.step is not None:
            entry["step"] = self.step
        return entry


@dataclass
class TemplateBuild:
    """One build of a template: waiting -> building -> ready | error."""

    build_id: str
    template_id: str
    name: str
    tags: list[str]
    cpu_count: int | None
    memory_mb: int | None
    status: str = "waiting"
    logs: list[BuildLogEntry] = field(default_factory=list)
    reason: str | None = None
    reason_step: str | None = None
    request: dict[str, Any] | None = None
    """The `TemplateBuildStartV2` body (fromImage, steps, startCmd, ...)."""
    dockerfile: str | None = None
    image: str | None = None
    """The tag of the built image, once ready."""
    image_id: str | None = None
    cancelled: bool = False
    thread: threading.Thread | None = None

    @property
    def done(self) -> bool:
        return self.status in ("ready", "error")


@dataclass
class RegisteredTemplate:
    """A template created by `POST /v3/templates`; its name is claimed at once, as on E2B."""

    template_id: str
    name: str
    public: bool = False
    builds: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class TemplateRuntime:
    """What a sandbox of a built template needs beyond its image."""

    template_id: str
    build_id: str
    cpu_count: int | None
    memory_mb: int | None
    start_cmd: str | None
    ready_cmd: str | None


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def new_template_id() -> str:
    """An id shaped like E2B's template ids: 20 lowercase alphanumerics."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(20))


def parse_name(raw: str) -> tuple[str, str | None]:
    """Split E2B's `[namespace/]alias[:tag]` into the lowercased alias and tag (400 if bad)."""
    identifier, _, tag = raw.strip().lower().partition(":")
    if not _NAME.match(identifier):
        raise ApiError(400, f"Invalid name: invalid template ID: {raw}")
    if tag and not _TAG.match(tag):
        raise ApiError(400, f"Invalid tag: invalid tag: {tag}")
    return identifier, (tag if tag and tag != DEFAULT_TAG else None)


def glob_free_prefix(src: str) -> str:
    """The folder part of a COPY source before its first glob character (doublestar's
    SplitPattern after E2B's trailing slash): "pkg/" -> "pkg", "*.txt" -> ".",
    "src/**/*.py" -> "src"."""
    pattern = src if src.endswith("/") else src + "/"
    meta = re.search(r"[*?\[{\\]", pattern)
    cut = pattern[: meta.start()] if meta else pattern
    slash = cut.rfind("/")
    if slash == -1:
        return "."
    return pattern[:slash] or "/"


def copy_entry(src: str, names: set[str]) -> str:
    """The archive entry E2B's copy script moves for `src` ("" for the whole archive).

    Like the script, take the first entry (sorted) of the folder holding the source's
    glob-free prefix: a file lands at the destination, a folder's contents land in it.
    """
    prefix = posixpath.normpath(glob_free_prefix(src)).lstrip("/")
    if prefix in ("", "."):
        return ""
    parent = posixpath.dirname(prefix)
    children = sorted(
        {
            (name[len(parent) + 1 :] if parent else name).split("/", 1)[0]
            for name in names
            if not parent or name.startswith(parent + "/")
        }
    )
    if not children:
        raise FileNotFoundError(src)
    return posixpath.join(parent, children[0])


def _safe_name(name: str) -> str:
    """An archive member's normalized relative path ("" for the root); refuses escapes."""
    normalized = posixpath.normpath(name.lstrip("/")) if name else "."
    if normalized == ".":
        return ""
    if normalized == ".." or normalized.startswith("../"):
        raise ValueError(f"archive member escapes its folder: {name!r}")
    return normalized


def _under(name: str, entry: str) -> bool:
    return not entry or name == entry or name.startswith(entry + "/")


class BuildContext:
    """The tar context sent to the builder: the Dockerfile and, for each COPY step, its
    uploaded archive extracted under a folder named after its files hash."""

    def __init__(self, fileobj: IO[bytes], archive_for: Callable[[str], str | None]) -> None:
        self._tar = tarfile.open(fileobj=fileobj, mode="w")
        self._archive_for = archive_for
        self._folders: set[str] = set()

    def __enter__(self) -> BuildContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self._tar.close()

    def add_copy(self, files_hash: str, src: str, mode: int | None, step: str) -> tuple[str, bool]:
        """Add a COPY step's files; return the context path to copy and whether it is a
        folder (whose contents are copied)."""
        path = self._archive_for(files_hash)
        if path is None:
            raise BuildFailed(
                f"the files of COPY {src!r} (hash {files_hash}) were never uploaded", step
            )
        # The mode is applied in the context (the classic builder has no COPY --chmod).
        folder = files_hash if mode is None else f"{files_hash}.{mode:04o}"
        try:
            with tarfile.open(path, mode="r:*") as archive:
                members = [(m, _safe_name(m.name)) for m in archive.getmembers()]
                names = {n for _, n in members if n}
                names |= {posixpath.dirname(n) for n in names} - {""}
                entry = copy_entry(src, names)
                kinds = {n: m for m, n in members if n}
                is_dir = not entry or (entry in kinds and kinds[entry].isdir())
                is_dir = is_dir or any(n.startswith(entry + "/") for n in names)
                if folder not in self._folders:
                    self._folders.add(folder)
                    self._add_members(archive, members, folder, entry, mode)
        except FileNotFoundError:
            raise BuildFailed(f"COPY {src!r}: no files were uploaded for it", step) from None
        except (tarfile.TarError, OSError, ValueError) as e:
            raise BuildFailed(f"COPY {src!r}: the uploaded archive is unusable: {e}", step) from e
        if not entry:
            return f"{folder}/", True
        return (f"{folder}/{entry}/", True) if is_dir else (f"{folder}/{entry}", False)

    def _add_members(
        self,
        archive: tarfile.TarFile,
        members: list[tuple[tarfile.TarInfo, str]],
        folder: str,
        entry: str,
        mode: int | None,
    ) -> None:
        for member, name in members:
            if not name or not (
                member.isfile() or member.isdir() or member.issym() or member.islnk()
            ):
                continue
            info = copy.copy(member)
            # A long name travels in a pax header, which tarfile writes in preference to
            # `name`: drop it, or the renamed member would land at its old path.
            info.pax_headers = {
                k: v for k, v in member.pax_headers.items() if k not in ("path", "linkpath")
            }
            info.name = f"{folder}/{name}"
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if member.islnk():
                info.linkname = f"{folder}/{_safe_name(member.linkname)}"
            if mode is not None and not member.issym() and _under(name, entry):
                info.mode = mode
            self._tar.addfile(info, archive.extractfile(member) if member.isfile() else None)

    def add_dockerfile(self, text: str) -> None:
        data = text.encode()
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(data)
        info.mtime = int(time.time())
        info.mode = 0o644
        self._tar.addfile(info, io.BytesIO(data))


def _label(labels: Mapping[str, str]) -> str:
    return "LABEL " + " ".join(f'{k}="{v}"' for k, v in labels.items())


def _run(argv: Sequence[str]) -> str:
    return "RUN " + json.dumps(list(argv), ensure_ascii=False)


def render_dockerfile(
    base: str,
    steps: Sequence[Mapping[str, Any]],
    context: BuildContext,
    *,
    base_user: str,
    labels: Mapping[str, str],
) -> tuple[str, list[str]]:
    """Translate E2B's template steps into a Dockerfile.

    Returns the Dockerfile and, for each of its instructions, the E2B step it belongs to
    ("base", then "1" for the first step, ...), to map the builder's "Step N/M" back. Every
    instruction costs the classic builder a container, so none is emitted that changes
    nothing.
    """
    lines: list[str] = []
    step_of: list[str] = []

    def emit(instruction: str, step: str) -> None:
        if "\n" in instruction or "\r" in instruction:
            raise BuildFailed(f"a line break cannot be expressed here: {instruction!r}", step)
        lines.append(instruction)
        step_of.append(step)

    emit(f"FROM {base}", BASE_STEP)
    # Labels first, so intermediate images (a failed build's layers) carry them as well.
    emit(_label(labels), BASE_STEP)
    user = base_user or "root"  # the user steps run as, E2B's "context user"
    for index, raw in enumerate(steps):
        step = str(index + 1)
        kind = str(raw.get("type") or "").upper()
        args = [str(a) for a in raw.get("args") or []]
        if kind == "COPY":
            if len(args) < 2:
                raise BuildFailed("COPY requires a local path and a container path argument", step)
            files_hash = raw.get("filesHash")
            if not files_hash:
                raise BuildFailed("COPY requires files hash to be set", step)
            try:
                mode = int(args[3], 8) if len(args) > 3 and args[3] else None
            except ValueError:
                raise BuildFailed(f"COPY: invalid mode {args[3]!r}", step) from None
            owner = args[2] if len(args) > 2 and args[2] else user
            if ":" not in owner:
                owner = f"{owner}:{owner}"
            source, _ = context.add_copy(str(files_hash), args[0], mode, step)
            emit(f"COPY --chown={owner} " + json.dumps([source, args[1]], ensure_ascii=False), step)
        elif kind == "RUN":
            if not args or not args[0]:
                raise BuildFailed("RUN requires a command argument", step)
            run_user = args[1] if len(args) > 1 and args[1] else user
            if run_user != user:
                emit(f"USER {run_user}", step)
            emit(_run(["/bin/bash", "-l", "-c", args[0]]), step)
            if run_user != user:
                emit(f"USER {user}", step)
        elif kind == "ENV":
            if not args or len(args) % 2:
                raise BuildFailed("ENV requires both a key and value arguments", step)
            pairs = []
            for key, value in zip(args[::2], args[1::2], strict=True):
                if not _ENV_KEY.match(key):
                    raise BuildFailed(f"ENV: invalid variable name {key!r}", step)
                quoted = value.replace("\\", "\\\\").replace('"', '\\"')
                pairs.append(f'{key}="{quoted}"')
            emit("ENV " + " ".join(pairs), step)
        elif kind == "WORKDIR":
            if not args or not args[0]:
                raise BuildFailed("WORKDIR requires a path argument", step)
            if user != "root":  # E2B creates it as the current user, Docker as root
                emit(_run(["/bin/sh", "-c", 'mkdir -p "$1"', "e2b-workdir", args[0]]), step)
            emit(f"WORKDIR {args[0]}", step)
        elif kind == "USER":
            if not args or not args[0]:
                raise BuildFailed("USER requires a username argument", step)
            name = args[0]
            if name != "root" and not _NUMERIC_USER.match(name):
                script = _ENSURE_USER + (_ADD_SUDO if len(args) > 1 and args[1] == "true" else "")
                if user != "root":
                    emit("USER root", step)
                emit(_run(["/bin/sh", "-c", script, "e2b-user", name]), step)
            emit(f"USER {name}", step)
            user = name
        else:
            raise BuildFailed(f"unsupported step type {kind!r}", step)
    return "\n".join(lines) + "\n", step_of


def run_start_command(
    container: SandboxContainer,
    start_cmd: str | None,
    ready_cmd: str | None,
    timeout: float = START_TIMEOUT,
) -> None:
    """Start a template's start command in the background, then wait for its ready command
    to succeed (RuntimeError if it does not within `timeout`). Both run as the image's user
    in its working directory, through `bash -l -c` like envd."""
    user = container.user_info(container.image_user or "root")
    cwd = container.image_workdir or user.home
    env = {"PATH": container.image_path, "HOME": user.home, "USER": user.name, "LOGNAME": user.name}
    if start_cmd:
        container.start_background(
            ["/bin/bash", "-l", "-c", start_cmd], user=user, cwd=cwd, env=env
        )
    if not ready_cmd:
        return
    deadline = time.monotonic() + timeout
    script = 'cd -- "$1" 2>/dev/null; exec /bin/bash -l -c "$2"'
    while True:
        result = container.run(
            ["/bin/sh", "-c", script, "ready", cwd, ready_cmd], user=user.docker_user, env=env
        )
        if result.exit_code == 0:
            return
        if time.monotonic() > deadline:
            output = (result.stdout + result.stderr).decode(errors="replace").strip()
            raise RuntimeError(
                f"ready command {ready_cmd!r} did not succeed within {timeout:.0f} s"
                + (f": {output}" if output else "")
            )
        time.sleep(0.2)


class TemplateBuilds:
    """Templates, their builds, uploaded files and the images built (one per cloud).

    All methods are blocking and thread-safe; builds run in background threads.
    """

    def __init__(self, cloud: FakeE2BCloud) -> None:
        self.cloud = cloud
        self._lock = threading.RLock()
        self._templates: dict[str, RegisteredTemplate] = {}
        self._aliases: dict[str, str] = {}
        self._builds: dict[str, TemplateBuild] = {}
        self._runtimes: dict[str, TemplateRuntime] = {}
        self._upload_dir: str | None = None
        self._upload_tokens: dict[str, tuple[str, str]] = {}

    # -- the test API ----------------------------------------------------------------

    @property
    def builds(self) -> list[TemplateBuild]:
        """Every build requested, oldest first."""
        with self._lock:
            return list(self._builds.values())

    def build(self, build_id: str) -> TemplateBuild:
        """A build by id (KeyError if unknown)."""
        with self._lock:
            return self._builds[build_id]

    def runtime(self, image: str) -> TemplateRuntime | None:
        """How to run sandboxes of `image` if this server built it, else None."""
        with self._lock:
            return self._runtimes.get(image)

    def images(self) -> list[Any]:
        """The tagged images this cloud built that still exist."""
        found = list_images(
            self.cloud.docker, f"{LABEL_INSTANCE}={self.cloud.instance_id}", all_layers=False
        )
        return [i for i in found if any(t.startswith(IMAGE_REPOSITORY + "/") for t in i.tags)]

    def reset(self) -> None:
        """Stop running builds, forget templates, builds and uploads, and remove the images
        built (unless `keep_images`)."""
        self._stop_builds()
        with self._lock:
            built = set(self._runtimes)
            self._templates.clear()
            self._aliases.clear()
            self._builds.clear()
            self._runtimes.clear()
            self._upload_tokens.clear()
        for name in [n for n, image in self.cloud.templates.items() if image in built]:
            self.cloud.templates.pop(name, None)
        if not self.cloud.keep_images:
            self.remove_images()
        if self._upload_dir is not None:
            shutil.rmtree(self._upload_dir, ignore_errors=True)
            self._upload_dir = None

    def remove_images(self) -> int:
        """Remove every image (intermediate layers included) this cloud built."""
        instance = self.cloud.instance_id

        def other_instance(image: Any) -> bool:
            return (image.labels or {}).get(LABEL_INSTANCE) != instance

        return remove_images(self.cloud.docker, other_instance)

    # -- control plane -----------------------------------------------------------------

    def alias(self, name: str) -> dict[str, Any]:
        """The `TemplateAliasResponse` of a template name (404 if none)."""
        identifier = name.strip().lower().partition(":")[0]
        with self._lock:
            template_id = self._aliases.get(identifier)
            if template_id is not None:
                return {"templateID": template_id, "public": self._templates[template_id].public}
        if identifier in self.cloud.templates:
            return {"templateID": identifier, "public": False}
        raise ApiError(404, f"template '{identifier}' not found")

    def request(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """`POST /v3/templates`: claim the name, register a waiting build."""
        self.cloud.check_fault("template_request")
        raw = body.get("name") or body.get("alias")
        if not isinstance(raw, str) or not raw.strip():
            raise ApiError(400, "Name is required")
        identifier, tag = parse_name(raw)
        tags: list[str] = [tag] if tag else []
        for extra in body.get("tags") or []:
            cleaned = str(extra).strip().lower()
            if not _TAG.match(cleaned) or _UUID.match(cleaned):
                raise ApiError(400, f"Invalid tag: invalid tag '{extra}'")
            if cleaned not in tags:
                tags.append(cleaned)
        tags = tags or [DEFAULT_TAG]
        resources = {}
        for key in ("cpuCount", "memoryMB"):
            value = body.get(key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ApiError(400, f"Invalid request body: {key} must be a positive integer")
            resources[key] = value
        with self._lock:
            template_id = self._aliases.get(identifier) or new_template_id()
            template = self._templates.setdefault(
                template_id, RegisteredTemplate(template_id, identifier)
            )
            self._aliases[identifier] = template_id
            for other in self._builds.values():  # E2B invalidates unstarted builds of a tag
                if other.template_id == template_id and other.status == "waiting":
                    if set(other.tags) & set(tags):
                        other.status = "error"
                        other.reason = (
                            "The build was canceled because it was superseded by a newer one."
                        )
            build = TemplateBuild(
                build_id=str(uuid.uuid4()),
                template_id=template_id,
                name=identifier,
                tags=tags,
                cpu_count=resources["cpuCount"],
                memory_mb=resources["memoryMB"],
            )
            self._builds[build.build_id] = build
            template.builds.append(build.build_id)
        return {
            "templateID": template_id,
            "buildID": build.build_id,
            "names": [identifier],
            "tags": list(tags),
            "aliases": [identifier],
            "public": template.public,
        }

    def upload_link(self, template_id: str, files_hash: str, base_url: str) -> dict[str, Any]:
        """`GET /templates/{id}/files/{hash}`: is it cached, and where to PUT it."""
        self.cloud.check_fault("template_files")
        if not _FILES_HASH.match(files_hash):
            raise ApiError(400, "Invalid files hash")
        with self._lock:
            if template_id not in self._templates:
                raise ApiError(404, f"Error when getting template: '{template_id}' not found")
            token = secrets.token_urlsafe(18)
            self._upload_tokens[token] = (template_id, files_hash)
        present = os.path.exists(self._archive_file(files_hash))
        url = f"{base_url.rstrip('/')}{UPLOAD_PREFIX}{template_id}/{files_hash}?token={token}"
        return {"present": present, "url": url}

    def upload_target(self, template_id: str, files_hash: str, token: str) -> str:
        """Where the upload for a handed-out URL goes (403 for a URL this server did not
        sign, as S3 refuses a bad presigned URL)."""
        with self._lock:
            if self._upload_tokens.get(token) != (template_id, files_hash):
                raise ApiError(403, "The request signature does not match")
        self.cloud.check_fault("template_upload")
        return self._archive_file(files_hash)

    def start(self, template_id: str, build_id: str, body: Mapping[str, Any]) -> None:
        """`POST /v2/templates/{id}/builds/{build}`: start building in the background."""
        self.cloud.check_fault("template_build")
        steps = body.get("steps") or []
        if not isinstance(steps, list) or not all(isinstance(s, Mapping) for s in steps):
            raise ApiError(400, "Invalid request body: steps must be a list of objects")
        if not body.get("fromImage") and not body.get("fromTemplate"):
            raise ApiError(400, "Invalid request body: fromImage or fromTemplate is required")
        with self._lock:
            build = self._builds.get(build_id)
            if build is None or build.template_id != template_id:
                raise ApiError(404, f"Error when getting template: build '{build_id}' not found")
            if build.status != "waiting":
                raise ApiError(400, "build is not in waiting state")
            build.request = dict(body)
            build.status = "building"
            build.thread = threading.Thread(
                target=self._run, args=(build,), name=f"e2b-build-{build_id[:8]}", daemon=True
            )
            build.thread.start()

    def status(
        self,
        template_id: str,
        build_id: str,
        offset: int = 0,
        limit: int = MAX_LOG_ENTRIES,
        level: str | None = None,
    ) -> dict[str, Any]:
        """`GET .../builds/{build}/status`: the `TemplateBuildInfo` with a page of logs."""
        self.cloud.check_fault("template_status")
        with self._lock:
            build = self._builds.get(build_id)
            if build is None or build.template_id != template_id:
                raise ApiError(400, f"Build '{build_id}' not found")
            info: dict[str, Any] = {
                "templateID": template_id,
                "buildID": build_id,
                "status": build.status,
                "logEntries": [],
                "logs": [],
            }
            if build.status == "waiting":
                return info
            entries = build.logs
            if level:
                floor = _LEVELS.get(level, 0)
                entries = [e for e in entries if _LEVELS.get(e.level, 1) >= floor]
            start = max(offset, 0)
            page = entries[start : start + max(0, min(limit, MAX_LOG_ENTRIES))]
            info["logEntries"] = [e.to_json() for e in page]
            if build.reason is not None:
                reason: dict[str, Any] = {"message": build.reason}
                if build.reason_step is not None:
                    reason["step"] = build.reason_step
                    reason["logEntries"] = [
                        e.to_json()
                        for e in page
                        if e.step == build.reason_step and _LEVELS[e.level] >= _LEVELS["warn"]
                    ]
                info["reason"] = reason
        return info

    # -- building ----------------------------------------------------------------------

    def _run(self, build: TemplateBuild) -> None:
        try:
            image_id = self._build_image(build)
            self._finalize(build, image_id)
        except BuildFailed as e:
            self._finish(build, e.message, e.step)
        except Exception as e:  # a bug here must end the build, not hang the SDK
            self._finish(build, f"internal error of the E2B test server: {e!r}", None)

    def _log(
        self, build: TemplateBuild, message: str, *, step: str | None = None, level: str = "info"
    ) -> None:
        with self._lock:
            build.logs.append(BuildLogEntry(time.time(), level, message, step))

    def _finish(self, build: TemplateBuild, reason: str, step: str | None) -> None:
        self._log(
            build, reason.splitlines()[0] if reason else "build failed", step=step, level="error"
        )
        with self._lock:
            build.reason = reason
            build.reason_step = step
            build.status = "error"

    def _resolve_base(self, body: Mapping[str, Any]) -> tuple[str, Any]:
        """The local image to build FROM: a built or mapped template, a `base_images` entry
        or the ref itself. Nothing is pulled: there is no registry."""
        if body.get("fromTemplate"):
            ref = str(body["fromTemplate"])
            image = self.cloud.templates.get(ref) or self.cloud.templates.get(ref.lower())
            if image is None:
                raise BuildFailed(f"template '{ref}' not found", BASE_STEP)
        else:
            ref = str(body["fromImage"])
            image = self.cloud.base_images.get(ref, ref)
        try:
            return ref, self.cloud.docker.images.get(image)
        except docker.errors.ImageNotFound:
            raise BuildFailed(
                f"base image '{ref}' (local image '{image}') does not exist locally and the "
                "E2B test server cannot pull (there is no registry): build it, or map the ref "
                "to a local image with base_images={...}",
                BASE_STEP,
            ) from None

    def _build_image(self, build: TemplateBuild) -> str:
        body = build.request or {}
        steps = list(body.get("steps") or [])
        self._log(build, f"Building template {build.template_id}, build {build.build_id}")
        ref, base = self._resolve_base(body)
        base_name = base.tags[0] if base.tags else base.id
        self._log(build, f"Base: {ref} (local image {base_name})", step=BASE_STEP)
        labels = {
            LABEL: "1",
            LABEL_INSTANCE: self.cloud.instance_id,
            LABEL_OWNER_PID: str(os.getpid()),
        }
        if self.cloud.keep_images:
            labels[LABEL_KEEP] = "1"
        nocache = bool(body.get("force")) or any(bool(s.get("force")) for s in steps)
        with tempfile.TemporaryFile() as context_file:
            with BuildContext(context_file, self._archive_for) as context:
                dockerfile, step_of = render_dockerfile(
                    base.id,
                    steps,
                    context,
                    base_user=(base.attrs.get("Config") or {}).get("User") or "",
                    labels=labels,
                )
                context.add_dockerfile(dockerfile)
            build.dockerfile = dockerfile
            context_file.seek(0)
            return self._docker_build(build, context_file, step_of, nocache)

    def _docker_build(
        self, build: TemplateBuild, context: IO[bytes], step_of: list[str], nocache: bool
    ) -> str:
        """Run the classic builder, turning its stream into build logs."""
        tag = f"{IMAGE_REPOSITORY}/{build.template_id}:{build.build_id}"
        step = BASE_STEP
        output: list[str] = []  # the current Dockerfile step's own output
        pending = ""
        error: str | None = None
        image_id: str | None = None

        def line(text: str) -> None:
            nonlocal step
            if not text.strip():
                return
            match = _DOCKER_STEP.match(text)
            if match:
                number = int(match.group(1))
                step = step_of[number - 1] if 0 < number <= len(step_of) else FINALIZE_STEP
                output.clear()
                self._log(build, text, step=step)
            elif text.startswith(_BUILDER_NOISE):
                self._log(build, text.strip(), step=step, level="debug")
            else:
                output.append(text)
                self._log(build, text, step=step)

        try:
            stream = self.cloud.docker.api.build(
                fileobj=context,
                custom_context=True,
                tag=tag,
                pull=False,
                rm=True,
                forcerm=True,
                nocache=nocache,
                decode=True,
            )
            for chunk in stream:
                if "stream" in chunk:
                    pending += str(chunk["stream"])
                    *lines, pending = pending.split("\n")
                    for text in lines:
                        line(text)
                elif "error" in chunk:
                    error = (chunk.get("errorDetail") or {}).get("message") or str(chunk["error"])
                elif "aux" in chunk:
                    image_id = (chunk.get("aux") or {}).get("ID") or image_id
            line(pending)
        except docker.errors.APIError as e:
            error = str(e.explanation or e)
        if build.cancelled:
            raise BuildFailed("the build was cancelled: the E2B test server stopped", step)
        if error is not None:
            message = f"step {step} failed: {error.strip()}"
            if output:
                message += "\n" + "\n".join(output[-50:])
            raise BuildFailed(message, step)
        build.image = tag
        return image_id or self.cloud.docker.images.get(tag).id

    def _finalize(self, build: TemplateBuild, image_id: str) -> None:
        """Check the start/ready commands like E2B does before snapshotting, then make the
        template's names point at the new image."""
        body = build.request or {}
        start_cmd = body.get("startCmd") or None
        ready_cmd = body.get("readyCmd") or None
        assert build.image is not None
        if start_cmd or ready_cmd:
            self._log(build, "Running the start and ready commands", step=FINALIZE_STEP)
            container = SandboxContainer.start(
                self.cloud.docker,
                image=build.image,
                name=f"e2b-test-build-{build.build_id}",
                labels={
                    LABEL: "1",
                    LABEL_INSTANCE: self.cloud.instance_id,
                    LABEL_OWNER_PID: str(os.getpid()),
                },
                network_mode=self.cloud.container_network,
                options={},
            )
            try:
                run_start_command(container, start_cmd, ready_cmd)
            except (RuntimeError, KeyError, ContainerGone, docker.errors.APIError) as e:
                raise BuildFailed(f"start/ready command failed: {e}", FINALIZE_STEP) from e
            finally:
                container.remove()
        runtime = TemplateRuntime(
            template_id=build.template_id,
            build_id=build.build_id,
            cpu_count=build.cpu_count,
            memory_mb=build.memory_mb,
            start_cmd=start_cmd,
            ready_cmd=ready_cmd,
        )
        names: dict[str, str] = {}
        for tag in build.tags:
            names[f"{build.name}:{tag}"] = names[f"{build.template_id}:{tag}"] = build.image
            if tag == DEFAULT_TAG:
                names[build.name] = names[build.template_id] = build.image
        with self._lock:
            if build.cancelled:
                raise BuildFailed("the build was cancelled: the E2B test server stopped", None)
            build.image_id = image_id
            self._runtimes[build.image] = runtime
            self.cloud.templates.update(names)
            build.logs.append(BuildLogEntry(time.time(), "info", "Build finished", FINALIZE_STEP))
            build.status = "ready"

    # -- uploads and cleanup -----------------------------------------------------------

    def _archive_file(self, files_hash: str) -> str:
        with self._lock:
            if self._upload_dir is None:
                self._upload_dir = tempfile.mkdtemp(prefix="e2b-test-uploads-")
            return os.path.join(self._upload_dir, files_hash)

    def _archive_for(self, files_hash: str) -> str | None:
        path = self._archive_file(files_hash)
        return path if _FILES_HASH.match(files_hash) and os.path.exists(path) else None

    def _stop_builds(self, timeout: float = 60.0) -> None:
        """Cancel running builds: their step containers are removed, which ends them."""
        with self._lock:
            running = [b for b in self._builds.values() if b.thread and b.thread.is_alive()]
            for build in running:
                build.cancelled = True
        deadline = time.monotonic() + timeout
        for build in running:
            assert build.thread is not None
            while build.thread.is_alive() and time.monotonic() < deadline:
                for container in list_containers(
                    self.cloud.docker, **{LABEL_INSTANCE: self.cloud.instance_id}
                ):
                    if LABEL_SANDBOX not in (container.labels or {}):
                        try:
                            container.remove(force=True)
                        except docker.errors.APIError:
                            pass
                build.thread.join(timeout=0.5)

    def shutdown(self) -> None:
        """Stop builds; remove this cloud's images (unless `keep_images`) and uploads."""
        self._stop_builds()
        if not self.cloud.keep_images:
            self.remove_images()
        if self._upload_dir is not None:
            shutil.rmtree(self._upload_dir, ignore_errors=True)
            self._upload_dir = None
