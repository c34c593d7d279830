"""Watching a running sandbox: its output into the record as it comes, its time limit, the
user's cancel, its helpers' health (egress proxy, model gateway) and what they report. The
host decides here how a run stopped; nothing in the sandbox is trusted to stop itself."""

from __future__ import annotations

import threading
import time

from .backends.base import Sandbox
from .record import RunRecorder

#: How often the host checks that a running sandbox still has its egress proxy.
HEALTH_INTERVAL = 1.0


def supervise(
    sandbox: Sandbox,
    record: RunRecorder,
    deadline: float,
    timeout: float,
    cancel: threading.Event,
) -> str:
    """Pump the sandbox's output until it ends, the time limit passes, or the run is
    cancelled, or it loses its network (egress proxy gone); returns `finished`, `timed_out`,
    `cancelled` or `network_lost`. The host enforces the time limit by killing the sandbox;
    nothing in the sandbox is trusted to stop itself."""
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
    outcome = "finished"
    lost: str | None = None
    next_check = time.monotonic()
    while not done.wait(timeout=0.05):
        stop = None
        if time.monotonic() >= next_check:
            lost, next_check = sandbox.health(), time.monotonic() + HEALTH_INTERVAL
            stop = "stopped with `orchestrator runs stop`" if record.stop_requested() else None
        spent = record_gateway(sandbox, record)
        if cancel.is_set() or stop:
            outcome, lost = "cancelled", stop or lost
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
        record.stop_reason = lost
        record.host_event(outcome, **({"reason": lost} if lost else {"limit_seconds": timeout}))
        break
    reader.join(timeout=10)
    failed = (record.run_end or {}).get("state") != "success"
    spent = record_gateway(sandbox, record)
    if outcome == "finished" and failed and spent:
        outcome, record.stop_reason = "budget_exceeded", spent  # the 429 ended it first
        record.host_event(outcome, reason=spent)
    elif outcome == "finished" and failed and (lost := sandbox.health()):
        # The runtime ended first (say, on a model connection error): name the real cause.
        outcome, record.stop_reason = "network_lost", lost
        record.host_event(outcome, reason=lost)
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


def record_egress_blocked(sandbox: Sandbox, record: RunRecorder) -> None:
    """Record what the sandbox's egress proxy refused, as `egress_blocked` events."""
    try:
        attempts = sandbox.egress_blocked()
    except Exception as exc:  # the run's outcome matters more than its egress log
        record.host_event("egress_log_unavailable", error=str(exc))
        return
    for attempt in attempts:
        record.observed({"type": "egress_blocked", "source": "egress", **attempt})
