"""Payload manifests: load `manifest.toml`, validate every field, and refuse what is unsafe."""

from __future__ import annotations

import re
import sys
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator_runtime.protocol import ENTRYPOINT_RE, ENV_NAME_RE, MODULE_RE, is_dangerous_import

from .config import examples_dir
from .errors import ManifestError
from .payload import ShippedFile, payload_files
from .policy import (
    HOST_NAME_HELP,
    REQUIREMENT_HELP,
    AllowedRequirement,
    check_host_name,
    check_requirement,
)
from .registry import backend_names
from .spec import SETTABLE_LIMITS, Limits

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

MANIFEST_NAME = "manifest.toml"


_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")








_ALLOWED = {
    "payload": {"name", "description", "entrypoint", "example_task", "example_answer", "backend"},
    "python": {"requirements", "authorized_imports"},
    "secrets": {"required"},
    "network": {"hosts"},
    "limits": set(SETTABLE_LIMITS),
    "mock": {"scripts"},
}


@dataclass(frozen=True)
class Manifest:
    """A validated payload manifest plus the folder it came from."""

    path: Path
    name: str
    entrypoint: str
    description: str = ""
    example_task: str | None = None
    example_answer: str | None = None
    requirements: tuple[str, ...] = ()
    authorized_imports: tuple[str, ...] = ()
    secrets: tuple[str, ...] = ()
    hosts: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)
    mock_scripts: dict[str, list[str]] = field(default_factory=dict)
    #: Where runs of this payload go unless the run names a backend (None: docker).
    backend: str | None = None

    @property
    def folder(self) -> Path:
        return self.path.parent

    def dangerous_imports(self) -> list[str]:
        return sorted(m for m in self.authorized_imports if is_dangerous_import(m))

    def payload_files(self) -> dict[str, ShippedFile]:
        """The payload's files, ready to ship in (see orchestrator/payload.py)."""
        return payload_files(self.folder)


def load_manifest(payload: str | Path, *, allowed_requirements: Collection[str] = ()) -> Manifest:
    """Load and validate the manifest of a payload folder (or a manifest file path).

    `python.requirements` must be package specifications; a `name @ URL` reference passes
    only if `allowed_requirements` names exactly that string (the run's
    --allow-requirement), and is then kept as a `policy.AllowedRequirement` so the image
    build admits it too.
    """
    path = Path(payload)
    example = examples_dir() / str(payload)
    if not path.exists() and path.name == str(payload) and (example / MANIFEST_NAME).is_file():
        path = example  # a bare name that is no folder here: a shipped example
    if path.is_dir():
        path = path / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(
            f"No payload manifest at {path}.",
            f"Point to a payload folder that holds a `{MANIFEST_NAME}`, or name a shipped "
            "example (`orchestrator examples` lists them; `orchestrator new NAME` makes one).",
        )
    try:
        text = decode_utf8(path.read_bytes())
    except ValueError as exc:
        raise ManifestError(f"{path}: {exc}.", "Save the file as UTF-8.") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{path}: not valid TOML ({exc}).", "Fix the syntax.") from exc
    return _parse(path, data, allowed_requirements)


def decode_utf8(data: bytes) -> str:
    """A user's file as text (a leading byte-order mark dropped). Raises ValueError naming
    the line and column of the first byte that is not UTF-8, for an error message.

    Shared by every reader of a user's file (manifest, schedules, `.env`)."""
    data = data.removeprefix(b"\xef\xbb\xbf")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line_start = data.rfind(b"\n", 0, exc.start) + 1
        line = data.count(b"\n", 0, exc.start) + 1
        column = len(data[line_start : exc.start].decode()) + 1  # characters, as editors count
        raise ValueError(
            f"line {line}, column {column}: byte 0x{data[exc.start]:02x} is not valid UTF-8"
        ) from None


def _parse(path: Path, data: dict[str, Any], allowed_requirements: Collection[str]) -> Manifest:
    def fail(field_name: str, problem: str, allowed: str) -> ManifestError:
        return ManifestError(f"{path}: field `{field_name}` {problem}.", allowed)

    for section, value in data.items():
        if section not in _ALLOWED:
            raise fail(section, "is not a known section", f"Allowed sections: {sorted(_ALLOWED)}.")
        if not isinstance(value, dict):
            raise fail(section, "must be a table", f"Write it as `[{section}]`.")
        for key in value:
            if key not in _ALLOWED[section]:
                raise fail(
                    f"{section}.{key}", "is not a known field",
                    f"Allowed in [{section}]: {sorted(_ALLOWED[section])}.",
                )  # fmt: skip

    def get(section: str, key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        value = data.get(section, {}).get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
            raise fail(f"{section}.{key}", f"must be {_kind_name(kind)}, not a boolean", "")
        if not isinstance(value, kind):
            raise fail(
                f"{section}.{key}", f"must be {_kind_name(kind)}, got {type(value).__name__}",
                "Fix its type.",
            )  # fmt: skip
        return value

    def str_list(section: str, key: str, pattern: re.Pattern[str] | None, what: str) -> tuple:
        values = get(section, key, list, [])
        for item in values:
            if not isinstance(item, str) or (pattern and not pattern.match(item)):
                raise fail(
                    f"{section}.{key}", f"has an invalid entry {item!r}", f"Each must be {what}."
                )
        return tuple(values)

    name = get("payload", "name", str)
    if not name or not _NAME_RE.match(name):
        raise fail(
            "payload.name", f"is {name!r}", "It is required: lowercase letters, digits, _ and -."
        )
    entrypoint = get("payload", "entrypoint", str)
    if not entrypoint or not ENTRYPOINT_RE.match(entrypoint):
        raise fail(
            "payload.entrypoint", f"is {entrypoint!r}",
            "It is required, as `module:function` (a function in the payload folder that takes "
            "the model and returns the manager agent).",
        )  # fmt: skip
    module_file = path.parent / (entrypoint.split(":")[0].replace(".", "/") + ".py")
    if not module_file.is_file():
        raise fail(
            "payload.entrypoint", f"names a module with no file {module_file}", "Fix the name."
        )

    limits_data = data.get("limits", {})
    for key, value in limits_data.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise fail(f"limits.{key}", f"must be a number, got {value!r}", "Fix its type.")
        if SETTABLE_LIMITS.get(key) is int and not isinstance(value, int):
            raise fail(f"limits.{key}", f"must be a whole number, got {value!r}", "Fix its type.")
    limits = Limits(**limits_data)
    limits.validate(str(path))

    scripts = get("mock", "scripts", dict, {})
    for agent, turns in scripts.items():
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise fail(
                f"mock.scripts.{agent}", "must be a list of strings", "One model output each."
            )

    hosts = str_list("network", "hosts", None, "a host name")
    for host in hosts:
        problem = check_host_name(host)
        if problem:
            raise fail("network.hosts", f"has an entry {host!r} that {problem}", HOST_NAME_HELP)

    requirements = []
    for item in str_list("python", "requirements", None, "a pip requirement string"):
        problem = check_requirement(item, allowed_requirements)
        if problem:
            raise fail(
                "python.requirements", f"has an entry {item!r} that {problem}", REQUIREMENT_HELP
            )
        # Passed only because the run named it: carry the mark to the image build.
        requirements.append(AllowedRequirement(item) if check_requirement(item) else item)

    backend = get("payload", "backend", str)
    if backend is not None and backend not in backend_names():
        names = ", ".join(backend_names())
        raise fail("payload.backend", f"is {backend!r}", f"Use one of {names}.")

    return Manifest(
        path=path,
        name=name,
        entrypoint=entrypoint,
        description=get("payload", "description", str, "") or "",
        example_task=get("payload", "example_task", str),
        example_answer=get("payload", "example_answer", str),
        requirements=tuple(requirements),
        authorized_imports=str_list("python", "authorized_imports", MODULE_RE, "a module name"),
        secrets=str_list("secrets", "required", ENV_NAME_RE, "an environment variable name"),
        hosts=tuple(h.lower() for h in hosts),
        limits=limits,
        mock_scripts={k: list(v) for k, v in scripts.items()},
        backend=backend,
    )


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {str: "a string", list: "a list", dict: "a table", int: "an integer", float: "a number"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)
