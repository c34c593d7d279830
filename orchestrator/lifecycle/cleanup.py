"""Find and remove what a dead orchestrator process left behind, and close its run records.

Two ways in:

- `tidy()`, which every command that opens a store calls first (run, batch, schedule run and
  serve, runs list/show/logs): runs whose owner process is gone are closed as `infra_error`
  of type `orphaned`, with a full record, and whatever they left (a container stopped by its
  deadline, or still running; an egress proxy; a network) is removed by their backend when it
  says it may be (`Capabilities.removes_orphans`: local and cheap), as are the idle sandboxes
  of dead pools (`WarmSandboxes.remove_idle`, on each backend with warm sandboxes);
- `cleanup()` (`orchestrator cleanup`): everything labelled with a dead owner, of every kind
  (sandboxes, egress proxies and networks, image probes), then the same closing of records.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from ..backends import backend_capabilities, backend_class, get_backend
from ..backends.base import Backend, Progress, SandboxInfo, WarmSandboxes
from ..errors import OrchestratorError
from ..labels import LABEL_OWNER, LABEL_RUN_ID, LABEL_STORE, POOLS_DIR, owner_alive, store_id
from ..paths import home_dir
from ..records.record import close_orphan
from ..records.store import Store
from ..registry import DEFAULT_BACKEND, backend_names
from .outcome import orphaned


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


def tidy(store: Store | None = None, *, warn: Progress | None = None) -> list[str]:
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


#: The backends a tidy-up has made so far, by name; or why one is not used (a sentence for
#: the record of each run it leaves alone).
Found = dict[str, Backend | str]


def close_orphaned_runs(
    store: Store,
    *,
    backends: dict[str, Backend] | None = None,
    warn: Progress | None = None,
) -> list[str]:
    """Close runs whose owner died before recording an end, removing what each left through
    its backend (one of `backends`, else one made here when it allows that on its own)."""
    orphans = [r for r in store.unfinished_runs() if not owner_alive(r.get("owner") or "")]
    found: Found = dict(backends or {})
    closed = []
    for row in orphans:
        backend = _backend_for(row.get("backend") or DEFAULT_BACKEND, found, warn)
        if isinstance(backend, str):
            ended, where = {}, backend
        else:
            ended, where = _remove_leftovers(row["run_id"], backend), "what it left was removed"
        message = f"the orchestrator process ({row.get('owner')}) died during the run; {where}"
        if close_orphan(store, row, orphaned(row, message, **ended)) is not None:
            closed.append(row["run_id"])
    reap_dead_pools(store, found, warn)
    return closed


def reap_dead_pools(store: Store, found: Found, warn: Progress | None = None) -> None:
    """Remove the warm sandboxes of pools whose process died (their markers say whose),
    through every backend that has warm sandboxes and may be used on its own; one directory
    listing when there are none."""
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
        backends = [b for b in _pool_backends(found, warn) if isinstance(b, WarmSandboxes)]
        if not backends:
            return
        with contextlib.suppress(Exception):  # gone already, or the engine hiccuped
            for backend in backends:
                backend.remove_idle(owner)
            marker.unlink(missing_ok=True)


def _pool_backends(found: Found, warn: Progress | None) -> list[Backend | str]:
    """The backends that may hold a dead pool's sandboxes: those with warm sandboxes."""
    pooled = []
    for name in backend_names():
        try:
            warm = issubclass(backend_class(name), WarmSandboxes)
        except OrchestratorError:
            continue  # not loadable here: it made no pool here either
        if warm:
            pooled.append(_backend_for(name, found, warn))
    return pooled


def _backend_for(name: str, found: Found, warn: Progress | None) -> Backend | str:
    """The backend to remove an orphan's leftovers with: the one given, else one made here if
    it says that is local and cheap (`Capabilities.removes_orphans`); else why not."""
    if name not in found:
        try:
            capabilities = backend_capabilities(name)
        except OrchestratorError as exc:
            found[name] = f"what it left could not be removed: {exc.cause}"
            return found[name]
        if not capabilities.removes_orphans:
            found[name] = (
                f"{capabilities.orphans_end} (`orchestrator cleanup --backend {name}` ends it "
                "sooner)"
            )
            return found[name]
        try:
            found[name] = get_backend(name)
        except OrchestratorError as exc:
            found[name] = "the engine could not be reached to remove what it left"
            if warn is not None:
                warn(f"orphaned runs closed without removing their containers: {exc.cause}")
    return found[name]


def _remove_leftovers(run_id: str, backend: Backend) -> dict[str, Any]:
    """Remove everything of one run; how its sandbox ended, as the engine recorded it."""
    try:
        info = backend.remove_run(run_id)
    except Exception:  # the engine hiccuped: the record is closed all the same
        return {}
    if info is None or info.finished_at is None:
        return {}
    return {
        "exit_code": info.exit_code,
        "oom_killed": info.oom_killed,
        "started_at": info.started_at,
        "finished_at": info.finished_at,
    }
