"""The checks of a run whose orchestrator process died (SIGKILL, nothing of it runs on): its
sandbox stops by its own deadline, and `cleanup` removes it and closes its record."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time

from ..backends.base import SandboxInfo
from ..lifecycle.cleanup import cleanup
from ..records.store import Store, new_run_id
from .kit import SHORT_LIMIT, CheckFailed, Kit

#: How long after its time limit a sandbox whose orchestrator died may still run: Docker's
#: keeper stops it at the limit + 10 s, E2B's lifetime at the limit + 60 s; a sandbox that
#: lives on has no deadline of its own.
DEADLINE_GRACE = 90


#: The orchestrator process a check kills: one run, in a process of its own.
ORPHAN_SCRIPT = """
import sys
from orchestrator import RunSpec, run
from orchestrator.testing.probe import action
folder, backend, runtime, run_id, limit = sys.argv[1:]
run(RunSpec(payload=folder, model="mock", backend=backend, network="none",
            sandbox_runtime=runtime or None, run_id=run_id, timeout_seconds=float(limit),
            additional_args=action("sleep", seconds=600)))
"""


def _orphan(kit: Kit, timeout: float) -> tuple[str, SandboxInfo]:
    """A run whose orchestrator process was SIGKILLed while its sandbox ran: its run id and
    its sandbox as found then."""
    run_id = new_run_id()
    kit.run_ids.append(run_id)
    argv = [str(kit.folder), kit.backend_name, kit.runtime or "", run_id, str(timeout)]
    said = tempfile.TemporaryFile(mode="w+")  # its stderr, never a pipe left unread
    proc = subprocess.Popen(
        [sys.executable, "-c", ORPHAN_SCRIPT, *argv], stdout=subprocess.DEVNULL, stderr=said
    )
    try:
        deadline = time.monotonic() + 300  # the first run may build the probe's image
        while time.monotonic() < deadline:
            running = [
                i for i in kit.left_of(run_id) if i.kind == "sandbox" and i.state == "running"
            ]
            if running:
                break
            if proc.poll() is not None:
                said.seek(0)
                raise CheckFailed(f"the run ended before it could be killed: {said.read()}")
            time.sleep(0.2)
        else:
            raise CheckFailed("the run's sandbox never showed up as running")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        said.close()
    return run_id, running[0]


def check_deadline(kit: Kit) -> str:
    run_id, _ = _orphan(kit, SHORT_LIMIT)
    killed = time.monotonic()
    allowed = SHORT_LIMIT + DEADLINE_GRACE
    while time.monotonic() < killed + allowed:
        alive = [i for i in kit.left_of(run_id) if i.kind == "sandbox" and i.state == "running"]
        if not alive:
            took = time.monotonic() - killed
            return (
                f"the sandbox stopped on its own {took:.0f} s after its orchestrator was killed "
                f"(limit {SHORT_LIMIT} s)"
            )
        time.sleep(0.5)
    raise CheckFailed(
        f"with its orchestrator SIGKILLed, the sandbox still ran {allowed} s later",
        "Give every sandbox its own absolute stop time (time limit + grace) that holds "
        "without the host process.",
    )


def check_orphans_removed(kit: Kit) -> str:
    run_id, found = _orphan(kit, 120)
    cleanup(kit.backend)
    left = kit.left_of(run_id)
    if left:
        raise CheckFailed(
            f"after `cleanup` the dead run still has: "
            f"{', '.join(f'{i.kind} {i.name}' for i in left)}",
            "List everything of a run by its labels (list_sandboxes) and remove "
            "it in remove_sandbox.",
        )
    row = Store().get_run(run_id) or {}
    if row.get("status") in (None, "running", "starting", "preparing"):
        raise CheckFailed(f"the dead run's record stays {row.get('status')!r} after cleanup")
    return f"sandbox {found.name} removed, the run closed as {row.get('status')}"
