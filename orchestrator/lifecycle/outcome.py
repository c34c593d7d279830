"""How a run ends: one status and one error, decided from what the host saw itself.

The host's own outcome (time limit, cancel, a lost proxy or gateway, a spent budget), the
engine's exit record and the event channel's integrity decide; what the sandbox reported is a
claim that counts only when all of those agree (see `decide_status`). This module is the one
writer of a result's status and error (`tests/project/test_architecture.py` holds every other module
to it); the record (records/record.py) only writes what it is given.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from ..backends.base import ExitInfo
from ..errors import ManifestError
from ..gateway import measured_usage, usage_mismatch
from ..models import ModelSpec
from ..records.record import RunRecorder, agent_max_steps, index_end, write_result
from ..records.store import Store
from ..spec import (
    PAYLOAD_ERROR,
    NetworkPolicy,
    RunError,
    RunResult,
    RunStatus,
    StopRequest,
    host_error,
)
from .prepared import PreparedRun

#: How the host saw a supervised run stop (`supervise.supervise`): it `finished` by itself,
#: or the host stopped it for one of the other reasons.
OutcomeKind = Literal[
    "finished", "timed_out", "cancelled", "budget_exceeded", "network_lost", "record_unwritable"
]


@dataclass(frozen=True)
class Outcome:
    """How a supervised run stopped, and why in the host's words (`reason`: the lost
    proxy's or gateway's message, the spent budget's, who cancelled it; None when the kind
    says it all). Carried from `supervise` to `decide_status`, never kept on the record."""

    kind: OutcomeKind
    reason: str | None = None


def undecided(prepared: PreparedRun, backend: str, record_dir: Path) -> RunResult:
    """The run's result before anything is decided: `infra_error` until a phase says else."""
    return RunResult(
        run_id=prepared.run_id,
        status="infra_error",
        record_dir=str(record_dir),
        payload=prepared.manifest.name,
        model=prepared.model.describe(),
        backend=backend,
        network=prepared.network.mode,
        allowlist=prepared.allowlist,
        limits=prepared.limits.recorded(prepared.max_steps_from),
        gateway=prepared.gateway.describe()
        if prepared.gateway
        else {"enabled": False, "reason": prepared.gateway_off},
    )


def unrun(run_id: str, error: RunError, **fields: Any) -> RunResult:
    """The result of a run that ended without being supervised here: its orchestrator died
    (`orphaned`), its node was lost (`node_lost`), its executor raised before its record
    existed, or it was cancelled before a node took it (error type `cancelled`: status
    `cancelled`; every other end is `infra_error`). `fields`: the rest of the result."""
    status: RunStatus = "cancelled" if error.type == "cancelled" else "infra_error"
    return RunResult(run_id=run_id, status=status, error=error, **fields)


def cancelled_error(cancel: threading.Event | None) -> RunError:
    """The error of a run its `cancel` event stopped: the reason a `StopRequest` was given,
    else the user's cancel."""
    error = cancel.error if isinstance(cancel, StopRequest) else None
    return error or host_error("cancelled", "cancelled by the user")


def explain_network(
    network: NetworkPolicy, model: ModelSpec, error: RunError | None
) -> RunError | None:
    """Add the likely network cause when the model could not be reached."""
    if error is None or error.kind != "model_unavailable":
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
    return replace(error, message=f"{error.message} ({hint})".strip())


def decide_status(
    outcome: Outcome,
    exit_info: ExitInfo,
    run_end: dict[str, Any] | None,
    violations: list[str] | tuple[str, ...] = (),
    *,
    cancel: threading.Event | None = None,
) -> tuple[RunStatus, RunError | None]:
    """Map what happened to one terminal status and an error (None on success).

    Decided from what the host can check: its own outcome (limit, cancel, network), the
    engine's exit record, and the event channel's integrity. The sandbox's `run_end` is a
    claim: success counts only with a clean channel and a runtime process that exited 0.
    `cancel`: the run's cancel event (a `StopRequest` says why it stopped the run)."""
    kind, reason = outcome.kind, outcome.reason
    if kind == "timed_out":
        return "timed_out", host_error("timed_out", "time limit reached")
    if kind == "cancelled":
        return "cancelled", cancelled_error(cancel)
    if kind == "record_unwritable":
        return "infra_error", host_error("record_unwritable", "the run record could not be written")
    if kind == "budget_exceeded":
        message = reason or "the run's model budget is spent"
        return "failed", host_error("budget_exceeded", f"{message}; the run was stopped")
    if kind == "network_lost":
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
        return _claimed(run_end, exit_info)
    if exit_info.infra_error:
        return "infra_error", host_error("sandbox_lost", exit_info.infra_error)
    return "infra_error", host_error(
        "no_result", f"the runtime exited with code {exit_info.exit_code} without a result"
    )


def _claimed(run_end: dict[str, Any], exit_info: ExitInfo) -> tuple[RunStatus, RunError | None]:
    """The end the sandbox reported, held to its runtime's exit code."""
    code = exit_info.exit_code
    if run_end.get("state") == "success":
        if code == 0:
            return "succeeded", None
        if exit_info.infra_error:
            return "infra_error", host_error("sandbox_lost", exit_info.infra_error)
        return "failed", host_error(
            "protocol_violation",
            f"the sandbox reported success, but its runtime exited with code {code}",
        )
    state = run_end.get("state")
    raw = run_end.get("error") or {"type": state, "message": ""}
    error = RunError.from_dict(raw, default_type=str(state))
    if error.kind == "model_unavailable":
        return "infra_error", error
    if error.kind == "payload":  # the payload cannot load: bad input, never retried
        return "failed", replace(error, type=PAYLOAD_ERROR, message=str(error))
    return "failed", error


def decide(
    result: RunResult,
    outcome: Outcome,
    exit_info: ExitInfo,
    record: RunRecorder,
    cancel: threading.Event | None,
) -> None:
    """The run's status and error from what the host saw, and its exit, into `result`."""
    result.status, result.error = decide_status(
        outcome, exit_info, record.run_end, record.violations, cancel=cancel
    )
    result.exit_code = exit_info.exit_code
    result.oom_killed = exit_info.oom_killed


def stopped(result: RunResult, cancel: threading.Event | None) -> None:
    """A run stopped before it was supervised to its end (its cancel event, a stop request,
    Ctrl-C): `cancelled`."""
    result.status, result.error = "cancelled", cancelled_error(cancel)


def failed_on_host(result: RunResult, exc: Exception, message: str) -> None:
    """A run an exception ended on the host: a payload that asks for what cannot be had
    (ManifestError: bad input, `failed`, never retried), else `infra_error` (engine errors,
    image build failures, vanished sandboxes). `message`: the exception's text, masked."""
    if isinstance(exc, ManifestError):
        result.status, result.error = "failed", RunError.payload(message, exc.field)
    else:
        result.status, result.error = "infra_error", RunError.of(exc, message)


def explain(result: RunResult, network: NetworkPolicy, model: ModelSpec) -> None:
    """An `infra_error` run's error, with the likely network cause when the model could not
    be reached (`explain_network`)."""
    if result.status == "infra_error":
        result.error = explain_network(network, model, result.error)


def fill(result: RunResult, record: RunRecorder) -> None:
    """The rest of the result from the record (the sandbox's `run_end`: answer, steps,
    tokens; the host's events: egress refusals, injections, each agent's `max_steps`),
    masked; a record that could not be written ends the run `infra_error`."""
    end = record.run_end or {}
    if result.status == "succeeded":
        result.answer = end.get("answer")
    reported = end.get("token_usage") or {}
    result.token_usage = reported
    if result.gateway.get("enabled"):
        account_gateway(result, record, reported)
    result.steps = int(end.get("steps") or sum(1 for e in record.events if e["type"] == "step"))
    result.agent_max_steps = agent_max_steps(record.events)
    result.egress_blocked = sum(1 for e in record.events if e["type"] == "egress_blocked")
    result.secrets_injected = [
        {k: e.get(k) for k in ("secret", "host", "place", "count")}
        for e in record.events
        if e["type"] == "secret_injected"
    ]
    result.answer = record.masker.clean(result.answer)
    if result.error is not None:
        result.error = RunError.from_dict(record.masker.clean(result.error.to_dict()))
    if record.write_error is not None:
        unwritable(result, record.write_error)


def account_gateway(result: RunResult, record: RunRecorder, reported: dict[str, Any]) -> None:
    """Token usage as the gateway measured it; what the sandbox claimed is kept beside it,
    and a difference is flagged (`token_usage_mismatch`, and an event saying both)."""
    measured = measured_usage(record.events)
    result.token_usage, result.token_usage_source = measured, "gateway"
    result.token_usage_reported = dict(reported)
    result.token_usage_mismatch = usage_mismatch(measured, reported)
    if result.token_usage_mismatch:
        record.host_event("token_usage_mismatch", measured=measured, reported=reported)
    closed = [e for e in record.events if e.get("type") == "gateway_closed"]
    totals = closed[-1] if closed else {}
    calls = sum(1 for e in record.events if e.get("type") == "model_call")
    result.gateway.update(
        calls=totals.get("calls", calls),
        refused=totals.get("refused"),
        unmeasured=totals.get("unmeasured"),
    )


def settle(result: RunResult, record: RunRecorder, store: Store) -> None:
    """The rest of the result from its record (`fill`), then the record written with it:
    result.json (a record that cannot take it ends the run `infra_error`) and the index."""
    fill(result, record)
    failed = write_result(result, record)
    if failed is not None:
        unwritable(result, failed)
    index_end(result, store)


def unwritable(result: RunResult, what: str) -> None:
    """The run's record could not be written (`what`: the file and why): `infra_error`."""
    message = (
        f"the run record could not be written ({what}); the sandbox was stopped. Free space "
        "(or fix permissions) in the orchestrator's state directory and run again"
    )
    result.status, result.error = "infra_error", host_error("record_unwritable", message)


def orphaned(
    row: dict[str, Any],
    message: str,
    *,
    exit_code: int | None = None,
    oom_killed: bool = False,
    started_at: float | None = None,
    finished_at: float | None = None,
) -> RunResult:
    """The result of a run (its index `row`) whose orchestrator process died before
    recording its end: `infra_error` of type `orphaned`, with the exit and times its
    engine kept when it still had them (else now)."""
    ended = finished_at or time.time()
    started = started_at or row["created_at"]
    return unrun(
        row["run_id"],
        host_error("orphaned", message),
        exit_code=exit_code,
        oom_killed=oom_killed,
        timings={
            "created": row["created_at"],
            "started": started,
            "ended": ended,
            "duration": round(max(0.0, ended - started), 3),
        },
        record_dir=row["record_dir"],
        payload=row.get("payload") or "",
        model=row.get("model") or "",
        backend=row.get("backend") or "",
        network=row.get("network") or "",
    )
