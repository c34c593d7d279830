"""Where and when a benchmark was measured: the header of its results file.

A figure means little without the machine, the engine, the commit and the load it was taken
under (the development machines are small and shared), so every benchmark in this folder
records the same header, built here, and the same one-line summary of it in its .md file.
Not a benchmark itself: it writes no result, so the performance page lists none for it.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def load() -> float:
    """The 1-minute load average, rounded: taken before (and after) each part, so that a
    busy machine shows beside the figures it slowed."""
    return round(os.getloadavg()[0], 2)


def commit() -> str:
    """The short hash of the commit measured (empty outside a git checkout)."""
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()


def header(client: Any = None) -> dict[str, Any]:
    """cpus, machine, docker and storage (the engine's version and storage driver, with a
    Docker SDK `client`), commit and date (UTC, so results from machines in other zones
    sort and compare as they are)."""
    found: dict[str, Any] = {"cpus": os.cpu_count(), "machine": platform.platform()}
    if client is not None:
        found["docker"] = client.version().get("Version")
        # fuse-overlayfs costs each container's file access a user-space round trip: the
        # same run measures about a fifth slower on it than on overlay2.
        found["storage"] = client.info().get("Driver")
    found["commit"] = commit()
    found["date"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return found


def summary(report: dict[str, Any], *, started: bool = False) -> str:
    """The header's line for the .md file: `4 CPUs; Docker 27.3.1 (overlay2); commit
    abc1234; <date>` (the docs' performance page reads the CPUs and the date from it).
    `started`: the date is when the run began, for reports rewritten as they go."""
    parts = [f"{report['cpus']} CPUs"]
    if "docker" in report:
        storage = f" ({report['storage']})" if report.get("storage") else ""
        parts.append(f"Docker {report['docker']}{storage}")
    parts.append(f"commit {report['commit']}")
    parts.append(f"started {report['date']}" if started else report["date"])
    return "; ".join(parts)
