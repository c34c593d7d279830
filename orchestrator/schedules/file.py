"""The schedules file: `[[schedule]]` tables parsed and validated, every problem named."""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from orchestrator_runtime.protocol import ENV_NAME_RE

from ..errors import ConfigError, OrchestratorError, Problem
from ..options import from_schedule, options_for, schedule_fields
from ..payloads.manifest import payload_path
from ..schema import Field, Table, TomlLines, check_table, decode_utf8
from ..spec import RunSpec
from .cron import Cron, describe_next_times, parse_duration
from .notify_table import NOTIFY_TABLE, Notify, parse_notify

if TYPE_CHECKING:
    from ..lifecycle.runner import PreparedRun

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DEFAULT_FILE = "schedules.toml"


CONCURRENCY = ("forbid", "allow", "replace")


MISSED = ("skip", "run-once")


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def _time_zone_problem(name: str) -> str | None:
    try:
        ZoneInfo(name or "UTC")
    except (ZoneInfoNotFoundError, ValueError):
        return "is not an IANA time zone"
    return None


#: A `[[schedule]]` table. Rules that need context (paths relative to the file, the cron line
#: in its time zone, a duration, what `notify` must hold) are checked by `_parse_schedule`
#: after it, into the same list; the payload's own checks run as a firing's would.
SCHEDULE = Table(
    {
        "name": Field(
            str,
            required=True,
            pattern=_NAME_RE,
            fix="Use letters, digits, `_`, `.` or `-` (up to 63), unique in the file.",
        ),
        "cron": Field(
            str,
            required=True,
            fix="It is required: 5 fields, e.g. `*/15 * * * *`, or @hourly/@daily/...",
        ),
        "timezone": Field(
            str,
            check=_time_zone_problem,
            fix="Use an IANA time zone name (Europe/Berlin, America/New_York, UTC).",
        ),
        "payload": Field(
            str, required=True, fix="It is required: a payload folder holding manifest.toml."
        ),
        "task": Field(str),
        "task_file": Field(str),
        **schedule_fields(),  # the run options (options.RUN_OPTIONS), limits in `limits`
        "secrets": Field(
            list,
            items=Field(str, pattern=ENV_NAME_RE, fix="Each must be an environment variable name."),
        ),
        "additional_args": Field(dict),
        "concurrency": Field(str, choices=CONCURRENCY),
        "missed": Field(str, choices=MISSED),
        "missed_deadline": Field((str, int, float)),
        "notify": Field(dict, table=NOTIFY_TABLE),
        "enabled": Field(bool),
    }
)

#: The file: `[[schedule]]` tables and nothing else.
FILE = Table(
    {"schedule": Field(list, items=Field(dict))},
    noun="table",
    brackets=True,
    unknown_fix="Schedules are [[schedule]] tables.",
)


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
    #: The run options the table sets (`options.RUN_OPTIONS`), as RunSpec fields (a path
    #: made absolute); one it leaves out is the payload's, else the default (the model: mock
    #: for a payload, a program's own models).
    run_options: dict[str, Any] = field(default_factory=dict)
    secrets: tuple[str, ...] = ()
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
            additional_args=self.additional_args,
            schedule=self.name,
            run_id=run_id,
            **{"env_file": self.source.parent / ".env", **self.run_options},
        )

    def check_secrets(self, prepared: PreparedRun | None = None) -> None:
        """Refuse a run that would get a secret the schedule does not list.

        The runner hands a run exactly the payload's declared secrets plus the model's
        credential (`prepared.secret_names`; the run is prepared here when not given); the
        schedule's `secrets` is the allow-list those must fit in, so a payload that starts
        asking for a new credential stops firing instead of silently getting it. Raises
        ConfigError naming who asks for each (`secrets.secret_owners`).
        """
        from ..payloads.secrets import secret_owners

        if prepared is None:
            from ..lifecycle.runner import prepare

            prepared = prepare(self.run_spec(), secret_values=False)
        owners = secret_owners(prepared.manifest, prepared.model)
        extra = [n for n in prepared.secret_names if n not in self.secrets]
        if extra:
            asked = ", ".join(f"{n} ({owners.get(n, 'the run')})" for n in extra)
            error = ConfigError(
                f'schedule "{self.name}" field `secrets`: the run would get {asked}, '
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
    """A schedules file with problems; lists every one with its schedule, field and line."""

    def __init__(
        self, path: Path, problems: Sequence[Problem | str], notes: Sequence[str] = ()
    ) -> None:
        """`notes`: help printed under the problems, not counted as one (a valid cron
        line's next fire times, to check it while fixing the rest)."""
        listed = [p if isinstance(p, Problem) else Problem("", p) for p in problems]
        made = ConfigError.of_problems(
            str(path),
            listed,
            "Fix the fields named above, then run `orchestrator schedule validate`.",
            listed=True,
        )
        super().__init__(made.cause + "".join(f"\n  {note}" for note in notes), made.fix)
        self.problems = made.problems
        self.source = made.source


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
        text = decode_utf8(path.read_bytes())
        data = tomllib.loads(text)
    except ValueError as exc:  # not UTF-8, or not TOML (TOMLDecodeError): both name the line
        what = "not valid TOML" if isinstance(exc, tomllib.TOMLDecodeError) else "not UTF-8"
        raise ScheduleFileError(path, [f"{what}: {exc}"]) from exc
    tables = data.get("schedule", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ScheduleFileError(path, ["`schedule` must be an array of tables: [[schedule]]"])
    lines = TomlLines(text)
    problems = [
        p.replace(message=f"{FILE.show(p.field)} {p.message}", line=lines.line(p.field))
        for p in check_table(FILE, {k: v for k, v in data.items() if k != "schedule"})[1]
    ]
    numbered = list(enumerate(tables, 1))  # `schedule[N]` counts every table, `only` or not
    if only is not None:
        names = [str(t.get("name")) for t in tables if t.get("name") is not None]
        numbered = [(i, t) for i, t in numbered if t.get("name") == only]
        if not numbered:
            raise ConfigError(
                f"No schedule named {only!r} in {path}.",
                f"Schedules in this file: {', '.join(names) or 'none'}.",
            )
    schedules: list[Schedule] = []
    seen: set[str] = set()
    notes: list[str] = []
    for index, table in numbered:
        schedule, errors = _parse_schedule(path, index, table, check_payloads, now)
        if errors and (cron := _valid_cron(table)) is not None:  # help check it while fixing
            label = (
                f'schedule "{table["name"]}"'
                if isinstance(table.get("name"), str)
                else (f"schedule #{index}")
            )
            notes.append(f"{label}: next five fire times: {describe_next_times(cron, now)}")
        name = table.get("name")
        if isinstance(name, str) and name in seen:
            errors.append(
                Problem(
                    f"schedule[{index}].name",
                    f'schedule "{name}" field `name`: used twice; names must be unique',
                )
            )
        if isinstance(name, str):
            seen.add(name)
        problems.extend(p.replace(line=lines.line(p.field)) for p in errors)
        if schedule is not None and not errors:
            schedules.append(schedule)
    if problems:
        ordered: list[Problem] = sorted(problems, key=lambda p: p.line or 0)
        raise ScheduleFileError(path, ordered, notes)
    return ScheduleFile(path=path, schedules=schedules)


def _parse_schedule(
    path: Path, index: int, t: dict[str, Any], check_payloads: bool, now: datetime | None
) -> tuple[Schedule | None, list[Problem]]:
    """One `[[schedule]]` table (the `index`th), checked against `SCHEDULE` and the rules
    that need context; problems name the schedule by name (else number) and field."""
    raw_name = t.get("name")
    label = f'schedule "{raw_name}"' if isinstance(raw_name, str) else f"schedule #{index}"
    values, found = check_table(SCHEDULE, t)
    errors: list[Problem] = []

    def bad(field_name: str, phrase: str, fix: str = "") -> None:
        errors.append(
            Problem(
                f"schedule[{index}].{field_name}", f"{label} field `{field_name}`: {phrase}", fix
            )
        )

    for problem in found:
        bad(problem.field, problem.message, problem.fix)
    name = values.get("name")
    tz_name = values.get("timezone") or "UTC"
    cron: Cron | None = None
    if "cron" in values and ("timezone" in values or "timezone" not in t):
        try:
            cron = Cron(values["cron"], ZoneInfo(tz_name))
        except ValueError as exc:
            bad("cron", str(exc))

    base = path.parent

    def local_path(key: str, must_be_dir: bool = False) -> Path | None:
        value = values.get(key)
        if value is None:
            return None
        resolved = (base / Path(value).expanduser()).absolute()
        if key == "payload":  # as `run` takes it: a bare name may be a shipped example
            resolved = payload_path(value, base).absolute()
        ok = resolved.is_dir() if must_be_dir else resolved.is_file()
        if key == "payload":  # a payload folder, or a program (a .py file)
            ok = resolved.is_dir() or (resolved.is_file() and resolved.suffix == ".py")
        if check_payloads and not ok:
            bad(
                key,
                f"{resolved} does not exist"
                + (" (a payload folder, or a program's .py file)" if must_be_dir else ""),
                PAYLOAD_FIX if key == "payload" else "",
            )
        return resolved

    payload = local_path("payload", must_be_dir=True)
    task_file = local_path("task_file")
    if "task" in t and "task_file" in t:
        bad("task_file", "give either `task` or `task_file`, not both")
    run_options = from_schedule(values)
    for option in options_for("schedule"):
        if option.path and option.name in run_options:
            run_options[option.name] = local_path(option.name)
    deadline: float | None = None
    if "missed_deadline" in values:
        try:
            deadline = parse_duration(values["missed_deadline"])
        except ValueError as exc:
            bad("missed_deadline", str(exc))
    notify = parse_notify(values["notify"], bad) if "notify" in values else None

    if errors or name is None or cron is None or payload is None:
        return None, errors
    schedule = Schedule(
        name=name,
        cron=cron,
        timezone=tz_name,
        payload=payload,
        source=path,
        task=values.get("task"),
        task_file=task_file,
        run_options=run_options,
        secrets=tuple(values.get("secrets", ())),
        additional_args=values.get("additional_args"),
        concurrency=values.get("concurrency", "forbid"),
        missed=values.get("missed", "skip"),
        missed_deadline=deadline,
        notify=notify,
        enabled=values.get("enabled", True),
    )
    if check_payloads:
        errors.extend(
            p.replace(field=f"schedule[{index}].{p.field}") for p in check_schedule(schedule)
        )
        if errors:
            return None, errors
    return schedule, errors


PAYLOAD_FIX = (
    "Give a payload folder or a program's .py file (relative to the schedules file), or a "
    "shipped example's name (`orchestrator examples` lists them)."
)


def _valid_cron(table: dict[str, Any]) -> Cron | None:
    """The table's cron line if it and its time zone are valid (else None)."""
    try:
        return Cron(str(table["cron"]), ZoneInfo(str(table.get("timezone") or "UTC")))
    except (KeyError, ValueError, TypeError, OSError):  # ZoneInfoNotFoundError: a KeyError
        return None


def check_schedule(schedule: Schedule) -> list[Problem]:
    """Check a schedule the way a firing will: the runner's own `prepare` (secret values are
    not read), then the schedule's secrets allow-list; problems naming the schedule and the
    field (`field` is the schedule's own: `limits`, `payload`, `secrets`...)."""
    from ..lifecycle.runner import prepare

    label = f'schedule "{schedule.name}"'
    try:
        spec = schedule.run_spec()
        prepared = prepare(spec, secret_values=False, limits_from=f"{label} field `limits`")
        schedule.check_secrets(prepared)
    except OrchestratorError as exc:
        message = f"{exc.cause} {exc.fix}".strip()
        field_name = exc.field or "payload"
        if message.startswith(label):
            return [Problem(field_name, message)]
        where = f"{label} field `{exc.field}`" if exc.field else label
        return [Problem(field_name, f"{where}: {message}")]
    return []
