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
    """The folder holding the `orchestrator` package (in a source checkout, the checkout)."""
    return Path(__file__).resolve().parent.parent


def data_root() -> Path:
    """The folder holding `images/` and `agent_payloads/`: the package's `share/` once
    installed from a wheel (setup.py copies them there), else the source checkout."""
    installed = Path(__file__).resolve().parent / "share"
    return installed if (installed / "images").is_dir() else repo_root()


def examples_dir() -> Path:
    """The shipped example payloads."""
    return data_root() / "agent_payloads"
