"""Scheduled agent jobs: a TOML file of cron schedules, fired through the single-run API.

A *firing* is one decision of the scheduler: run the payload (`runner.run` with
`RunSpec(schedule=name)`), or record why not (skipped: the previous run still goes; missed:
nobody was there to fire). Every firing is a row in `schedule_firings`, in the same SQLite
file as the runs, so a schedule's history survives restarts and is shared by `serve`, cron
lines and manual `schedule run` calls alike.

Overlap is prevented with a per-schedule file lock (flock): the OS drops it when the holder
dies, so a crash never leaves a schedule stuck. `replace` asks the holder to cancel its run
through a flag in the store, which the holder polls; this works across processes without
signalling anyone's pid (a `serve` process holds many schedules).

Time is injected (`Clock`), and so is the run function, so tests simulate hours instantly.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter
from filelock import FileLock, Timeout

from .errors import ConfigError, OrchestratorError
from .manifest import BACKENDS
from .runner import EXIT_CODES, RunCancelled, RunResult, RunSpec
from .store import Store, new_run_id

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DEFAULT_FILE = "schedules.toml"
#: `schedule run` exit code when the previous run of the schedule still goes (sysexits'
#: EX_TEMPFAIL: "try again later"), distinct from every run status.
EXIT_SKIPPED = 75
CONCURRENCY = ("forbid", "allow", "replace")
MISSED = ("skip", "run-once")
NOTIFY_ON = ("failure", "skip", "success")
#: Outcomes that count as a failure for notifications (`cancelled` is an operator's act).
FAILURES = frozenset({"failed", "timed_out", "oom_killed", "infra_error", "error", "lost"})
#: A fire time this late is still "on time"; later, it was missed (host down, serve stopped).
LATE_TOLERANCE = 60.0
#: How long a `replace` firing waits for the previous run to stop before giving up (skip).
REPLACE_WAIT = 90.0
NOTIFY_TIMEOUT = 30.0
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
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: Cron fields every cron daemon understands (croniter also takes L, #, W, ?).
_TOKEN = r"(\*|\d+|[A-Za-z]{3})"
_PORTABLE_FIELD = re.compile(rf"^{_TOKEN}([-/,]{_TOKEN})*$")
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_LIMIT_KEYS = {"max_steps": int, "timeout_seconds": float, "memory_mb": int, "cpus": float,
               "pids": int}  # fmt: skip
#: Fields of a [[schedule]] table.
_KEYS = {
    "name", "cron", "timezone", "payload", "task", "task_file", "model", "api_base",
    "model_key_env", "backend", "network", "allow_hosts", "limits", "secrets", "env_file",
    "additional_args", "concurrency", "missed", "missed_deadline", "notify", "enabled",
}  # fmt: skip
_NOTIFY_KEYS = {"command", "webhook", "timeout_seconds", "on"}

Log = Callable[[str], None]


# --- cron in a time zone ----------------------------------------------------------------------


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
        return all(_PORTABLE_FIELD.match(f) for f in self.fields)

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


# --- the schedule file ------------------------------------------------------------------------


@dataclass(frozen=True)
class Notify:
    """Where to report a firing: a command (argv, no shell), a webhook URL, or both."""

    command: tuple[str, ...] = ()
    webhook: str | None = None
    timeout_seconds: float = NOTIFY_TIMEOUT
    on: frozenset[str] = frozenset({"failure"})


@dataclass(frozen=True)
class Schedule:
    """One `[[schedule]]` table, validated; paths are absolute."""

    name: str
    cron: Cron
    timezone: str
    payload: Path
    source: Path
    task: str | None = None
    task_file: Path | None = None
    model: str = "mock"
    api_base: str | None = None
    model_key_env: str | None = None
    backend: str | None = None
    network: str | None = None
    allow_hosts: tuple[str, ...] = ()
    limits: dict[str, Any] = field(default_factory=dict)
    secrets: tuple[str, ...] = ()
    env_file: Path | None = None
    additional_args: dict[str, Any] | None = None
    concurrency: str = "forbid"
    missed: str = "skip"
    missed_deadline: float | None = None
    notify: Notify | None = None
    enabled: bool = True

    def read_task(self) -> str | None:
        """The task, read from `task_file` at firing time so edits need no reinstall."""
        if self.task_file is None:
            return self.task
        try:
            return self.task_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(
                f'schedule "{self.name}" field `task_file`: cannot read {self.task_file} ({exc}).',
                "Fix the path (relative paths are relative to the schedules file).",
            ) from exc

    def run_spec(self, run_id: str | None = None) -> RunSpec:
        return RunSpec(
            payload=self.payload,
            task=self.read_task(),
            model=self.model,
            api_base=self.api_base,
            model_key_env=self.model_key_env,
            additional_args=self.additional_args,
            backend=self.backend,
            network=self.network,
            allow_hosts=self.allow_hosts,
            env_file=self.env_file or self.source.parent / ".env",
            schedule=self.name,
            run_id=run_id,
            **self.limits,
        )

    def check_secrets(self) -> None:
        """Refuse a run that would get a secret the schedule does not list.

        The runner hands a run exactly the payload's declared secrets plus the model's
        credential; the schedule's `secrets` is the allow-list those must fit in, so a payload
        that starts asking for a new credential stops firing instead of silently getting it.
        """
        from .manifest import load_manifest
        from .models import parse_model

        manifest = load_manifest(self.payload)
        model = parse_model(self.model, api_base=self.api_base, credential_env=self.model_key_env)
        needed = [*manifest.secrets, *([model.credential_env] if model.credential_env else [])]
        extra = [n for n in dict.fromkeys(needed) if n not in self.secrets]
        if extra:
            raise ConfigError(
                f'schedule "{self.name}" field `secrets`: the run would get {", ".join(extra)} '
                f"(declared by the payload {manifest.name} or the model {model.provider}), "
                "which the schedule does not allow.",
                f"Add them to `secrets = [...]` of schedule {self.name!r} if it may use them.",
            )


@dataclass
class ScheduleFile:
    path: Path
    schedules: list[Schedule]

    def get(self, name: str) -> Schedule:
        for schedule in self.schedules:
            if schedule.name == name:
                return schedule
        names = ", ".join(s.name for s in self.schedules) or "none"
        raise ConfigError(
            f"No schedule named {name!r} in {self.path}.", f"Schedules in this file: {names}."
        )


class ScheduleFileError(ConfigError):
    """A schedules file with problems; lists every one with its schedule and field."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        self.problems = problems
        plural = "s" if len(problems) > 1 else ""
        super().__init__(
            f"{path}: {len(problems)} problem{plural}:\n" + "\n".join(f"  - {p}" for p in problems),
            "Fix the fields named above, then run `orchestrator schedule validate`.",
        )


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


def load_schedules(
    path: str | Path | None = None,
    *,
    check_payloads: bool = True,
    only: str | None = None,
    now: datetime | None = None,
) -> ScheduleFile:
    """Read and validate a schedules file; raise `ScheduleFileError` listing every problem.

    With `check_payloads`, paths must exist and each payload's manifest, model, network,
    limits and secrets are checked exactly as a firing would, so a broken schedule fails at
    validation, not at three in the morning. Without it (a firing), those problems surface in
    the firing instead, where they are recorded and notified. `only` validates just the named
    schedule, so one broken table does not stop the others' cron lines.
    """
    path = Path(path or DEFAULT_FILE).expanduser().absolute()
    if not path.is_file():
        raise ConfigError(
            f"No schedules file at {path}.",
            "Pass --file PATH, or start from schedules.example.toml.",
        )
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ScheduleFileError(path, [f"not valid TOML ({exc})"]) from exc
    problems: list[str] = []
    unknown = set(data) - {"schedule"}
    if unknown:
        problems.append(
            f"unknown top-level key(s) {sorted(unknown)}; schedules are [[schedule]] tables"
        )
    tables = data.get("schedule", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ScheduleFileError(path, ["`schedule` must be an array of tables: [[schedule]]"])
    schedules: list[Schedule] = []
    seen: set[str] = set()
    if only is not None:
        tables = [t for t in tables if t.get("name") == only]
        if not tables:
            raise ConfigError(f"No schedule named {only!r} in {path}.", "Check the name.")
    for index, table in enumerate(tables, 1):
        schedule, errors = _parse_schedule(path, index, table, check_payloads, now)
        name = table.get("name")
        if isinstance(name, str) and name in seen:
            errors.append(f'schedule "{name}" field `name`: used twice; names must be unique')
        if isinstance(name, str):
            seen.add(name)
        problems.extend(errors)
        if schedule is not None and not errors:
            schedules.append(schedule)
    if problems:
        raise ScheduleFileError(path, problems)
    return ScheduleFile(path=path, schedules=schedules)


def _parse_schedule(
    path: Path, index: int, t: dict[str, Any], check_payloads: bool, now: datetime | None
) -> tuple[Schedule | None, list[str]]:
    errors: list[str] = []
    raw_name = t.get("name")
    label = f'schedule "{raw_name}"' if isinstance(raw_name, str) else f"schedule #{index}"

    def bad(field_name: str, problem: str) -> None:
        errors.append(f"{label} field `{field_name}`: {problem}")

    def get(key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        value = t.get(key, default)
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if value is None or (isinstance(value, bool) and bool not in kinds):
            if value is not None:
                bad(key, f"must be {_kind(kinds)}, not a boolean")
                return default
            return value
        if not isinstance(value, kinds):
            bad(key, f"must be {_kind(kinds)}, got {type(value).__name__} {value!r}")
            return default
        return value

    for key in t:
        if key not in _KEYS:
            bad(key, f"is not a known field (allowed: {', '.join(sorted(_KEYS))})")
    name = get("name", str)
    if name is None:
        bad("name", "is required")
    elif not _NAME_RE.match(name):
        bad("name", f"{name!r} must be letters, digits, `_`, `.` or `-` (up to 63)")

    tz_name = get("timezone", str, "UTC")
    tz: ZoneInfo | None = None
    try:
        tz = ZoneInfo(tz_name or "UTC")
    except (ZoneInfoNotFoundError, ValueError):
        bad("timezone", f"{tz_name!r} is not an IANA time zone (e.g. Europe/Berlin, UTC)")
    cron_text = get("cron", str)
    cron: Cron | None = None
    if cron_text is None:
        bad("cron", "is required (5 fields, e.g. `*/15 * * * *`, or @hourly/@daily/...)")
    elif tz is not None:
        try:
            cron = Cron(cron_text, tz)
        except ValueError as exc:
            bad("cron", str(exc))

    base = path.parent

    def local_path(key: str, must_be_dir: bool = False) -> Path | None:
        value = get(key, str)
        if value is None:
            return None
        resolved = (base / Path(value).expanduser()).absolute()
        ok = resolved.is_dir() if must_be_dir else resolved.is_file()
        if check_payloads and not ok:
            bad(key, f"{resolved} does not exist" + (" (a payload folder)" if must_be_dir else ""))
        return resolved

    payload = local_path("payload", must_be_dir=True)
    if t.get("payload") is None:
        bad("payload", "is required (a payload folder holding manifest.toml)")
    task = get("task", str)
    task_file = local_path("task_file")
    if task is not None and t.get("task_file") is not None:
        bad("task_file", "give either `task` or `task_file`, not both")
    env_file = local_path("env_file")
    model = get("model", str, "mock") or "mock"
    backend = get("backend", str)  # None: the payload's, else docker
    network = get("network", str)
    allow_hosts = _str_list(get("allow_hosts", list, []), "allow_hosts", bad)
    secrets = _str_list(get("secrets", list, []), "secrets", bad)
    for secret in secrets:
        if not _ENV_RE.match(secret):
            bad("secrets", f"{secret!r} is not an environment variable name")
    limits: dict[str, Any] = {}
    for key, value in (get("limits", dict, {}) or {}).items():
        kind = _LIMIT_KEYS.get(key)
        if kind is None:
            bad(f"limits.{key}", f"is not a known limit (allowed: {', '.join(_LIMIT_KEYS)})")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            bad(f"limits.{key}", f"must be a number, got {value!r}")
        elif kind is int and not isinstance(value, int):
            bad(f"limits.{key}", f"must be a whole number, got {value!r}")
        else:
            limits[key] = kind(value)
    concurrency = get("concurrency", str, "forbid")
    if concurrency not in CONCURRENCY:
        bad("concurrency", f"{concurrency!r} must be one of {', '.join(CONCURRENCY)}")
    missed = get("missed", str, "skip")
    if missed not in MISSED:
        bad("missed", f"{missed!r} must be one of {', '.join(MISSED)}")
    deadline: float | None = None
    if t.get("missed_deadline") is not None:
        try:
            deadline = parse_duration(t["missed_deadline"])
        except ValueError as exc:
            bad("missed_deadline", str(exc))
    notify = _parse_notify(get("notify", dict), bad)
    enabled = get("enabled", bool, True)

    if errors and cron is not None:  # help the user check the expression while fixing
        errors.append(f"{label}: next five fire times: {_fmt_times(cron, now)}")
    if errors or name is None or cron is None or payload is None:
        return None, errors
    schedule = Schedule(
        name=name,
        cron=cron,
        timezone=tz_name or "UTC",
        payload=payload,
        source=path,
        task=task,
        task_file=task_file,
        model=model,
        api_base=get("api_base", str),
        model_key_env=get("model_key_env", str),
        backend=backend,
        network=network,
        allow_hosts=tuple(allow_hosts),
        limits=limits,
        secrets=tuple(secrets),
        env_file=env_file,
        additional_args=get("additional_args", dict),
        concurrency=concurrency,
        missed=missed,
        missed_deadline=deadline,
        notify=notify,
        enabled=bool(enabled),
    )
    if check_payloads and not errors:
        errors.extend(check_schedule(schedule))
        if errors:
            errors.append(f"{label}: next five fire times: {_fmt_times(cron, now)}")
            return None, errors
    return schedule, errors


def check_schedule(schedule: Schedule) -> list[str]:
    """Check a schedule against its payload the way a firing will; problems as strings."""
    from .manifest import load_manifest
    from .models import parse_model
    from .runner import resolve_network

    errors: list[str] = []
    label = f'schedule "{schedule.name}"'
    try:
        manifest = load_manifest(schedule.payload)
    except OrchestratorError as exc:
        return [f"{label} field `payload`: {exc.cause}"]
    if manifest.dangerous_imports():
        errors.append(
            f"{label} field `payload`: the manifest authorizes dangerous imports "
            f"{manifest.dangerous_imports()}, which scheduled runs refuse"
        )
    try:
        model = parse_model(
            schedule.model, api_base=schedule.api_base, credential_env=schedule.model_key_env
        )
    except OrchestratorError as exc:
        return [*errors, f"{label} field `model`: {exc.cause}"]
    try:
        spec = schedule.run_spec()
    except OrchestratorError as exc:
        return [*errors, exc.cause]
    try:
        resolve_network(spec, manifest, model)
    except OrchestratorError as exc:
        errors.append(
            f"{label} field `network`: {exc.cause} Set network to none, allowlist or open."
        )
    try:
        limits = replace(manifest.limits, **schedule.limits)
        limits.validate(f"{label} field `limits`")
    except OrchestratorError as exc:
        errors.append(f"{exc.cause} {exc.fix}")
    if spec.task is None and not manifest.example_task:
        errors.append(f"{label} field `task`: is required (the payload has no example_task)")
    if schedule.backend is not None and schedule.backend not in BACKENDS:
        errors.append(f"{label} field `backend`: {schedule.backend!r} must be one of {BACKENDS}")
    try:
        schedule.check_secrets()
    except OrchestratorError as exc:
        errors.append(exc.cause)
    return errors


def _parse_notify(table: dict[str, Any] | None, bad: Callable[[str, str], None]) -> Notify | None:
    if table is None:
        return None
    for key in table:
        if key not in _NOTIFY_KEYS:
            bad(
                f"notify.{key}",
                f"is not a known field (allowed: {', '.join(sorted(_NOTIFY_KEYS))})",
            )
    command: tuple[str, ...] = ()
    raw = table.get("command")
    if isinstance(raw, str):
        try:
            command = tuple(shlex.split(raw))
        except ValueError as exc:
            bad("notify.command", f"cannot be split into arguments ({exc})")
    elif isinstance(raw, list) and raw and all(isinstance(a, str) for a in raw):
        command = tuple(raw)
    elif raw is not None:
        bad("notify.command", "must be a string or a non-empty list of strings")
    webhook = table.get("webhook")
    if webhook is not None and (
        not isinstance(webhook, str) or not webhook.startswith(("http://", "https://"))
    ):
        bad("notify.webhook", f"{webhook!r} must be an http:// or https:// URL")
        webhook = None
    if not command and not webhook and raw is None:
        bad("notify", "needs `command` or `webhook`")
    timeout = table.get("timeout_seconds", NOTIFY_TIMEOUT)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 600:
        bad("notify.timeout_seconds", f"{timeout!r} must be a number of seconds from 1 to 600")
        timeout = NOTIFY_TIMEOUT
    on = table.get("on", ["failure"])
    if isinstance(on, str):
        on = [on]
    if not isinstance(on, list) or any(o not in NOTIFY_ON for o in on):
        bad("notify.on", f"{on!r} must list some of {', '.join(NOTIFY_ON)}")
        on = ["failure"]
    return Notify(
        command=command, webhook=webhook, timeout_seconds=float(timeout), on=frozenset(on)
    )


def _str_list(value: Any, key: str, bad: Callable[[str, str], None]) -> list[str]:
    if not value:
        return []
    if not all(isinstance(v, str) for v in value):
        bad(key, "must be a list of strings")
        return []
    return list(value)


def _kind(kinds: tuple[type, ...]) -> str:
    names = {
        str: "a string",
        list: "a list",
        dict: "a table",
        int: "an integer",
        float: "a number",
        bool: "true or false",
    }
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _fmt_times(cron: Cron, now: datetime | None = None) -> str:
    try:
        times = cron.next_times(now or datetime.now(timezone.utc), 5)
    except ValueError as exc:
        return str(exc)
    return ", ".join(local_iso(t, cron.tz) for t in times)


def local_iso(instant: datetime, tz: ZoneInfo) -> str:
    return instant.astimezone(tz).isoformat(timespec="minutes")


def utc_iso(instant: datetime) -> str:
    return instant.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- clock ------------------------------------------------------------------------------------


class Clock(Protocol):
    """Time as the scheduler sees it; tests inject one that jumps instead of sleeping."""

    def now(self) -> datetime:
        """The current instant, timezone-aware."""
        ...

    def sleep(self, seconds: float, stop: threading.Event) -> bool:
        """Wait up to `seconds`; return True when `stop` is set (then return at once)."""
        ...


class SystemClock:
    def now(self) -> datetime:
        return datetime.now(timezone.utc)

    def sleep(self, seconds: float, stop: threading.Event) -> bool:
        return stop.wait(max(0.0, seconds))


# --- records ----------------------------------------------------------------------------------

SCHEMA = """
CREATE TABLE IF NOT EXISTS schedule_firings (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    schedule      TEXT NOT NULL,
    scheduled_for REAL,             -- the cron instant (UTC epoch), NULL for on-demand runs
    fired_at      REAL NOT NULL,
    trigger       TEXT NOT NULL,    -- serve | cron | catch-up | manual
    outcome       TEXT NOT NULL,    -- running | <run status> | skipped | missed | error | lost
    reason        TEXT,
    run_id        TEXT,
    exit_code     INTEGER,
    ended_at      REAL,
    owner         TEXT,             -- host:pid:start of the process that fired
    cancel_requested INTEGER NOT NULL DEFAULT 0
);
CREATE UNIQUE INDEX IF NOT EXISTS schedule_firings_once
    ON schedule_firings(schedule, scheduled_for) WHERE scheduled_for IS NOT NULL;
CREATE INDEX IF NOT EXISTS schedule_firings_by_name ON schedule_firings(schedule, fired_at);
CREATE TABLE IF NOT EXISTS schedule_notifications (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    firing_id INTEGER NOT NULL,
    schedule  TEXT NOT NULL,
    run_id    TEXT,
    outcome   TEXT,
    kind      TEXT NOT NULL,        -- command | webhook
    target    TEXT NOT NULL,
    at        REAL NOT NULL,
    ok        INTEGER NOT NULL,
    detail    TEXT
);
"""


@dataclass
class Firing:
    """What one firing did; `exit_code` is what `schedule run` exits with."""

    id: int | None
    schedule: str
    outcome: str
    trigger: str
    scheduled_for: datetime | None = None
    fired_at: datetime | None = None
    run_id: str | None = None
    exit_code: int = 0
    reason: str | None = None
    duration: float | None = None
    result: RunResult | None = None


def _epoch(instant: datetime | None) -> float | None:
    return None if instant is None else instant.timestamp()


class ScheduleStore:
    """The schedule tables, in the run store's SQLite file (one history for all processes)."""

    def __init__(self, store: Store | None = None) -> None:
        self.store = store or Store()
        self.locks_dir = self.store.root / "schedules" / "locks"
        self.locks_dir.mkdir(parents=True, exist_ok=True)
        with self.store.connect() as db:  # not executescript: it COMMITs the transaction
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)

    def lock(self, name: str) -> FileLock:
        """The per-schedule lock; flock-based, so a dead holder never keeps it."""
        return FileLock(str(self.locks_dir / f"{name}.lock"))

    def claim(
        self,
        name: str,
        scheduled_for: datetime | None,
        fired_at: datetime,
        trigger: str,
        owner: str,
        outcome: str = "running",
        reason: str | None = None,
        run_id: str | None = None,
    ) -> int | None:
        """Insert a firing row; None when this fire time was already handled elsewhere."""
        with self.store.connect() as db:
            cursor = db.execute(
                "INSERT OR IGNORE INTO schedule_firings (schedule, scheduled_for, fired_at, "
                "trigger, outcome, reason, owner, run_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    name,
                    _epoch(scheduled_for),
                    _epoch(fired_at),
                    trigger,
                    outcome,
                    reason,
                    owner,
                    run_id,
                ),
            )
            return cursor.lastrowid if cursor.rowcount == 1 else None

    def update(self, firing_id: int, **fields: Any) -> None:
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self.store.connect() as db:
            db.execute(
                f"UPDATE schedule_firings SET {sets} WHERE id = ?", [*fields.values(), firing_id]
            )

    def running(self, name: str) -> list[dict[str, Any]]:
        with self.store.connect() as db:
            rows = db.execute(
                "SELECT * FROM schedule_firings WHERE schedule = ? AND outcome = 'running' "
                "ORDER BY fired_at",
                (name,),
            ).fetchall()
        return [dict(r) for r in rows]

    def reap_lost(self, name: str, keep: int) -> None:
        """Close `running` rows whose process died (kill -9, power loss) as `lost`."""
        from .cleanup import owner_alive

        for row in self.running(name):
            if row["id"] != keep and not owner_alive(row["owner"] or ""):
                self.update(
                    row["id"],
                    outcome="lost",
                    ended_at=time.time(),
                    exit_code=EXIT_CODES["infra_error"],
                    reason="the firing process died during the run",
                )

    def request_cancel(self, name: str, requester: int) -> None:
        """Flag every other running firing of `name` for cancellation (`replace`)."""
        with self.store.connect() as db:
            db.execute(
                "UPDATE schedule_firings SET cancel_requested = 1 "
                "WHERE schedule = ? AND outcome = 'running' AND id != ?",
                (name, requester),
            )

    def cancel_requested(self, firing_id: int) -> bool:
        with self.store.connect() as db:
            row = db.execute(
                "SELECT cancel_requested FROM schedule_firings WHERE id = ?", (firing_id,)
            ).fetchone()
        return bool(row and row[0])

    def last_scheduled_for(self, name: str) -> datetime | None:
        """The latest fire time handled (fired, skipped or recorded missed) by anyone."""
        with self.store.connect() as db:
            row = db.execute(
                "SELECT MAX(scheduled_for) FROM schedule_firings WHERE schedule = ?", (name,)
            ).fetchone()
        return None if row[0] is None else datetime.fromtimestamp(row[0], timezone.utc)

    def history(self, name: str | None = None, limit: int = 20) -> list[dict[str, Any]]:
        where, args = ("WHERE schedule = ?", [name]) if name else ("", [])
        with self.store.connect() as db:
            rows = db.execute(
                f"SELECT * FROM schedule_firings {where} ORDER BY fired_at DESC, id DESC LIMIT ?",
                [*args, limit],
            ).fetchall()
        return [dict(r) for r in rows]

    def last_firing(self, name: str) -> dict[str, Any] | None:
        rows = self.history(name, limit=1)
        return rows[0] if rows else None

    def record_notification(
        self, firing: Firing, kind: str, target: str, ok: bool, detail: str
    ) -> None:
        with self.store.connect() as db:
            db.execute(
                "INSERT INTO schedule_notifications (firing_id, schedule, run_id, outcome, kind, "
                "target, at, ok, detail) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    firing.id or 0,
                    firing.schedule,
                    firing.run_id,
                    firing.outcome,
                    kind,
                    target,
                    time.time(),
                    int(ok),
                    detail[:2000],
                ),
            )

    def notifications(self, name: str, limit: int = 20) -> list[dict[str, Any]]:
        with self.store.connect() as db:
            rows = db.execute(
                "SELECT * FROM schedule_notifications WHERE schedule = ? ORDER BY id DESC LIMIT ?",
                (name, limit),
            ).fetchall()
        return [dict(r) for r in rows]


# --- one firing -------------------------------------------------------------------------------

RunFunction = Callable[..., RunResult]


def default_run(spec: RunSpec, **kwargs: Any) -> RunResult:
    from .runner import run

    return run(spec, **kwargs)


def print_log(line: str) -> None:
    print(line, flush=True)


def firing_line(firing: Firing, schedule: Schedule, now: datetime) -> str:
    """The one log line per firing: grep-able key=value pairs, UTC timestamp first."""
    parts = [utc_iso(now), f"schedule={schedule.name}", f"trigger={firing.trigger}"]
    if firing.scheduled_for is not None:
        parts.append(f"scheduled={local_iso(firing.scheduled_for, schedule.cron.tz)}")
    parts.append(f"outcome={firing.outcome}")
    if firing.run_id:
        parts.append(f"run={firing.run_id}")
    parts.append(f"exit={firing.exit_code}")
    if firing.duration is not None:
        parts.append(f"duration={firing.duration:.1f}s")
    if firing.reason:
        parts.append(f"reason={json.dumps(' '.join(firing.reason.split())[:300])}")
    return " ".join(parts)


def fire(
    schedule: Schedule,
    *,
    store: ScheduleStore,
    trigger: str = "manual",
    scheduled_for: datetime | None = None,
    clock: Clock | None = None,
    run_fn: RunFunction | None = None,
    cancel: threading.Event | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    on_progress: Callable[[str], None] | None = None,
    log: Log = print_log,
    replace_wait: float = REPLACE_WAIT,
) -> Firing:
    """Fire a schedule once: claim the fire time, apply the concurrency rule, run, record,
    notify. Never raises for a run's failure (only re-raises Ctrl-C/SIGTERM after recording)."""
    from .runner import owner_label

    clock = clock or SystemClock()
    run_fn = run_fn or default_run
    cancel = cancel or threading.Event()
    now = clock.now()
    # The run id is known from the claim on, so a skipped rival can always name it.
    firing = Firing(None, schedule.name, "running", trigger, scheduled_for, now, new_run_id())
    firing.id = store.claim(
        schedule.name, scheduled_for, now, trigger, owner_label(), run_id=firing.run_id
    )
    if firing.id is None:  # serve and a cron line (or two cron lines) chose the same instant
        firing.run_id = None
        firing.outcome, firing.reason = "duplicate", "this fire time was already handled"
        log(firing_line(firing, schedule, now))
        return firing
    try:
        return _fire_claimed(
            schedule, firing, store, clock, run_fn, cancel, on_event, on_progress, log, replace_wait
        )
    except BaseException as exc:  # never leave the row `running` (SIGTERM while waiting, ...)
        with contextlib.suppress(Exception):
            if firing.outcome == "running":
                cancelled = isinstance(exc, (KeyboardInterrupt, RunCancelled))
                store.update(
                    firing.id,
                    outcome="cancelled" if cancelled else "error",
                    reason=f"{type(exc).__name__}: {exc}"[:500],
                    ended_at=time.time(),
                )
        raise


def _fire_claimed(
    schedule: Schedule,
    firing: Firing,
    store: ScheduleStore,
    clock: Clock,
    run_fn: RunFunction,
    cancel: threading.Event,
    on_event: Callable[[dict[str, Any]], None] | None,
    on_progress: Callable[[str], None] | None,
    log: Log,
    replace_wait: float,
) -> Firing:
    assert firing.id is not None
    lock = None if schedule.concurrency == "allow" else store.lock(schedule.name)
    if lock is not None and not _acquire(lock, schedule, store, firing, replace_wait):
        holders = [r["run_id"] for r in store.running(schedule.name) if r["id"] != firing.id] or [
            "unknown"
        ]
        firing.run_id = None
        firing.outcome, firing.exit_code = "skipped", EXIT_SKIPPED
        firing.reason = f"previous run still going ({', '.join(holders)})"
        if schedule.concurrency == "replace":
            firing.reason = f"previous run did not stop within {replace_wait:.0f}s"
        store.update(
            firing.id,
            outcome="skipped",
            run_id=None,
            reason=firing.reason,
            exit_code=EXIT_SKIPPED,
            ended_at=time.time(),
        )
        log(firing_line(firing, schedule, clock.now()))
        _maybe_notify(schedule, firing, store, log)
        return firing

    interrupted: BaseException | None = None
    started = time.monotonic()
    try:
        store.reap_lost(schedule.name, keep=firing.id)
        replaceable = schedule.concurrency == "replace"
        watcher = _CancelWatcher(store, firing.id, cancel) if replaceable else None
        try:
            schedule.check_secrets()
            spec = schedule.run_spec(firing.run_id)
            result = run_fn(
                spec, cancel=cancel, store=store.store, on_event=on_event, on_progress=on_progress
            )
        except OrchestratorError as exc:  # bad input: nothing was started
            firing.outcome, firing.exit_code = "error", exc.exit_code
            firing.reason = f"{exc.cause} {exc.fix}".strip()
        except (KeyboardInterrupt, RunCancelled) as exc:
            interrupted = exc
            firing.outcome, firing.exit_code = "cancelled", EXIT_CODES["cancelled"]
            firing.reason = "interrupted (SIGINT/SIGTERM)"
        except Exception as exc:  # an engine problem the runner did not turn into a status
            firing.outcome, firing.exit_code = "error", EXIT_CODES["infra_error"]
            firing.reason = f"{type(exc).__name__}: {exc}"
        else:
            firing.result = result
            firing.outcome, firing.exit_code = result.status, result.cli_exit_code
            if result.error:
                firing.reason = str(result.error.get("message") or result.error.get("type"))
            if watcher is not None and watcher.replaced:
                firing.reason = "replaced by a newer firing"
        finally:
            if watcher is not None:
                watcher.stop()
        if firing.run_id and store.store.get_run(firing.run_id) is None:
            firing.run_id = None  # refused before the run existed: no record to point at
        firing.duration = time.monotonic() - started
        store.update(
            firing.id,
            outcome=firing.outcome,
            run_id=firing.run_id,
            exit_code=firing.exit_code,
            reason=firing.reason,
            ended_at=time.time(),
        )
    finally:
        if lock is not None:
            lock.release()
    log(firing_line(firing, schedule, clock.now()))
    if interrupted is not None:
        raise interrupted
    _maybe_notify(schedule, firing, store, log)
    return firing


def _acquire(
    lock: FileLock, schedule: Schedule, store: ScheduleStore, firing: Firing, wait: float
) -> bool:
    """Take the schedule's lock now (forbid), or after cancelling the holder (replace)."""
    assert firing.id is not None
    try:
        lock.acquire(timeout=0)
        return True
    except Timeout:
        if schedule.concurrency != "replace":
            return False
    replaced = [r["run_id"] for r in store.running(schedule.name) if r["id"] != firing.id]
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        # Asked again each round: the holder may have claimed its row only just now.
        store.request_cancel(schedule.name, firing.id)
        try:
            lock.acquire(timeout=0.25)
        except Timeout:
            continue
        firing.reason = f"replaced {', '.join(filter(None, replaced)) or 'the running firing'}"
        return True
    return False


class _CancelWatcher:
    """Polls the store for a `replace` request aimed at this firing and cancels its run."""

    def __init__(self, store: ScheduleStore, firing_id: int, cancel: threading.Event) -> None:
        self.store, self.firing_id, self.cancel = store, firing_id, cancel
        self.replaced = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="schedule-cancel", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.25):
            try:
                if self.store.cancel_requested(self.firing_id):
                    self.replaced = True
                    self.cancel.set()
                    return
            except Exception:  # a busy database must not kill the run; try again
                continue

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# --- notification -----------------------------------------------------------------------------


def _maybe_notify(schedule: Schedule, firing: Firing, store: ScheduleStore, log: Log) -> None:
    notify = schedule.notify
    if notify is None:
        return
    kind = (
        "failure"
        if firing.outcome in FAILURES
        else "skip"
        if firing.outcome in ("skipped", "missed")
        else "success"
        if firing.outcome == "succeeded"
        else None
    )
    if kind is None or kind not in notify.on:
        return
    notify_firing(schedule, firing, store, log)


def notification_fields(schedule: Schedule, firing: Firing) -> dict[str, str]:
    return {
        "schedule": schedule.name,
        "run_id": firing.run_id or "",
        "status": firing.outcome,
        "exit_code": str(firing.exit_code),
        "reason": firing.reason or "",
        "trigger": firing.trigger,
        "scheduled_for": utc_iso(firing.scheduled_for) if firing.scheduled_for else "",
        "fired_at": utc_iso(firing.fired_at) if firing.fired_at else "",
        "firing_id": str(firing.id or ""),
        "host": socket.gethostname(),
        "record_dir": firing.result.record_dir if firing.result else "",
    }


def notify_firing(schedule: Schedule, firing: Firing, store: ScheduleStore, log: Log) -> None:
    """Tell someone about a firing. A notifier that fails or hangs is recorded and logged;
    it never raises into the scheduler."""
    assert schedule.notify is not None
    notify = schedule.notify
    fields = notification_fields(schedule, firing)
    attempts: list[tuple[str, str, Callable[[], str]]] = []
    if notify.command:
        argv = [_substitute(a, fields) for a in notify.command]
        attempts.append(
            (
                "command",
                shlex.join(argv),
                lambda: _notify_command(
                    argv, fields, notify.timeout_seconds, schedule.source.parent
                ),
            )
        )
    if notify.webhook:
        url = notify.webhook
        attempts.append(
            ("webhook", url, lambda: _notify_webhook(url, fields, notify.timeout_seconds))
        )
    for kind, target, attempt in attempts:
        try:
            detail, ok = attempt(), True
        except Exception as exc:  # noqa: BLE001 - every notifier failure is recorded, none raised
            detail, ok = f"{type(exc).__name__}: {exc}", False
        try:
            store.record_notification(firing, kind, target, ok, detail)
        except Exception as exc:  # the store itself failing must not break the schedule either
            detail += f" (not recorded: {exc})"
        if not ok:
            log(
                f"{utc_iso(datetime.now(timezone.utc))} schedule={schedule.name} "
                f"notify={kind} ok=false run={firing.run_id or '-'} "
                f"detail={json.dumps(detail[:300])}"
            )


def _substitute(arg: str, fields: dict[str, str]) -> str:
    for key, value in fields.items():
        arg = arg.replace("{" + key + "}", value)
    return arg


def _notify_command(argv: list[str], fields: dict[str, str], timeout: float, cwd: Path) -> str:
    env = {**os.environ, **{f"ORCHESTRATOR_{k.upper()}": v for k, v in fields.items()}}
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)  # the whole group: a shell's children too
        proc.communicate()
        raise TimeoutError(f"the notify command did not finish within {timeout:.0f}s") from None
    text = out.decode("utf-8", errors="replace").strip()[-500:]
    if proc.returncode != 0:
        raise RuntimeError(f"the notify command exited with {proc.returncode}: {text}")
    return f"exit 0: {text}" if text else "exit 0"


def _notify_webhook(url: str, fields: dict[str, str], timeout: float) -> str:
    body = json.dumps({**fields, "exit_code": int(fields["exit_code"])}).encode()
    request = urllib.request.Request(
        url,
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", "User-Agent": "orchestrator-schedules"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
        return f"HTTP {response.status}"


# --- deciding what is due ---------------------------------------------------------------------


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
    schedule: Schedule, p: Plan, store: ScheduleStore, now: datetime, trigger: str, log: Log
) -> None:
    if not p.missed or p.missed_last is None:
        return
    from .runner import owner_label

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
    _maybe_notify(schedule, firing, store, log)


def run_due(
    schedule: Schedule,
    *,
    store: ScheduleStore,
    clock: Clock | None = None,
    catch_up: bool = False,
    log: Log = print_log,
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


# --- serve ------------------------------------------------------------------------------------


class Scheduler:
    """A foreground scheduler: fires due schedules, each firing in its own thread (so a
    long run never delays another schedule), survives any job's failure, and on start
    applies the missed-run rule from the last recorded firing."""

    def __init__(
        self,
        schedules: list[Schedule],
        *,
        store: ScheduleStore | None = None,
        clock: Clock | None = None,
        run_fn: RunFunction | None = None,
        spawn: Callable[[Callable[[], None]], None] | None = None,
        log: Log = print_log,
        late_tolerance: float = LATE_TOLERANCE,
        max_sleep: float = 60.0,
    ) -> None:
        self.schedules = [s for s in schedules if s.enabled]
        self.store = store or ScheduleStore()
        self.clock = clock or SystemClock()
        self.run_fn = run_fn
        self.log = log
        self.late_tolerance = late_tolerance
        self.max_sleep = max_sleep
        self._spawn = spawn or self._thread
        self._threads: list[threading.Thread] = []
        self._cancels: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self.last: dict[str, datetime | None] = {}

    def _thread(self, job: Callable[[], None]) -> None:
        thread = threading.Thread(target=job, name="schedule-firing", daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def start(self) -> None:
        """Remember where each schedule left off (None: never fired, nothing to catch up)."""
        now = self.clock.now()
        for schedule in self.schedules:
            last = self.store.last_scheduled_for(schedule.name)
            self.last[schedule.name] = last if last is not None else now

    def tick(self) -> None:
        """Fire everything due now; a failure in one schedule never stops the others."""
        now = self.clock.now()
        for schedule in self.schedules:
            try:
                p = plan(
                    schedule, self.last.get(schedule.name), now, late_tolerance=self.late_tolerance
                )
                if p.fire_at is not None:
                    self.last[schedule.name] = p.fire_at
                elif p.missed_last is not None:
                    self.last[schedule.name] = p.missed_last
                record_missed(schedule, p, self.store, now, "serve", self.log)
                if p.fire_at is not None:
                    self._launch(schedule, p.fire_at, p.trigger)
            except Exception as exc:  # noqa: BLE001 - the scheduler outlives any one schedule
                self.log(
                    f"{utc_iso(now)} schedule={schedule.name} scheduler_error="
                    f"{json.dumps(f'{type(exc).__name__}: {exc}')}"
                )

    def _launch(self, schedule: Schedule, at: datetime, trigger: str) -> None:
        cancel = threading.Event()
        key = id(cancel)
        with self._lock:  # registered before the thread starts: shutdown always sees it
            self._cancels[key] = cancel

        def job() -> None:
            try:
                fire(
                    schedule,
                    store=self.store,
                    trigger=trigger,
                    scheduled_for=at,
                    clock=self.clock,
                    run_fn=self.run_fn,
                    cancel=cancel,
                    log=self.log,
                )
            except BaseException as exc:  # noqa: BLE001 - logged; the loop goes on
                self.log(
                    f"{utc_iso(self.clock.now())} schedule={schedule.name} "
                    f"firing_error={json.dumps(f'{type(exc).__name__}: {exc}')}"
                )
            finally:
                with self._lock:
                    self._cancels.pop(key, None)

        self._spawn(job)

    def next_wake(self) -> datetime | None:
        times = [
            s.cron.next_after(max(filter(None, [self.last.get(s.name), self.clock.now()])))
            for s in self.schedules
        ]
        return min(times) if times else None

    def serve(self, stop: threading.Event, *, grace: float = 0.0) -> None:
        """Run until `stop` is set; then let running firings finish for `grace` seconds,
        cancel the rest (their sandboxes are removed, runs recorded `cancelled`) and return."""
        self.start()
        names = ", ".join(s.name for s in self.schedules) or "none"
        self.log(f"{utc_iso(self.clock.now())} serve started: schedules {names}")
        while not stop.is_set():
            self.tick()
            wake = self.next_wake()
            wait = self.max_sleep
            if wake is not None:
                wait = min(wait, max(0.0, (wake - self.clock.now()).total_seconds()))
            if self.clock.sleep(wait, stop):
                break
        self.shutdown(grace)
        self.log(f"{utc_iso(self.clock.now())} serve stopped")

    def shutdown(self, grace: float = 0.0) -> None:
        deadline = time.monotonic() + grace
        for thread in list(self._threads):
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._lock:
            for cancel in self._cancels.values():
                cancel.set()
        for thread in list(self._threads):
            thread.join(timeout=60)


# --- crontab ----------------------------------------------------------------------------------

CRONTAB_ENV = (
    "ORCHESTRATOR_BASE_IMAGE",
    "ORCHESTRATOR_WHEELHOUSE",
    "DOCKER_HOST",
    "DOCKER_CERT_PATH",
    "DOCKER_TLS_VERIFY",
)


def host_zone() -> ZoneInfo | None:
    """The zone cron itself runs in (/etc/localtime), or None if unknown."""
    try:
        with open("/etc/localtime", "rb") as f:
            return ZoneInfo.from_file(f, key="localtime")
    except (OSError, ValueError):
        return ZoneInfo("UTC") if not Path("/etc/localtime").exists() else None


def _same_offsets(a: ZoneInfo, b: ZoneInfo | None, now: datetime, modulo: int = 0) -> bool:
    """True when two zones agree for the next ~13 months (modulo: only up to whole hours)."""
    if b is None:
        return False
    start = now.replace(minute=0, second=0, microsecond=0)
    for hour in range(0, 24 * 400, 1):
        instant = start + timedelta(hours=hour)
        da, db = instant.astimezone(a).utcoffset(), instant.astimezone(b).utcoffset()
        assert da is not None and db is not None
        diff = (da - db).total_seconds()
        if (diff % modulo if modulo else diff) != 0:
            return False
    return True


def cron_times_field(schedule: Schedule, now: datetime, zone: ZoneInfo | None) -> str:
    """The crontab time fields that wake `schedule run --if-due` at (at least) every fire
    time. Same zone as cron and portable syntax: the expression itself. Otherwise the
    minute field alone when the zones differ by whole hours, else every minute."""
    fields = schedule.cron.fields
    if schedule.cron.portable and _same_offsets(schedule.cron.tz, zone, now):
        return " ".join(fields)
    if _PORTABLE_FIELD.match(fields[0]) and _same_offsets(schedule.cron.tz, zone, now, 3600):
        return f"{fields[0]} * * * *"
    return "* * * * *"


def _q(value: str | Path) -> str:
    return shlex.quote(str(value))


def crontab_block(
    sf: ScheduleFile,
    *,
    log_dir: Path | None = None,
    python: str | None = None,
    now: datetime | None = None,
    zone: ZoneInfo | None = None,
) -> list[str]:
    """The marker-delimited crontab lines for every enabled schedule of a file.

    Each line calls `schedule run NAME --if-due`: the crontab only wakes it; the decision
    (time zone, DST rule, dedupe) and the overlap lock are ours, so the result does not
    depend on which cron daemon reads it, and no `flock` binary is needed.
    """
    from .config import home_dir

    now = now or datetime.now(timezone.utc)
    zone = zone if zone is not None else host_zone()
    home = home_dir()
    log_dir = resolve_log_dir(log_dir)
    python = python or sys.executable
    env = {"ORCHESTRATOR_HOME": str(home)}
    env.update({k: os.environ[k] for k in CRONTAB_ENV if os.environ.get(k)})
    package_root = Path(__file__).resolve().parent.parent
    if not _importable_without(package_root, python):
        env["PYTHONPATH"] = str(package_root)
    envs = " ".join(f"{k}={_q(v)}" for k, v in env.items())
    begin, end = markers(sf.path)
    lines = [begin, "# Managed by `orchestrator schedule install`; edits inside are replaced."]
    for schedule in sf.schedules:
        if not schedule.enabled:
            lines.append(f"# {schedule.name}: disabled")
            continue
        times = cron_times_field(schedule, now, zone)
        log_file = log_dir / f"{schedule.name}.log"
        command = (
            f"mkdir -p {_q(log_dir)} && cd {_q(sf.path.parent)} && {envs} {_q(python)} "
            f"-m orchestrator schedule run {_q(schedule.name)} --if-due --file {_q(sf.path)} "
            f">> {_q(log_file)} 2>&1"
        )
        lines.append(f"# {schedule.name}: {schedule.cron.expression} ({schedule.timezone})")
        lines.append(f"{times} {command.replace('%', chr(92) + '%')}")  # % is a newline to cron
        if schedule.missed == "run-once":  # at boot, after the Docker daemon had a minute
            catch_up = command.replace("--if-due", "--catch-up")
            lines.append(f"@reboot sleep 60 && {catch_up}".replace("%", chr(92) + "%"))
    lines.append(end)
    return lines


def resolve_log_dir(log_dir: Path | None) -> Path:
    from .config import home_dir

    return (log_dir or home_dir() / "schedules" / "logs").absolute()


def _importable_without(package_root: Path, python: str) -> bool:
    """True when `python -m orchestrator` works from any directory (installed package)."""
    import site

    if python != sys.executable:
        return False
    roots = {Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()]}
    return package_root in roots


def markers(path: Path) -> tuple[str, str]:
    return (f"# >>> orchestrator schedules {path} >>>", f"# <<< orchestrator schedules {path} <<<")


def merge_crontab(existing: str, block: list[str], path: Path, *, remove: bool = False) -> str:
    """Replace (or add, or with `remove` drop) this file's block; keep every other line."""
    begin, end = markers(path)
    out: list[str] = []
    inside = False
    placed = False
    for line in existing.splitlines():
        if line.strip() == begin:
            inside = True
            if not remove:
                out.extend(block)
                placed = True
            continue
        if inside:
            if line.strip() == end:
                inside = False
            continue
        out.append(line)
    if not placed and not remove:
        if out and out[-1].strip():
            out.append("")
        out.extend(block)
    return "\n".join(out).rstrip("\n") + "\n" if out else ""


def crontab_command() -> list[str]:
    """The crontab program (`$ORCHESTRATOR_CRONTAB` overrides it, e.g. `crontab -u user`)."""
    return shlex.split(os.environ.get("ORCHESTRATOR_CRONTAB", "crontab"))


def read_crontab() -> str:
    try:
        proc = subprocess.run(
            [*crontab_command(), "-l"], capture_output=True, text=True, timeout=30
        )
    except FileNotFoundError as exc:
        raise ConfigError(
            f"No `{crontab_command()[0]}` program on this host.",
            "Install cron, or run `orchestrator schedule serve` (e.g. under systemd) instead.",
        ) from exc
    if proc.returncode != 0:
        if "no crontab" in (proc.stderr or "").lower():
            return ""
        raise ConfigError(f"`crontab -l` failed: {proc.stderr.strip()}", "")
    return proc.stdout


def write_crontab(text: str) -> None:
    proc = subprocess.run(
        [*crontab_command(), "-"], input=text, capture_output=True, text=True, timeout=30
    )
    if proc.returncode != 0:
        raise ConfigError(f"`crontab -` refused the new table: {proc.stderr.strip()}", "")


def install(
    sf: ScheduleFile, *, log_dir: Path | None = None, remove: bool = False
) -> tuple[str, list[str]]:
    """Merge this file's lines into the user's crontab (idempotent); return (table, block)."""
    block = crontab_block(sf, log_dir=log_dir)
    if not remove:
        resolve_log_dir(log_dir).mkdir(parents=True, exist_ok=True)
    current = read_crontab()
    merged = merge_crontab(current, block, sf.path, remove=remove)
    if merged != current:
        write_crontab(merged)
    return merged, block
