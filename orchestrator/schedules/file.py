"""The schedules file: `[[schedule]]` tables parsed and validated, every problem named."""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from orchestrator_runtime.protocol import ENV_NAME_RE

from ..errors import ConfigError, OrchestratorError
from ..manifest import decode_utf8
from ..policy import check_host_name
from ..spec import SETTABLE_LIMITS, RunSpec
from .cron import Cron, describe_next_times, parse_duration

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DEFAULT_FILE = "schedules.toml"


CONCURRENCY = ("forbid", "allow", "replace")


MISSED = ("skip", "run-once")


NOTIFY_ON = ("failure", "skip", "success")


NOTIFY_TIMEOUT = 30.0


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")




#: Fields of a [[schedule]] table.
_KEYS = {
    "name", "cron", "timezone", "payload", "task", "task_file", "model", "api_base",
    "model_key_env", "backend", "network", "allow_hosts", "limits", "secrets", "env_file",
    "additional_args", "concurrency", "missed", "missed_deadline", "notify", "enabled",
    "gateway",
}  # fmt: skip


_NOTIFY_KEYS = {"command", "webhook", "timeout_seconds", "on"}


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
    #: false: no model gateway, the key goes into the sandbox (`--no-gateway`).
    gateway: bool = True

    def read_task(self) -> str | None:
        """The task, read from `task_file` at firing time so edits need no reinstall."""
        if self.task_file is None:
            return self.task
        try:
            return decode_utf8(self.task_file.read_bytes()).strip()
        except OSError as exc:
            raise ConfigError(
                f'schedule "{self.name}" field `task_file`: cannot read {self.task_file} ({exc}).',
                "Fix the path (relative paths are relative to the schedules file).",
            ) from exc
        except ValueError as exc:
            raise ConfigError(
                f'schedule "{self.name}" field `task_file`: {self.task_file}: {exc}.',
                "Save the task file as UTF-8.",
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
            gateway=self.gateway,
            env_file=self.env_file or self.source.parent / ".env",
            schedule=self.name,
            run_id=run_id,
            **self.limits,
        )

    def check_secrets(self, needed: tuple[str, ...] | None = None, payload: str = "") -> None:
        """Refuse a run that would get a secret the schedule does not list.

        The runner hands a run exactly the payload's declared secrets plus the model's
        credential (`needed`; worked out by `runner.prepare` when not given); the schedule's
        `secrets` is the allow-list those must fit in, so a payload that starts asking for a
        new credential stops firing instead of silently getting it. Raises ConfigError.
        """
        if needed is None:
            from ..runner import prepare

            prepared = prepare(self.run_spec(), secret_values=False)
            needed, payload = prepared.secret_names, prepared.manifest.name
        extra = [n for n in needed if n not in self.secrets]
        if extra:
            error = ConfigError(
                f'schedule "{self.name}" field `secrets`: the run would get {", ".join(extra)} '
                f"(declared by the payload {payload} or the model {self.model}), "
                "which the schedule does not allow.",
                f"Add them to `secrets = [...]` of schedule {self.name!r} if it may use them.",
            )
            error.field = "secrets"
            raise error


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
        data = tomllib.loads(decode_utf8(path.read_bytes()))
    except ValueError as exc:  # not UTF-8, or not TOML (TOMLDecodeError): both name the line
        what = "not valid TOML" if isinstance(exc, tomllib.TOMLDecodeError) else "not UTF-8"
        raise ScheduleFileError(path, [f"{what}: {exc}"]) from exc
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
        names = [str(t.get("name")) for t in tables if t.get("name") is not None]
        tables = [t for t in tables if t.get("name") == only]
        if not tables:
            raise ConfigError(
                f"No schedule named {only!r} in {path}.",
                f"Schedules in this file: {', '.join(names) or 'none'}.",
            )
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
    for host in allow_hosts:
        problem = check_host_name(host)
        if problem:
            bad(
                "allow_hosts",
                f"{host!r} {problem}: list DNS names (api.example.com, *.example.com); for a "
                'model server on this machine set `api_base = "http://127.0.0.1:PORT/v1"` instead',
            )
    secrets = _str_list(get("secrets", list, []), "secrets", bad)
    for secret in secrets:
        if not ENV_NAME_RE.match(secret):
            bad("secrets", f"{secret!r} is not an environment variable name")
    limits: dict[str, Any] = {}
    for key, value in (get("limits", dict, {}) or {}).items():
        kind = SETTABLE_LIMITS.get(key)
        if kind is None:
            bad(f"limits.{key}", f"is not a known limit (allowed: {', '.join(SETTABLE_LIMITS)})")
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
        errors.append(f"{label}: next five fire times: {describe_next_times(cron, now)}")
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
        gateway=get("gateway", bool, True),
    )
    if check_payloads and not errors:
        errors.extend(check_schedule(schedule))
        if errors:
            errors.append(f"{label}: next five fire times: {describe_next_times(cron, now)}")
            return None, errors
    return schedule, errors


def check_schedule(schedule: Schedule) -> list[str]:
    """Check a schedule the way a firing will: the runner's own `prepare` (secret values are
    not read), then the schedule's secrets allow-list; problems as strings naming the field."""
    from ..runner import prepare

    label = f'schedule "{schedule.name}"'
    try:
        spec = schedule.run_spec()
        prepared = prepare(spec, secret_values=False, limits_from=f"{label} field `limits`")
        schedule.check_secrets(prepared.secret_names, prepared.manifest.name)
    except OrchestratorError as exc:
        message = f"{exc.cause} {exc.fix}".strip()
        if message.startswith(label):
            return [message]
        where = f"{label} field `{exc.field}`" if exc.field else label
        return [f"{where}: {message}"]
    return []


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
