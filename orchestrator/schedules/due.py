"""What is due: fire times since the last firing, the missed-run rule, `--if-due`."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from ..images.imagedef import Progress
from .clock import Clock, SystemClock
from .cron import COUNT_LIMIT, utc_iso
from .file import Schedule
from .firing import fire, firing_line, print_log
from .notify import maybe_notify
from .store import Firing, ScheduleStore

#: A fire time this late is still "on time"; later, it was missed (host down, serve stopped).
LATE_TOLERANCE = 60.0


@dataclass(frozen=True)
class Plan:
    """What to do for one schedule at one instant."""

    fire_at: datetime | None = None  # fire for this fire time
    trigger: str = "serve"  # or catch-up
    missed: int = 0  # fire times nobody ran
    missed_last: datetime | None = None  # the latest of them (recorded as the `missed` row)
    missed_first: datetime | None = None
    reason: str = ""


def plan(
    schedule: Schedule,
    last: datetime | None,
    now: datetime,
    *,
    late_tolerance: float = LATE_TOLERANCE,
    catch_up: bool = True,
) -> Plan:
    """Decide what is due between the last handled fire time and now.

    The newest due fire time fires when it is on time (at most `late_tolerance` late).
    Older ones were missed. When even the newest is late, the missed-run rule decides:
    `skip` records the gap and fires nothing; `run-once` fires the newest once, if it is
    within `missed_deadline`. With `catch_up=False` (a cron line waking up) a late fire time
    is left alone.
    """
    latest = schedule.cron.latest_at_or_before(now)
    if latest is None or (last is not None and latest <= last):
        return Plan()
    if last is None:  # never fired: nothing can have been missed
        last = latest - timedelta(microseconds=1)
    earlier = schedule.cron.between(last, latest)
    first = schedule.cron.next_after(last) if earlier else None
    previous = schedule.cron.previous_before(latest) if earlier else None
    lateness = (now - latest).total_seconds()
    if lateness <= late_tolerance:
        return Plan(
            fire_at=latest,
            missed=earlier,
            missed_last=previous,
            missed_first=first,
            reason="missed while no scheduler ran",
        )
    if not catch_up:
        return Plan()
    first = first or latest
    total = earlier + 1
    within = schedule.missed_deadline is None or lateness <= schedule.missed_deadline
    if schedule.missed == "run-once" and within:
        return Plan(
            fire_at=latest,
            trigger="catch-up",
            missed=earlier,
            missed_last=previous,
            missed_first=first,
            reason="missed while no scheduler ran; run-once fired the latest",
        )
    why = (
        "missed=skip"
        if schedule.missed == "skip"
        else f"run-once, but {lateness:.0f}s late is past missed_deadline "
        f"{schedule.missed_deadline:.0f}s"
    )
    return Plan(
        missed=total,
        missed_last=latest,
        missed_first=first,
        reason=f"missed while no scheduler ran ({why})",
    )


def record_missed(
    schedule: Schedule, p: Plan, store: ScheduleStore, now: datetime, trigger: str, log: Progress
) -> None:
    if not p.missed or p.missed_last is None:
        return
    from ..labels import owner_label

    count = f"{p.missed}{'+' if p.missed >= COUNT_LIMIT else ''}"
    span = utc_iso(p.missed_first or p.missed_last)
    reason = f"{count} fire time(s) from {span} to {utc_iso(p.missed_last)} {p.reason}"
    firing_id = store.claim(
        schedule.name, p.missed_last, now, trigger, owner_label(), outcome="missed", reason=reason
    )
    if firing_id is None:
        return
    firing = Firing(firing_id, schedule.name, "missed", trigger, p.missed_last, now, reason=reason)
    log(firing_line(firing, schedule, now))
    maybe_notify(schedule, firing, store, log)


def run_due(
    schedule: Schedule,
    *,
    store: ScheduleStore,
    clock: Clock | None = None,
    catch_up: bool = False,
    log: Progress = print_log,
    **kwargs: Any,
) -> Firing | None:
    """What a cron line does: fire if a fire time is due now (`--if-due`), or apply the
    missed-run rule since the last recorded firing (`--catch-up`, e.g. at boot). None when
    nothing is due."""
    clock = clock or SystemClock()
    now = clock.now()
    if not schedule.enabled:
        return None
    p = plan(schedule, store.last_scheduled_for(schedule.name), now, catch_up=catch_up)
    trigger = "cron" if p.trigger == "serve" else p.trigger
    record_missed(schedule, p, store, now, trigger, log)
    if p.fire_at is None:
        return None
    return fire(
        schedule,
        store=store,
        trigger=trigger,
        scheduled_for=p.fire_at,
        clock=clock,
        log=log,
        **kwargs,
    )
