"""The checks of a run's course that the host and backend decide together: a cancel stops the
run and removes its sandbox; a payload the host must not ship is refused before any sandbox
exists; a warm sandbox serves the one run it was made for."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ..backends.base import WarmSandboxes
from ..errors import OrchestratorError
from ..lifecycle.imagecache import ImageCache
from ..lifecycle.prepared import prepare
from ..lifecycle.request import sandbox_spec
from ..lifecycle.runner import WarmSandbox, execute, observers_of, run
from ..payloads.shipped import MAX_PAYLOAD_MB_ENV
from ..records.store import Store
from .kit import CheckFailed, Kit, NotApplicable
from .probe import write_probe

#: How long a cancelled run's probe would sleep: a run that ends `succeeded` ignored the cancel.
CANCELLED_SLEEP = 60
#: A warm sandbox's time-to-live in the warm check (it is taken at once).
WARM_TTL = 120.0


def sandboxes_of(kit: Kit, run_id: str) -> list[str]:
    """The names of a run's sandboxes (not what is beside them) the backend still has."""
    return [i.name for i in kit.left_of(run_id) if i.kind == "sandbox"]


def check_cancel(kit: Kit) -> str:
    result = kit.run(
        "cancel",
        "sleep",
        {"seconds": CANCELLED_SLEEP},
        cancel_at="run_start",
        timeout_seconds=CANCELLED_SLEEP + 30,
    )
    took = result.timings.get("duration", 0.0)
    if result.status != "cancelled":
        raise CheckFailed(
            f"a run cancelled once its program started ended {result.status} after {took:.1f} s",
            "Stop the sandbox (Sandbox.kill) when the run's cancel event is set, and let the "
            "runner record `cancelled`.",
        )
    if not kit.events_of(result, "run_start"):
        raise CheckFailed("the run was cancelled, but its program never started")
    left = kit.left_of(result.run_id)
    if left:
        named = ", ".join(f"{i.kind} {i.name} ({i.state})" for i in left)
        raise CheckFailed(
            f"the cancelled run left: {named}",
            "Remove the sandbox and everything made for it in Sandbox.remove.",
        )
    return f"cancelled after {took:.1f} s (its probe would have slept {CANCELLED_SLEEP} s)"


def refused(kit: Kit, what: str, spoil: Callable[[Path], None]) -> str:
    """A copy of the probe, spoiled by `spoil`, must be refused by `run` before the backend
    makes anything or the store records a run."""
    folder = Path(tempfile.mkdtemp(prefix="orchestrator-conformance-ship-"))
    try:
        spoil(write_probe(folder))
        spec = replace(kit.spec("ok"), payload=folder)
        assert spec.run_id is not None
        kit.run_ids.append(spec.run_id)
        try:
            result = run(spec, backend=kit.backend)
        except OrchestratorError as exc:
            refusal = str(exc).splitlines()[0]
        else:
            raise CheckFailed(
                f"a payload with {what} was shipped: its run ended {result.status}",
                "Read the payload with payloads.payload_files (it refuses both) before any "
                "sandbox.",
            )
        made = kit.left_of(spec.run_id)
        if made or Store().get_run(spec.run_id):
            raise CheckFailed(
                f"a payload with {what} was refused, but only after the run was recorded or "
                f"its sandbox made ({', '.join(i.name for i in made) or 'a record'})"
            )
        return f"refused before any sandbox: {refusal[:160]}"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def check_shipping_symlink(kit: Kit) -> str:
    def link_out(folder: Path) -> None:
        (folder / "notes.txt").symlink_to("/etc/hostname")

    return refused(kit, "a symlink leaving its folder", link_out)


def check_shipping_size(kit: Kit) -> str:
    """With the cap at 1 MiB for this check (whatever it is configured to: the check proves
    the cap holds, without reading a payload of the configured size), 2 MiB are refused."""
    cap_mb = 1

    def oversize(folder: Path) -> None:
        with open(folder / "data.bin", "wb") as data:
            data.truncate((cap_mb + 1) * 2**20)  # sparse: costs no disk

    saved = os.environ.get(MAX_PAYLOAD_MB_ENV)
    os.environ[MAX_PAYLOAD_MB_ENV] = str(cap_mb)
    try:
        return refused(kit, f"{cap_mb + 1} MiB (cap {cap_mb} MiB)", oversize)
    finally:
        if saved is None:
            os.environ.pop(MAX_PAYLOAD_MB_ENV, None)
        else:
            os.environ[MAX_PAYLOAD_MB_ENV] = saved


def check_warm_one_run(kit: Kit) -> str:
    backend = kit.backend
    if not isinstance(backend, WarmSandboxes):
        raise NotApplicable(f"the {kit.backend_name} backend has no warm sandboxes")
    first, second = prepare(kit.spec("ok")), prepare(kit.spec("ok"))
    kit.run_ids += [first.run_id, second.run_id]
    images = ImageCache()
    image = images.prepare(kit.backend, first.image_requirements, lambda _m: None)
    idle = backend.create_idle(sandbox_spec(first, image), lambda _m: None, WARM_TTL)
    try:
        idle.take(sandbox_spec(second, image))
    except ValueError:
        pass
    else:
        raise CheckFailed(
            f"the warm sandbox {idle.id} made for run {first.run_id} was handed to run "
            f"{second.run_id}",
            "Refuse in Sandbox.take a spec whose run id is not the sandbox's own.",
        )
    seen: list[dict[str, object]] = []
    warm_sandbox = WarmSandbox(first.run_id, idle)
    observers = observers_of(on_event=seen.append)
    result = execute(
        first, backend=kit.backend, observers=observers, images=images, warm_sandbox=warm_sandbox
    )
    kit.answer(result)
    made = [e for e in seen if e.get("type") == "sandbox_created"]
    if not result.warm or not made or made[0].get("sandbox_id") != idle.id:
        raise CheckFailed(f"the run did not run in its warm sandbox {idle.id} ({made})")
    left = sandboxes_of(kit, first.run_id)
    if left:
        raise CheckFailed(
            f"the warm sandbox outlived its run: {', '.join(left)}",
            "Remove a taken warm sandbox when its run ends (Sandbox.remove), as any.",
        )
    return f"warm sandbox {str(idle.id)[:12]} refused another run, served its own, then went"
