"""Notifications after a firing: a command or a webhook, recorded either way."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import urllib.request
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from ..images.imagedef import Progress
from .cron import utc_iso
from .file import Schedule
from .store import Firing, ScheduleStore

#: Outcomes that count as a failure for notifications (`cancelled` is an operator's act).
FAILURES = frozenset({"failed", "timed_out", "oom_killed", "infra_error", "error", "lost"})


def maybe_notify(schedule: Schedule, firing: Firing, store: ScheduleStore, log: Progress) -> None:
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


def notify_firing(schedule: Schedule, firing: Firing, store: ScheduleStore, log: Progress) -> None:
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
        except Exception as exc:  # every notifier failure is recorded, none raised
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
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return f"HTTP {response.status}"
