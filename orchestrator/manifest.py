"""Payload manifests: load `manifest.toml`, validate every field, and refuse what is unsafe."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator_runtime.protocol import is_dangerous_import

from .errors import ManifestError
from .policy import HOST_NAME_RE
from .spec import BACKENDS, SETTABLE_LIMITS, Limits

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

MANIFEST_NAME = "manifest.toml"


#: Files shipped into the sandbox with a payload: code and small data, nothing else.
PAYLOAD_SUFFIXES = frozenset({".py", ".json", ".csv", ".txt", ".md", ".toml", ".yaml", ".yml"})


MAX_PAYLOAD_BYTES = 5 * 1024 * 1024


_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


_ENTRYPOINT_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


_MODULE_RE = re.compile(r"^(\*|[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(\.\*)?)$")


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

    def payload_files(self) -> dict[str, str]:
        """The payload's code and data as `{relative path: text}`, ready to ship in."""
        files: dict[str, str] = {}
        total = 0
        for file in sorted(self.folder.rglob("*")):
            rel = file.relative_to(self.folder)
            if not file.is_file() or file.suffix not in PAYLOAD_SUFFIXES:
                continue
            if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                continue
            text = file.read_text(encoding="utf-8")
            total += len(text.encode())
            if total > MAX_PAYLOAD_BYTES:
                raise ManifestError(
                    f"{self.path}: the payload folder holds more than "
                    f"{MAX_PAYLOAD_BYTES // 1024 // 1024} MiB of files.",
                    "Keep large data out of the payload folder (or bake it into a requirement).",
                )
            files[rel.as_posix()] = text
        return files


def load_manifest(payload: str | Path) -> Manifest:
    """Load and validate the manifest of a payload folder (or a manifest file path)."""
    path = Path(payload)
    if path.is_dir():
        path = path / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(
            f"No payload manifest at {path}.",
            f"Point to a payload folder that holds a `{MANIFEST_NAME}` "
            "(see agent_payloads/ for examples).",
        )
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{path}: not valid TOML ({exc}).", "Fix the syntax.") from exc
    return _parse(path, data)


def _parse(path: Path, data: dict[str, Any]) -> Manifest:
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
    if not entrypoint or not _ENTRYPOINT_RE.match(entrypoint):
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
        if not HOST_NAME_RE.match(host.lower()):
            raise fail(
                "network.hosts", f"has an invalid host {host!r}",
                "Use exact names (api.example.com) or one leading wildcard (*.example.com); "
                "no schemes, ports, paths or IP addresses.",
            )  # fmt: skip

    backend = get("payload", "backend", str)
    if backend is not None and backend not in BACKENDS:
        raise fail("payload.backend", f"is {backend!r}", f"Use one of {', '.join(BACKENDS)}.")

    return Manifest(
        path=path,
        name=name,
        entrypoint=entrypoint,
        description=get("payload", "description", str, "") or "",
        example_task=get("payload", "example_task", str),
        example_answer=get("payload", "example_answer", str),
        requirements=str_list("python", "requirements", None, "a pip requirement string"),
        authorized_imports=str_list("python", "authorized_imports", _MODULE_RE, "a module name"),
        secrets=str_list("secrets", "required", _ENV_RE, "an environment variable name"),
        hosts=tuple(h.lower() for h in hosts),
        limits=limits,
        mock_scripts={k: list(v) for k, v in scripts.items()},
        backend=backend,
    )


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {str: "a string", list: "a list", dict: "a table", int: "an integer", float: "a number"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)
