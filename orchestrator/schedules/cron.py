"""Cron expressions in a time zone, and durations."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

from croniter import croniter

#: Gaps are counted up to this many fire times (a year of every-minute is not iterated).
COUNT_LIMIT = 10_000


SHORTCUTS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}


#: Cron fields every cron daemon understands (croniter also takes L, #, W, ?).
_TOKEN = r"(\*|\d+|[A-Za-z]{3})"


PORTABLE_FIELD = re.compile(rf"^{_TOKEN}([-/,]{_TOKEN})*$")


_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd])")


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class Cron:
    """A 5-field cron expression evaluated in a time zone; all instants are aware UTC.

    DST follows classic cron: a fire time inside the skipped hour fires when the clock jumps
    (02:30 → 03:00, croniter's behaviour); in the repeated hour a job whose hour field is a
    wildcard (`*`, `*/2`) fires in both passes, a job at a fixed hour fires only in the first.
    """

    def __init__(self, expression: str, tz: ZoneInfo) -> None:
        self.expression = expression.strip()
        self.fields = SHORTCUTS.get(self.expression.lower(), self.expression).split()
        self.tz = tz
        if self.expression.startswith("@") and self.expression.lower() not in SHORTCUTS:
            raise ValueError(
                f"{self.expression!r} is not supported; use 5 fields or one of "
                f"{', '.join(SHORTCUTS)}"
            )
        if len(self.fields) != 5:
            raise ValueError(
                f"{self.expression!r} has {len(self.fields)} fields; cron needs exactly 5 "
                "(minute hour day-of-month month day-of-week) or a shortcut such as @hourly"
            )
        try:
            croniter(" ".join(self.fields))
        except (ValueError, KeyError) as exc:  # CroniterBadCronError is a ValueError
            raise ValueError(f"{self.expression!r} is not a valid cron expression ({exc})") from exc
        self._hour_wildcard = self.fields[1].startswith("*")
        self.next_after(datetime(2000, 1, 1, tzinfo=timezone.utc))  # never-firing (Feb 30)?

    @property
    def portable(self) -> bool:
        """True when any cron daemon reads the fields as croniter does."""
        return all(PORTABLE_FIELD.match(f) for f in self.fields)

    def _keep(self, instant: datetime) -> bool:
        local = instant.astimezone(self.tz)
        if local.fold == 1 and local.replace(fold=0).utcoffset() != local.utcoffset():
            return self._hour_wildcard  # second pass of a repeated hour
        return True

    def _walk(self, start: datetime, forward: bool) -> Iterator[datetime]:
        try:
            it = croniter(" ".join(self.fields), start.astimezone(self.tz))
            step = it.get_next if forward else it.get_prev
            for _ in range(1_000_000):
                instant = step(datetime).astimezone(timezone.utc)
                if self._keep(instant):
                    yield instant
        except Exception as exc:  # croniter gives up on dates that never come (Feb 30)
            raise ValueError(f"{self.expression!r} never fires ({exc})") from exc

    def next_after(self, instant: datetime) -> datetime:
        """The first fire time strictly after `instant`."""
        for candidate in self._walk(instant, forward=True):
            if candidate > instant:
                return candidate
        raise ValueError(f"{self.expression!r} never fires")  # pragma: no cover

    def next_times(self, instant: datetime, count: int = 5) -> list[datetime]:
        times: list[datetime] = []
        for _ in range(count):
            instant = self.next_after(instant)
            times.append(instant)
        return times

    def latest_at_or_before(self, instant: datetime) -> datetime | None:
        """The last fire time at or before `instant` (None if there is none).

        croniter's backward walk can disagree with its forward walk inside a DST fold (seen
        with Lord Howe's half-hour shift), so backward only finds an anchor a few hours
        earlier and the answer comes from walking forward, as `next_after` does.
        """
        anchor = None
        for candidate in self._walk(instant + timedelta(seconds=1), forward=False):
            if candidate <= instant:
                anchor = candidate
                break
        if anchor is None:  # pragma: no cover - croniter always finds a past time
            return None
        latest = None
        for candidate in self._walk(anchor - timedelta(hours=3), forward=True):
            if candidate > instant:
                break
            latest = candidate
        return latest

    def between(self, after: datetime, before: datetime, limit: int = COUNT_LIMIT) -> int:
        """How many fire times lie strictly between two instants (capped at `limit`)."""
        count = 0
        for candidate in self._walk(after, forward=True):
            if candidate <= after:
                continue
            if candidate >= before or count >= limit:
                break
            count += 1
        return count

    def previous_before(self, instant: datetime) -> datetime | None:
        return self.latest_at_or_before(instant - timedelta(seconds=1))


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string like `90s`, `15m`, `2h`, `1d`, `1h30m`."""
    if isinstance(value, bool):
        raise ValueError("must be seconds or a duration such as 2h, not a boolean")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and value.strip():
        text = value.strip().lower().replace(" ", "")
        parts = _DURATION_RE.findall(text)
        if not parts or "".join(n + u for n, u in parts) != text:
            raise ValueError(f"{value!r} is not a duration (write 90s, 15m, 2h, 1d or 1h30m)")
        seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    else:
        raise ValueError(f"{value!r} is not a duration (write 90s, 15m, 2h, 1d or 1h30m)")
    if seconds <= 0:
        raise ValueError("must be positive")
    return seconds


def describe_next_times(cron: Cron, now: datetime | None = None) -> str:
    try:
        times = cron.next_times(now or datetime.now(timezone.utc), 5)
    except ValueError as exc:
        return str(exc)
    return ", ".join(local_iso(t, cron.tz) for t in times)


def local_iso(instant: datetime, tz: ZoneInfo) -> str:
    return instant.astimezone(tz).isoformat(timespec="minutes")


def utc_iso(instant: datetime) -> str:
    return instant.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
