"""What a person types to name a run or a batch: the one run a RUN names (`Store.find_runs`
takes ids, their parts and `@latest`), or why not (several, listed; none, with the nearest
ids as a "did you mean"); a batch named by its output folder or part of its id."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from ..errors import OrchestratorError
from .store import LATEST, Store


def resolve_run(store: Store, ref: str) -> dict[str, Any]:
    """The one run `ref` names (see `Store.find_runs`), or OrchestratorError (exit 2) that
    says why not: no run (with the nearest ids, if any is close), or several (listing them)."""
    rows = store.find_runs(ref, limit=6)
    if len(rows) == 1:
        return rows[0]
    if not rows:
        if ref == LATEST:
            raise OrchestratorError(
                f"There is no run in this store ({store.root}) yet, so no {LATEST}.",
                "Start one with `orchestrator run PAYLOAD`.",
            )
        near = nearest_runs(store, ref)
        hint = f" Did you mean {' or '.join(near)}?" if near else ""
        raise OrchestratorError(
            f"No run {ref!r} in this store ({store.root}).{hint}",
            "List runs with `orchestrator runs list`; a run id, a unique prefix or suffix of "
            f"one, the start of its random tail, or {LATEST} names a run.",
        )
    shown = ", ".join(r["run_id"] for r in rows[:5]) + (", ..." if len(rows) > 5 else "")
    raise OrchestratorError(
        f"Run id {ref!r} is ambiguous: it matches {shown}.",
        "Give more characters of the id (its random tail is unique).",
    )


def nearest_runs(store: Store, ref: str, *, among: int = 500) -> list[str]:
    """Ids of recent runs close to a mistyped `ref` (whole id or the start of a random
    tail), best first."""
    with store.connect(write=False) as db:
        ids = [
            r[0]
            for r in db.execute(
                "SELECT run_id FROM runs ORDER BY created_at DESC LIMIT ?", (among,)
            )
        ]
    by_tail = {run_id.rsplit("-", 1)[-1][: len(ref)]: run_id for run_id in reversed(ids)}
    close = difflib.get_close_matches(ref, [*ids, *by_tail], n=3, cutoff=0.75)
    return list(dict.fromkeys(by_tail.get(c) or c for c in close))


def find_batches(store: Store, ref: str) -> list[str]:
    """Batch ids of recorded runs that are `ref`, or start or end with it, newest first."""
    with store.connect(write=False) as db:
        rows = db.execute(
            "SELECT batch, MAX(created_at) AS latest FROM runs WHERE batch IS NOT NULL "
            "GROUP BY batch ORDER BY latest DESC"
        ).fetchall()
    ids = [str(r["batch"]) for r in rows]
    if ref in ids:
        return [ref]
    return [b for b in ids if b.startswith(ref) or b.endswith(ref)]


def resolve_batch(store: Store, ref: str) -> str:
    """The batch id `ref` names: a batch output folder (its batch.json), a batch id, or a
    unique prefix or suffix of one. Raises OrchestratorError (exit 2) for none or several."""
    meta = Path(ref) / "batch.json"
    if meta.is_file():
        try:
            return str(json.loads(meta.read_text())["batch_id"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise OrchestratorError(
                f"{meta} is not a batch's record ({exc}).",
                "Pass a batch output folder, or a batch id (`runs show RUN` names a run's).",
            ) from None
    found = find_batches(store, ref)
    if len(found) == 1:
        return found[0]
    if found:
        raise OrchestratorError(
            f"Batch {ref!r} is ambiguous: it matches {', '.join(found[:5])}.",
            "Give more characters of the batch id, or its output folder.",
        )
    near = difflib.get_close_matches(ref, find_batches(store, ""), n=3, cutoff=0.75)
    hint = f" Did you mean {' or '.join(near)}?" if near else ""
    raise OrchestratorError(
        f"No batch {ref!r}: no folder with a batch.json, and no run of a batch id like it.{hint}",
        "Pass a batch output folder (the --output of `orchestrator batch`), or a batch id "
        "(`orchestrator runs show RUN` names a run's batch).",
    )
