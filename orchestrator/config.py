"""Where the orchestrator keeps its state, and the version stamped on everything it makes."""

from __future__ import annotations

import os
from pathlib import Path

VERSION = "0.1.0"


def home_dir() -> Path:
    """State directory: `$ORCHESTRATOR_HOME`, else `~/.orchestrator`. Created on demand."""
    path = Path(os.environ.get("ORCHESTRATOR_HOME") or Path.home() / ".orchestrator")
    path.mkdir(parents=True, exist_ok=True)
    return path


def repo_root() -> Path:
    """The folder holding `images/` and `agent_payloads/` (the source checkout)."""
    return Path(__file__).resolve().parent.parent
