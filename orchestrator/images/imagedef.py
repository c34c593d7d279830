"""The agent image's definition, backend-neutral: its files, the runtime, content hashes.

Both the Docker image and the E2B template are made from these same inputs, so a change to
any of them changes both names (everything is content-addressed).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, ImageBuildError
from ..paths import data_root, home_dir, repo_root
from ..policy import REQUIREMENT_HELP, AllowedRequirement, check_requirement

log = logging.getLogger(__name__)

#: Where lines of text for the user go, one at a time: a run's progress (`progress`,
#: `on_progress`), what a batch, pool or executor says as it goes (`message`, `on_message`),
#: a cleanup's warnings (`warn`), a scheduler's log lines (`log`). The one type of every such
#: callback (docs/ARCHITECTURE.md, Glossary), which `backends.base` hands on to backends.
Progress = Callable[[str], None]


#: The base on ordinary machines.
DEFAULT_BASE = "python:3.12-slim"


BASE_IMAGE_ENV = "ORCHESTRATOR_BASE_IMAGE"


#: Where the image definitions and the runtime live (read at call time, so tests can patch).
AGENT_IMAGE_DIR = data_root() / "images" / "agent"


RUNTIME_DIR = repo_root() / "orchestrator_runtime"


#: Build output lines quoted in an ImageBuildError.
ERROR_TAIL_LINES = 25


#: Progress lines that quote a build tool's own output, or repeat a notice already given: a
#: person needs them only when asking (`-v`); an ImageBuildError quotes the tail anyway.
DETAIL_PREFIXES = ("pip: ", "build: ", "e2b build: ", "debootstrap: ", "note: ")


def is_detail(message: str) -> bool:
    return message.startswith(DETAIL_PREFIXES)


def report(progress: Progress | None, message: str) -> None:
    log.info("%s", message)
    if progress is not None:
        progress(message)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digest(obj: Any) -> str:
    """A stable hash of a JSON-able value."""
    return sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


def write_json(path: Path, data: Any) -> None:
    """Write atomically (temp file + rename), so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def images_state_dir() -> Path:
    path = home_dir() / "images"
    path.mkdir(parents=True, exist_ok=True)
    return path


def build_lock(content_hash: str) -> Any:
    """A file lock held while an image with this content hash is built, so that concurrent
    orchestrators build it once. filelock is imported here, when a build may happen, not by
    every run that finds its image ready."""
    from filelock import FileLock

    return FileLock(str(images_state_dir() / f".build-{content_hash[:16]}.lock"))


@dataclass
class CommandOutput:
    returncode: int
    lines: list[str]


def run_streaming(command: list[str], progress: Progress | None, *, prefix: str) -> CommandOutput:
    """Run a command, passing each output line to `progress`; keeps the last lines.

    If `progress` raises (the run was cancelled), the command is killed first."""
    tail: deque[str] = deque(maxlen=ERROR_TAIL_LINES)
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    ) as proc:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                line = line.rstrip()
                if line:
                    tail.append(line)
                    if progress is not None:
                        progress(prefix + line)
        except BaseException:
            proc.kill()
            raise
    return CommandOutput(proc.returncode, list(tail))


def requirement_lines(text: str) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line]


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


def normalize_requirements(requirements: Iterable[str]) -> tuple[str, ...]:
    """Sorted, de-duplicated requirement lines, each a package specification.

    The last check before the host's pip sees them (`policy.check_requirement`): pip options,
    URLs and paths are refused; a `name @ URL` reference only passes as the
    `policy.AllowedRequirement` that `load_manifest` makes of an entry the run allowed by name.
    """
    lines: set[str] = set()
    for item in requirements:
        allowed = (item,) if isinstance(item, AllowedRequirement) else ()
        for line in requirement_lines(item):
            problem = check_requirement(line, allowed)
            if problem:
                raise ConfigError(f"Extra requirement {line!r} {problem}.", REQUIREMENT_HELP)
            lines.add(" ".join(line.split()))
    return tuple(sorted(lines))
