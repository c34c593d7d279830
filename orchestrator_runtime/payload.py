"""The payload inside the sandbox: its files written under a fresh folder (first on
`sys.path`), and a payload's entrypoint imported and called with the model."""

from __future__ import annotations

import base64
import importlib
import os
import shutil
import sys
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class PayloadError(Exception):
    """The payload's files could not be written, imported or turned into an agent."""


@contextmanager
def payload_root() -> Iterator[Path]:
    """A fresh folder for the payload's files (under $TMPDIR, the sandbox's tmpfs); when the
    run is over the working directory leaves it and it is removed."""
    root = Path(tempfile.mkdtemp(prefix="orchestrator-payload-")).resolve()
    try:
        yield root
    finally:
        os.chdir("/")
        shutil.rmtree(root, ignore_errors=True)


def write_payload(root: Path, files: dict[str, Any]) -> None:
    """Write the payload under `root` (a fresh temporary directory), first on sys.path.

    Each file is text (UTF-8) or {"base64": ...} for bytes that are not (docs/PROTOCOL.md)."""
    for name, content in files.items():
        target = (root / name).resolve()
        if not name or "\\" in name or "\0" in name or root not in target.parents:
            raise PayloadError(f"payload file name {name!r} points outside the payload folder")
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            target.write_bytes(content.encode("utf-8"))
        else:
            try:
                target.write_bytes(base64.b64decode(content["base64"], validate=True))
            except ValueError as exc:
                raise PayloadError(f"payload file {name!r} is not valid base64") from exc
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()


def load_manager(entrypoint: str, root: Path, model: Any) -> Any:
    """Import `module:function` from the payload and call it with the model."""
    from smolagents.agents import MultiStepAgent

    module_name, function_name = entrypoint.split(":")
    loaded = sys.modules.get(module_name.split(".")[0])
    if loaded is not None and root not in Path(getattr(loaded, "__file__", None) or "/").parents:
        raise PayloadError(f"payload module {module_name!r} would shadow the installed module")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise missing_module(exc, root) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise PayloadError(
            f"entrypoint {entrypoint!r}: {module_name} has no function {function_name}"
        )
    manager = function(model)
    if not isinstance(manager, MultiStepAgent):
        raise PayloadError(
            f"entrypoint {entrypoint!r} returned {type(manager).__name__}, not a smolagents agent"
        )
    return manager


def missing_module(exc: ModuleNotFoundError, root: Path) -> Exception:
    """A payload's import of a module the image does not have, said with where it is and what
    to do (the image is built from the manifest's requirements); `exc` itself when the
    missing module is the payload's own (its message then says it all)."""
    own = exc.name is not None and (root / exc.name.split(".")[0]).with_suffix(".py").exists()
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).is_relative_to(root)
    ]
    if own or exc.name is None or not frames:
        return exc
    where = f"{Path(frames[-1].filename).relative_to(root)}, line {frames[-1].lineno}"
    package = exc.name.split(".")[0]
    return PayloadError(
        f"{where}: `import {exc.name}`, but the sandbox's image has no module {package!r}. "
        f"Add its package to `[python] requirements` in manifest.toml (the image is built "
        f"with them), or remove the import"
    )
