"""The labels on everything the orchestrator makes, and who owns it.

Every container, network and image carries them, so any later command can find what a
dead owner left (`cleanup`) and tell a live owner from a dead one.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from .paths import VERSION, home_dir

LABEL_RUN_ID = "orchestrator.run-id"


LABEL_VERSION = "orchestrator.version"


LABEL_STORE = "orchestrator.store"


LABEL_OWNER = "orchestrator.owner"  # "<hostname>:<pid>:<process start time>"


LABEL_WARM = "orchestrator.warm"  # "true" on a sandbox started before its run took it


LABEL_KIND = "orchestrator.kind"  # "sandbox", "egress", "agent-image", "payload-image"


def run_labels(run_id: str) -> dict[str, str]:

    return {
        LABEL_RUN_ID: run_id,
        LABEL_VERSION: VERSION,
        LABEL_STORE: store_id(home_dir()),
        LABEL_OWNER: owner_label(),
    }


def store_id(root: Path) -> str:
    import hashlib

    return hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]


def owner_label() -> str:
    """`host:pid:start` of this process, so cleanup can tell a live owner from a dead one."""
    return f"{socket.gethostname()}:{os.getpid()}:{process_start_time(os.getpid())}"


def process_start_time(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "?"
    return stat.rsplit(")", 1)[1].split()[19]  # field 22: start time in clock ticks


def owner_alive(owner: str) -> bool:
    """True when the process named by an owner label still runs on this host.

    Owners on other hosts are treated as alive: we cannot see them, so we leave them alone.
    """
    try:
        host, pid_text, started = owner.split(":")
        pid = int(pid_text)
    except ValueError:
        return False
    if host != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return process_start_time(pid) == started


#: Under the state directory: one file per live pool, holding its owner label, so that the
#: next command can remove the warm sandboxes of a pool whose process died (`cleanup.tidy`).
POOLS_DIR = "pools"


def pool_marker(root: Path) -> Path:
    """This process's pool marker under the state directory `root` (not created)."""
    return root / POOLS_DIR / f"{os.getpid()}-{process_start_time(os.getpid())}.owner"
