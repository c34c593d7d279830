"""System cron: the crontab lines that call `schedule run`, merged between markers."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

from ..errors import ConfigError
from .cron import PORTABLE_FIELD
from .file import Schedule, ScheduleFile

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
    if PORTABLE_FIELD.match(fields[0]) and _same_offsets(schedule.cron.tz, zone, now, 3600):
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
    from ..paths import home_dir, repo_root

    now = now or datetime.now(timezone.utc)
    zone = zone if zone is not None else host_zone()
    home = home_dir()
    log_dir = resolve_log_dir(log_dir)
    python = python or sys.executable
    env = {"ORCHESTRATOR_HOME": str(home)}
    env.update({k: os.environ[k] for k in CRONTAB_ENV if os.environ.get(k)})
    package_root = repo_root()  # the folder holding the `orchestrator` package
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
    from ..paths import home_dir

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
