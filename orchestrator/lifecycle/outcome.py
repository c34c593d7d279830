"""How a run ends: one status and one error, decided from what the host saw itself.

The host's own outcome (time limit, cancel, a lost proxy or gateway, a spent budget), the
engine's exit record and the event channel's integrity decide; what the sandbox reported is a
claim that counts only when all of those agree (see `decide_status`).
"""

from __future__ import annotations

import threading
from typing import Any

from ..backends.base import ExitInfo
from ..models import ModelSpec
from ..spec import PAYLOAD_ERROR, NetworkPolicy, RunStatus, cancelled_error, host_error


def explain_network(
    network: NetworkPolicy, model: ModelSpec, error: dict[str, Any] | None
) -> dict[str, Any] | None:
    """Add the likely network cause when the model could not be reached."""
    if not error or error.get("kind") != "model_unavailable":
        return error
    if network.mode == "none" and model.needs_network:
        hint = (
            "this run has no network (--network none), so the sandbox cannot reach the model "
            f"at {model.api_base}"
        )
    elif network.host_endpoints:
        hint = (
            f"the model server at {model.api_base} is reached from containers through "
            "the Docker bridge: it must listen on 0.0.0.0 or the docker0 address, not only "
            "on 127.0.0.1"
        )
    else:
        return error
    return {**error, "message": f"{error.get('message') or ''} ({hint})".strip()}


def decide_status(
    outcome: str,
    exit_info: ExitInfo,
    run_end: dict[str, Any] | None,
    violations: list[str] | tuple[str, ...] = (),
    *,
    reason: str | None = None,
    cancel: threading.Event | None = None,
) -> tuple[RunStatus, dict[str, Any] | None]:
    """Map what happened to one terminal status and an error (None on success).

    Decided from what the host can check: its own outcome (limit, cancel, network), the
    engine's exit record, and the event channel's integrity. The sandbox's `run_end` is a
    claim: success counts only with a clean channel and a runtime process that exited 0.
    `cancel`: the run's cancel event (a `StopRequest` says why it stopped the run)."""
    if outcome == "timed_out":
        return "timed_out", host_error("timed_out", "time limit reached")
    if outcome == "cancelled":
        return "cancelled", cancelled_error(cancel)
    if outcome == "record_unwritable":
        return "infra_error", host_error("record_unwritable", "the run record could not be written")
    if outcome == "budget_exceeded":
        message = reason or "the run's model budget is spent"
        return "failed", host_error("budget_exceeded", f"{message}; the run was stopped")
    if outcome == "network_lost":
        message = (
            f"{reason or 'the egress proxy stopped during the run'}: the sandbox was cut off "
            "(fail closed) and stopped"
        )
        return "infra_error", host_error("network_lost", message)
    if exit_info.oom_killed:
        return "oom_killed", host_error("oom_killed", "the sandbox ran out of memory")
    code = exit_info.exit_code
    if violations:
        message = "; ".join(dict.fromkeys(violations))
        return "failed", host_error(
            "protocol_violation",
            f"the sandbox broke the event protocol: {message} (runtime exit code {code}); "
            "nothing it reported can be trusted as this run's end",
        )
    if run_end is not None:
        if run_end.get("state") == "success":
            if code == 0:
                return "succeeded", None
            if exit_info.infra_error:
                return "infra_error", host_error("sandbox_lost", exit_info.infra_error)
            return "failed", host_error(
                "protocol_violation",
                f"the sandbox reported success, but its runtime exited with code {code}",
            )
        error = run_end.get("error") or {"type": run_end.get("state"), "message": ""}
        if error.get("kind") == "model_unavailable":
            return "infra_error", error
        if error.get("kind") == "payload":  # the payload cannot load: bad input, never retried
            message = f"{error.get('type')}: {error.get('message')}"
            return "failed", {**error, "type": PAYLOAD_ERROR, "message": message}
        return "failed", error
    if exit_info.infra_error:
        return "infra_error", host_error("sandbox_lost", exit_info.infra_error)
    return "infra_error", host_error(
        "no_result", f"the runtime exited with code {exit_info.exit_code} without a result"
    )
