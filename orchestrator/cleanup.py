"""Find and remove what a crashed orchestrator left behind, and close its run records."""

from __future__ import annotations

import time
from dataclasses import dataclass

from .backends.base import Backend, SandboxInfo
from .config import home_dir
from .labels import LABEL_OWNER, LABEL_RUN_ID, LABEL_STORE, owner_alive, store_id
from .store import Store


@dataclass
class CleanupReport:
    removed: list[SandboxInfo]
    kept: list[SandboxInfo]
    closed_runs: list[str]


def cleanup(
    backend: Backend,
    *,
    store: Store | None = None,
    all_stores: bool = False,
    force: bool = False,
    dry_run: bool = False,
) -> CleanupReport:
    """Remove sandboxes whose orchestrator process is gone (all of them with `force`).

    By default only sandboxes of this state directory are considered; `all_stores` widens
    that to every orchestrator sandbox on the engine.
    """
    store = store or Store()
    labels = {} if all_stores else {LABEL_STORE: store_id(home_dir())}
    removed: list[SandboxInfo] = []
    kept: list[SandboxInfo] = []
    for info in backend.list_sandboxes(labels):
        if LABEL_RUN_ID not in info.labels:
            continue
        if not force and owner_alive(info.labels.get(LABEL_OWNER, "")):
            kept.append(info)
            continue
        if not dry_run:
            backend.remove_sandbox(info)
        removed.append(info)
    closed = [] if dry_run else close_orphaned_runs(store)
    return CleanupReport(removed=removed, kept=kept, closed_runs=closed)


def close_orphaned_runs(store: Store) -> list[str]:
    """Mark runs whose owner died before recording an end as `infra_error`."""
    closed = []
    for row in store.unfinished_runs():
        if owner_alive(row.get("owner") or ""):
            continue
        store.update_run(
            row["run_id"],
            status="infra_error",
            ended_at=time.time(),
            error="orphaned: the orchestrator process died during the run (cleaned up)",
        )
        closed.append(row["run_id"])
    return closed
