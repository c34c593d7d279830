"""The schedules page's data: each schedule's next fire times (from the schedules file, when
the viewer has one), its last outcome and its history (from the store)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..records.store import Store
from ..schedules.cron import local_iso
from ..schedules.file import ScheduleFileError, load_schedules
from .queries import schedule_firings
from .render import Links, render


@dataclass
class ScheduleView:
    name: str
    cron: str = ""
    timezone: str = ""
    payload: str = ""
    enabled: bool = True
    next_times: list[str] = field(default_factory=list)
    last: dict[str, Any] | None = None
    history: list[dict[str, Any]] = field(default_factory=list)


def schedule_views(
    store: Store, file: Path | None, now: datetime | None = None
) -> tuple[list[ScheduleView], str | None]:
    """Every schedule known from the file or the history, and the file's problem if it could
    not be read (the history is shown all the same)."""
    now = now or datetime.now(timezone.utc)
    views: dict[str, ScheduleView] = {}
    problem = None
    if file is not None and file.is_file():
        try:
            for s in load_schedules(file, check_payloads=False).schedules:
                views[s.name] = ScheduleView(
                    name=s.name,
                    cron=s.cron.expression,
                    timezone=s.timezone,
                    payload=str(s.payload),
                    enabled=s.enabled,
                    next_times=[local_iso(t, s.cron.tz) for t in s.cron.next_times(now, 5)]
                    if s.enabled
                    else [],
                )
        except ScheduleFileError as exc:
            problem = exc.cause
    for firing in schedule_firings(store):
        view = views.setdefault(firing["schedule"], ScheduleView(name=firing["schedule"]))
        if len(view.history) < 50:
            view.history.append(firing)
        view.last = view.last or firing
    return sorted(views.values(), key=lambda v: v.name), problem


def schedules_page(store: Store, file: Path | None, links: Links) -> str:
    """The schedules page (served by `app`, written by `export`)."""
    views, problem = schedule_views(store, file)
    return render(
        "schedules.html",
        links,
        schedules=views,
        problem=problem,
        file=str(file) if file else "",
    )
