"""Find and remove what a dead orchestrator process left behind, and close its run records.

Two ways in:

- `tidy()`, which every command that opens a store calls first (run, batch, schedule run and
  serve, runs list/show/logs): runs whose owner process is gone are closed as `infra_error`
  of type `orphaned`, with a full record, and whatever they left (a container stopped by its
  deadline, or still running; an egress proxy; a network) is removed;
- `cleanup()` (`orchestrator cleanup`): everything labelled with a dead owner, of every kind
  (sandboxes, egress proxies and networks, image probes), then the same closing of records.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .backends import get_backend
from .backends.base import Backend, SandboxInfo
from .config import home_dir
from .errors import OrchestratorError
from .labels import (
    LABEL_OWNER,
    LABEL_RUN_ID,
    LABEL_STORE,
    LABEL_WARM,
    POOLS_DIR,
    owner_alive,
    store_id,
)
from .record import close_orphan
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
    """Remove what orchestrator processes that are gone left behind (all of it with `force`).

    By default only what belongs to this state directory is considered; `all_stores` widens
    that to everything of the orchestrator's on the engine.
    """
    store = store or Store()
    labels = {} if all_stores else {LABEL_STORE: store_id(home_dir())}
    removed: list[SandboxInfo] = []
    kept: list[SandboxInfo] = []
    for info in backend.list_sandboxes(labels):
        if LABEL_RUN_ID not in info.labels and LABEL_OWNER not in info.labels:
            continue
        if not force and owner_alive(info.labels.get(LABEL_OWNER, "")):
            kept.append(info)
            continue
        if not dry_run:
            backend.remove_sandbox(info)
        removed.append(info)
    report = CleanupReport(removed=removed, kept=kept, closed_runs=[])
    if not dry_run:
        report.closed_runs = close_orphaned_runs(store, backends={backend.name: backend})
    return report


def tidy(store: Store | None = None, *, warn: Callable[[str], None] | None = None) -> list[str]:
    """Close the runs of this store whose owner process died; returns their ids.

    Cheap when there are none (one index query). Never raises: a command goes on even when
    the engine cannot be reached (the records are closed anyway, and `warn` says why the
    leftovers could not be removed).
    """
    try:
        return close_orphaned_runs(store or Store(), warn=warn)
    except Exception as exc:  # tidying must never stop the command the user asked for
        if warn is not None:
            warn(f"could not close orphaned runs: {exc}")
        return []


def closed_line(run_id: str) -> str:
    """How a command tells the user it closed someone else's orphaned run."""
    return (
        f"closed run {run_id} as infra_error (orphaned): its orchestrator process died; "
        "what it left was removed"
    )


def close_orphaned_runs(
    store: Store,
    *,
    backends: dict[str, Backend] | None = None,
    warn: Callable[[str], None] | None = None,
) -> list[str]:
    """Close runs whose owner died before recording an end, removing what each left."""
    orphans = [r for r in store.unfinished_runs() if not owner_alive(r.get("owner") or "")]
    found = dict(backends or {})
    closed = []
    for row in orphans:
        name = row.get("backend") or "docker"
        backend = _backend_for(name, found, warn)
        ended = _remove_leftovers(row["run_id"], backend) if backend else {}
        if backend is not None:
            where = "what it left was removed"
        elif name == "e2b":
            where = (
                "its E2B sandbox ends with its E2B lifetime (`orchestrator cleanup --backend "
                "e2b` ends it sooner)"
            )
        else:
            where = "the engine could not be reached to remove what it left"
        message = f"the orchestrator process ({row.get('owner')}) died during the run; {where}"
        if close_orphan(store, row, message=message, **ended) is not None:
            closed.append(row["run_id"])
    reap_dead_pools(store, found, warn)
    return closed


def reap_dead_pools(
    store: Store, found: dict[str, Backend | None], warn: Callable[[str], None] | None = None
) -> None:
    """Remove the warm sandboxes of pools whose process died (their markers say whose);
    one directory listing when there are none."""
    folder = store.root / POOLS_DIR
    if not folder.is_dir():
        return
    for marker in folder.glob("*.owner"):
        try:
            owner = marker.read_text().strip()
        except OSError:
            continue
        if owner_alive(owner):
            continue
        backend = _backend_for("docker", found, warn)
        if backend is None:
            return
        with contextlib.suppress(Exception):  # gone already, or the engine hiccuped
            for info in backend.list_sandboxes({LABEL_OWNER: owner, LABEL_WARM: "true"}):
                backend.remove_sandbox(info)
            marker.unlink(missing_ok=True)


def _backend_for(
    name: str, found: dict[str, Backend | None], warn: Callable[[str], None] | None
) -> Backend | None:
    """The backend to remove an orphan's leftovers with: the one given, else Docker's (local,
    cheap); never E2B's on its own (its sandboxes end with their E2B lifetime)."""
    if name not in found:
        found[name] = None
        if name == "docker":
            try:
                found[name] = get_backend(name)
            except OrchestratorError as exc:
                if warn is not None:
                    warn(f"orphaned runs closed without removing their containers: {exc.cause}")
    return found[name]


def _remove_leftovers(run_id: str, backend: Backend) -> dict[str, Any]:
    """Remove everything of one run; how its sandbox ended, as the engine recorded it."""
    ended: dict[str, Any] = {}
    with contextlib.suppress(Exception):  # gone already, or the engine hiccuped
        for info in backend.list_sandboxes({LABEL_RUN_ID: run_id}):
            if info.kind == "sandbox" and info.finished_at is not None:
                ended = {
                    "exit_code": info.exit_code,
                    "oom_killed": info.oom_killed,
                    "started_at": info.started_at,
                    "finished_at": info.finished_at,
                }
            backend.remove_sandbox(info)
    return ended
