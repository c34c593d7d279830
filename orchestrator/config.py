"""Where the orchestrator keeps its state, and the version stamped on everything it makes."""

from __future__ import annotations

import os
from pathlib import Path

VERSION = "0.1.0"

#: Label keys put on every container, network and image the orchestrator creates.
LABEL_PREFIX = "orchestrator"
LABEL_RUN_ID = "orchestrator.run-id"
LABEL_VERSION = "orchestrator.version"
LABEL_STORE = "orchestrator.store"
LABEL_OWNER = "orchestrator.owner"  # "<hostname>:<pid>:<process start time>"
LABEL_KIND = "orchestrator.kind"  # "sandbox", "egress", "agent-image", "payload-image"


def home_dir() -> Path:
    """State directory: `$ORCHESTRATOR_HOME`, else `~/.orchestrator`. Created on demand."""
    path = Path(os.environ.get("ORCHESTRATOR_HOME") or Path.home() / ".orchestrator")
    path.mkdir(parents=True, exist_ok=True)
    return path


def repo_root() -> Path:
    """The folder holding `images/` and `agent_payloads/` (the source checkout)."""
    return Path(__file__).resolve().parent.parent
