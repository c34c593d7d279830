"""Watching a running sandbox: its output into the record as it comes, its time limit, the
user's cancel, its helpers' health (egress proxy, model gateway) and what they report. The
host decides here how a run stopped; nothing in the sandbox is trusted to stop itself."""

from __future__ import annotations

import threading
import time

from ..backends.base import Sandbox
from ..records.record import RunRecorder
from ..spec import StopRequest
from .outcome import Outcome, OutcomeKind

#: How often the host checks that a running sandbox still has its egress proxy.
HEALTH_INTERVAL = 1.0
#: The egress proxy's log is read again at most this often once new events came (a step
#: ended: its failed attempts are shown right after it), and every HEALTH_INTERVAL anyway.
EGRESS_INTERVAL = 0.2


def supervise(
    sandbox: Sandbox,
    record: RunRecorder,
    deadline: float,
    timeout: float,
    cancel: threading.Event,
) -> Outcome:
    """Pump the sandbox's output until it ends, the time limit passes, the run is cancelled,
    its model budget is spent, it loses its network (egress proxy or gateway gone) or its
    record cannot be written; returns how it stopped (`Outcome`: `finished` or the host's
    reason to stop it, with the host's words for why). The host enforces the time limit by
    killing the sandbox; nothing in the sandbox is trusted to stop itself."""
    done = threading.Event()

    def pump() -> None:
        try:
            for name, chunk in sandbox.stream():
                record.feed(name, chunk)
        finally:
            record.flush()
            done.set()

    reader = threading.Thread(target=pump, name="sandbox-stream", daemon=True)
    reader.start()
    outcome: OutcomeKind = "finished"
    lost: str | None = None
    next_check = next_egress = time.monotonic()
    events_seen = 0
    while not done.wait(timeout=0.05):
        stop = None
        now = time.monotonic()
        if now >= next_check:
            lost, next_check = sandbox.health(), now + HEALTH_INTERVAL
            stop = "stopped with `orchestrator runs stop`" if record.stop_requested() else None
        if now >= next_egress and (len(record.events) != events_seen or now >= next_check):
            events_seen, next_egress = len(record.events), now + EGRESS_INTERVAL
            record_egress_blocked(sandbox, record, live=True)  # shown while the run goes on
        spent = record_gateway(sandbox, record)
        if cancel.is_set() or stop:
            why = cancel.error if isinstance(cancel, StopRequest) else None  # a batch's cap
            outcome, lost = "cancelled", stop or (why.message if why else None) or lost
        elif spent:
            outcome = "budget_exceeded"
            lost = spent
        elif time.monotonic() >= deadline:
            outcome = "timed_out"
        elif lost:
            outcome = "network_lost"
        elif record.write_error:
            outcome = "record_unwritable"
        else:
            continue
        sandbox.kill()
        record.host_event(outcome, **({"reason": lost} if lost else {"limit_seconds": timeout}))
        return _finish(sandbox, record, reader, Outcome(outcome, lost))
    return _finish(sandbox, record, reader, Outcome("finished"))


def _finish(
    sandbox: Sandbox, record: RunRecorder, reader: threading.Thread, outcome: Outcome
) -> Outcome:
    """The run's output read to its end; a run that ended failing by itself is given the
    host's cause when there is one (its budget spent, its network lost)."""
    reader.join(timeout=10)
    failed = (record.run_end or {}).get("state") != "success"
    spent = record_gateway(sandbox, record)
    if outcome.kind == "finished" and failed and spent:
        outcome = Outcome("budget_exceeded", spent)  # the 429 ended it first
        record.host_event(outcome.kind, reason=spent)
    elif outcome.kind == "finished" and failed and (lost := sandbox.health()):
        # The runtime ended first (say, on a model connection error): name the real cause.
        outcome = Outcome("network_lost", lost)
        record.host_event(outcome.kind, reason=lost)
    return outcome


def record_gateway(sandbox: Sandbox, record: RunRecorder, *, close: bool = False) -> str | None:
    """Record what the run's model gateway reported since the last look (source `gateway`);
    with `close`, end its service first so that its last reports are in. Returns the
    message of a `budget_exceeded` report, if one came (None without a gateway)."""
    gateway = sandbox.gateway
    if gateway is None:
        return None
    if close:
        try:
            gateway.close()
        except Exception as exc:  # the run's outcome matters more than the last report
            record.host_event("gateway_close_failed", error=str(exc))
    spent = None
    for event in gateway.events():
        record.observed({**event, "source": "gateway"})
        if event.get("type") == "budget_exceeded":
            spent = str(event.get("message") or "the run's model budget is spent")
    return spent


def record_egress_blocked(sandbox: Sandbox, record: RunRecorder, *, live: bool = False) -> None:
    """Record what the sandbox's egress proxy saw fail since the last look: refused attempts
    as `egress_blocked`, allowed ones that failed upstream as `egress_failed`, each with the
    agent and step that were running then (`record.step_at`). `live`: a look while the run
    goes on (a failure to read the log is then left to the final look); else the final
    look, once the sandbox has ended, which lets the backend end its egress control first."""
    try:
        attempts = sandbox.egress_blocked(final=not live)
    except Exception as exc:  # the run's outcome matters more than its egress log
        if not live:
            record.host_event("egress_log_unavailable", error=str(exc))
        return
    for attempt in attempts[record.egress_seen :]:
        kind = "egress_failed" if attempt.get("verdict") == "allowed" else "egress_blocked"
        where = record.step_at(attempt["ts"]) if isinstance(attempt.get("ts"), float) else {}
        record.observed({"type": kind, "source": "egress", **attempt, **where})
    record.egress_seen = max(record.egress_seen, len(attempts))


def record_injections(sandbox: Sandbox, record: RunRecorder) -> None:
    """Record where the run's secret interceptor put each bound secret's value (at the end:
    one `secret_injected` event per secret, host and place, with how many requests and the
    agent and step of the first); never a value (the interceptor never reports one)."""
    proxy = sandbox.secrets_proxy
    if proxy is None:
        return
    for entry in proxy.injections():
        first = entry.get("first_ts")
        where = record.step_at(float(first)) if isinstance(first, (int, float)) else {}
        record.observed({"type": "secret_injected", "source": "interceptor", **entry, **where})
