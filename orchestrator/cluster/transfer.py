"""Run records crossing the cluster: a node packs the record it wrote to its own state
directory, the driver writes it whole into its store; an attempt whose node was lost gets a
record of its own in the driver's store, naming the node, and so does one cancelled before a
node took it.

An attempt is finished only once its record is in the driver's store: the files are written
to a hidden folder, moved into place, and the index row (already ended) is inserted last. A
driver that dies before that leaves no row, so the batch's next session runs the attempt
again; a node that dies after its run ended loses nothing the driver already holds.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from orchestrator_runtime.masking import Masker

from ..lifecycle.outcome import settle, unrun
from ..lifecycle.runner import PreparedRun
from ..records.record import RunRecorder
from ..records.store import COLUMNS, Store
from ..spec import RunError, RunResult, host_error

#: Files of a record folder larger than this are not shipped whole (the logs are capped at
#: 20 MiB each by the recorder already; this bounds a packed record all the same).
MAX_FILE_BYTES = 64 * 1024 * 1024


def pack_record(store: Store, run_id: str) -> dict[str, Any]:
    """The record of a finished run as plain data: its index row and its folder's files."""
    row = store.get_run(run_id)
    if row is None:
        raise LookupError(f"run {run_id} has no record on this node")
    folder = Path(row["record_dir"])
    files: dict[str, bytes] = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and not path.is_symlink():
            with open(path, "rb") as file:
                files[path.name] = file.read(MAX_FILE_BYTES)
    return {"row": row, "files": files}


def import_record(store: Store, packed: dict[str, Any], node: dict[str, Any]) -> RunResult:
    """Write a node's packed record into `store` (the driver's) and return its result, with
    the node named in result.json. Raises OSError or sqlite3.Error when it cannot be written
    (then nothing of it is in the index)."""
    row = dict(packed["row"])
    run_id = row["run_id"]
    files: dict[str, bytes] = dict(packed["files"])
    data = json.loads(files.get("result.json", b"{}") or b"{}")
    result = RunResult.from_dict(data) if data else None
    if result is None or not result.run_id:  # the node ended without result.json: a torn record
        raise ValueError(f"the record of run {run_id} came back without its result.json")
    final = store.run_dir(run_id)
    result.record_dir = str(final)
    result.node = dict(node)
    files["result.json"] = (json.dumps(result.to_dict(), indent=2, default=str) + "\n").encode()
    incoming = store.runs_dir / f".incoming-{run_id}"
    shutil.rmtree(incoming, ignore_errors=True)
    incoming.mkdir(parents=True)
    for name, content in files.items():
        if "/" in name or name.startswith("."):  # names come from another machine
            continue
        with open(incoming / name, "wb") as file:
            file.write(content)
            file.flush()
            os.fsync(file.fileno())
    os.replace(incoming, final)
    row["record_dir"] = str(final)
    clean = {k: v for k, v in row.items() if k in COLUMNS}
    with store.connect() as db:
        names = ", ".join(clean)
        marks = ", ".join("?" for _ in clean)
        db.execute(f"INSERT INTO runs ({names}) VALUES ({marks})", list(clean.values()))
    return result


def lost_record(
    store: Store, prepared: PreparedRun, node: dict[str, Any], message: str, started: float
) -> RunResult:
    """The record, in the driver's store, of an attempt whose node (or its worker, or the
    object holding its result) was lost: `infra_error` of type `node_lost`, naming the node;
    the batch's rules decide whether it is run again."""
    return driver_record(store, prepared, node, host_error("node_lost", message), started)


def driver_record(
    store: Store,
    prepared: PreparedRun,
    node: dict[str, Any],
    error: RunError,
    started: float,
) -> RunResult:
    """The record, in the driver's store, of an attempt that no node recorded (lost with
    its node, or cancelled before a node took it): ended with `error` (its status decided
    by `outcome.unrun`), whose type names the host event that says why (naming the node
    when there was one)."""
    run_id = prepared.run_id
    result = unrun(
        run_id,
        error,
        payload=prepared.manifest.name,
        model=prepared.model.describe(),
        backend=prepared.backend,
        network=prepared.network.mode,
        limits=prepared.limits.recorded(prepared.max_steps_from),
        node=dict(node),
    )
    directory = store.create_run(
        run_id,
        status=result.status,
        created_at=started,
        payload=prepared.manifest.name,
        model=prepared.model.describe(),
        backend=prepared.backend,
        network=prepared.network.mode,
        task=Masker(prepared.secrets.values())(prepared.task),
        schedule=prepared.spec.schedule,
        batch=prepared.spec.batch,
        kind="check" if prepared.spec.check_only else "run",
    )
    record = RunRecorder(directory, Masker(prepared.secrets.values()), None)
    record.host_event(error.type, **node, message=error.message)
    ended = time.time()
    result.record_dir = str(directory)
    result.timings = {"created": started, "ended": ended, "duration": round(ended - started, 3)}
    settle(result, record, store)
    return result
