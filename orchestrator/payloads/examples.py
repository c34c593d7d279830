"""The example payloads shipped with the orchestrator (`agent_payloads/`, package data once
installed): what `orchestrator examples` lists and what a bare name like `research_team`
names when no folder of that name is here (`manifest.load_manifest`)."""

from __future__ import annotations

from typing import Any

from ..errors import OrchestratorError
from ..paths import examples_dir
from .manifest import MANIFEST_NAME, load_manifest


def list_examples() -> list[dict[str, Any]]:
    """Each shipped example: name, description, path, example task and answer."""
    root = examples_dir()
    found: list[dict[str, Any]] = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        if not (folder / MANIFEST_NAME).is_file():
            continue
        try:
            manifest = load_manifest(folder)
        except OrchestratorError as exc:  # a broken example is listed, not hidden
            found.append({"name": folder.name, "path": str(folder), "error": exc.cause})
            continue
        found.append(
            {
                "name": folder.name,
                "description": manifest.description,
                "path": str(folder),
                "example_task": manifest.example_task,
                "example_answer": manifest.example_answer,
            }
        )
    return found
