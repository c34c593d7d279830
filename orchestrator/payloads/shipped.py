"""What the host ships into a sandbox besides the request's settings: the payload folder's
regular files, byte-exact, and the task text, each within a limit.

The folder is untrusted input. Only regular files inside it go in: a symlink is followed only
to a regular file that is itself inside the folder (and shipped as a copy); a symlink that
leaves the folder, a symlinked folder, a device, FIFO or socket is refused before anything
starts, naming the file. Hidden files and `__pycache__` stay behind. Text that is valid UTF-8
travels as text, anything else as base64 (docs/PROTOCOL.md), so binary data arrives intact.
"""

from __future__ import annotations

import base64
import os
import stat
from pathlib import Path

from ..errors import ConfigError, ManifestError

#: Limits on what a payload ships (environment variables override them).
MAX_PAYLOAD_MB_ENV = "ORCHESTRATOR_MAX_PAYLOAD_MB"
MAX_PAYLOAD_FILES_ENV = "ORCHESTRATOR_MAX_PAYLOAD_FILES"
DEFAULT_MAX_PAYLOAD_MB = 5
DEFAULT_MAX_PAYLOAD_FILES = 500
MAX_TASK_KB_ENV = "ORCHESTRATOR_MAX_TASK_KB"
DEFAULT_MAX_TASK_KB = 1024

#: Folders read lately, by path: (what their entries looked like, what was read).
_READ: dict[Path, tuple[tuple[object, ...], dict[str, ShippedFile]]] = {}
MAX_CACHED_FOLDERS = 8

#: A shipped file: its text, or {"base64": ...} for bytes that are not UTF-8.
ShippedFile = str | dict[str, str]


def limit_from_env(name: str, default: int) -> int:
    """A positive whole number from the environment, else `default`; anything else is
    refused (ManifestError naming the variable)."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ManifestError(
            f"${name} = {raw!r} is not a positive whole number.", "Fix or unset it."
        )
    return value


def payload_files(folder: Path) -> dict[str, ShippedFile]:
    """The payload's files as `{relative path: text or {"base64": ...}}`, ready to ship.

    Raises ManifestError naming the file for anything that is not a regular file inside the
    folder, and naming the limit when the folder holds too many files or bytes. A folder
    unchanged since the last call (same entries, sizes and times) is not read again: a batch
    prepares every task with the same payload."""
    root = folder.resolve()
    max_bytes = limit_from_env(MAX_PAYLOAD_MB_ENV, DEFAULT_MAX_PAYLOAD_MB) * 1024 * 1024
    max_files = limit_from_env(MAX_PAYLOAD_FILES_ENV, DEFAULT_MAX_PAYLOAD_FILES)
    paths = _walk(root)
    key = (max_bytes, max_files, tuple(_stamp(path) for path in paths))
    cached = _READ.get(root)
    if cached is not None and cached[0] == key:
        return dict(cached[1])
    files: dict[str, ShippedFile] = {}
    total = 0
    for path in paths:
        data = _read_regular(root, path)
        total += len(data)
        if len(files) + 1 > max_files:
            raise ManifestError(
                f"{folder}: the payload folder holds more than {max_files} files.",
                f"Keep data out of the payload folder, or raise ${MAX_PAYLOAD_FILES_ENV}.",
            )
        if total > max_bytes:
            raise ManifestError(
                f"{folder}: the payload folder holds more than {max_bytes // 2**20} MiB of files.",
                "Keep large data out of the payload folder (or install it as a requirement), "
                f"or raise ${MAX_PAYLOAD_MB_ENV}.",
            )
        files[path.relative_to(root).as_posix()] = _encoded(data)
    if len(_READ) >= MAX_CACHED_FOLDERS:
        _READ.clear()
    _READ[root] = (key, files)
    return dict(files)


def program_file(path: Path) -> dict[str, ShippedFile]:
    """A single-file program as `{its name: its text}`, within the same limits (ManifestError
    for a file that is not regular, or over the size limit)."""
    max_bytes = limit_from_env(MAX_PAYLOAD_MB_ENV, DEFAULT_MAX_PAYLOAD_MB) * 1024 * 1024
    data = _read_regular(path.parent.resolve(), path.parent.resolve() / path.name)
    if len(data) > max_bytes:
        raise ManifestError(
            f"{path}: the program is over {max_bytes // 2**20} MiB.",
            f"Keep large data out of the program, or raise ${MAX_PAYLOAD_MB_ENV}.",
        )
    return {path.name: _encoded(data)}


def _stamp(path: Path) -> tuple[object, ...]:
    """What changes when an entry changes: itself (a link re-made is another inode) and,
    for a link, what it points to."""
    link = os.lstat(path)
    try:
        target = os.stat(path)
    except OSError:  # a dangling link: `_read_regular` names it
        target = link
    return (
        str(path),
        link.st_ino,
        link.st_mtime_ns,
        target.st_ino,
        target.st_mode,
        target.st_size,
        target.st_mtime_ns,
    )


def check_task(task: str) -> None:
    """Refuse a task text over the limit (ConfigError naming it): it travels in the request
    and lives in the sandbox's memory."""
    max_kb = limit_from_env(MAX_TASK_KB_ENV, DEFAULT_MAX_TASK_KB)
    size = len(task.encode("utf-8"))
    if size > max_kb * 1024:
        raise ConfigError(
            f"The task is {size // 1024} KiB, over the limit of {max_kb} KiB.",
            f"Put large inputs in the payload folder instead, or raise ${MAX_TASK_KB_ENV}.",
        )


def _walk(root: Path) -> list[Path]:
    """Every entry under `root` that is shipped or refused, in a stable order; hidden files
    and `__pycache__` are left out. Symlinked folders are never entered."""
    found = []
    for directory, dirs, names in os.walk(root, followlinks=False):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for name in sorted(dirs):
            path = Path(directory) / name
            if path.is_symlink():
                raise ManifestError(
                    f"{path}: a symlinked folder in the payload folder.",
                    "Copy the folder's content into the payload folder instead; links are not "
                    "followed out of it.",
                )
        found += [Path(directory) / n for n in sorted(names) if not n.startswith(".")]
    return found


def _read_regular(root: Path, path: Path) -> bytes:
    """The content of `path` if it is (or links to) a regular file inside `root`."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        target = path.resolve()
        if root not in target.parents:
            raise ManifestError(
                f"{path}: a symlink that leaves the payload folder (to {target}).",
                "Remove it, or copy what it points to into the payload folder; nothing "
                "outside the folder is ever shipped into a sandbox.",
            )
        info = os.stat(target)
        path = target
    if not stat.S_ISREG(info.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(info.st_mode) else "a socket or device"
        raise ManifestError(
            f"{path}: {kind} in the payload folder.",
            "Only regular files can be shipped; remove it.",
        )
    return path.read_bytes()


def _encoded(data: bytes) -> ShippedFile:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(data).decode("ascii")}
