"""A schedule's `notify` table: its fields, and what it parses into (`Notify`). Sending is
notify.py's; the schedules file (file.py) checks the table with the others."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..schema import Field, Table, words

NOTIFY_ON = ("failure", "skip", "success")


NOTIFY_TIMEOUT = 30.0


def _webhook_problem(url: str) -> str | None:
    return None if url.startswith(("http://", "https://")) else "is not an http:// or https:// URL"


def _notify_timeout_problem(seconds: float) -> str | None:
    return None if 0 < seconds <= 600 else "is out of range"


NOTIFY_TABLE = Table(
    {
        "command": Field((str, list), fix="Give a command line or a non-empty list of strings."),
        "webhook": Field(str, check=_webhook_problem, fix="Give an http:// or https:// URL."),
        "timeout_seconds": Field(
            float, check=_notify_timeout_problem, fix="Use a number of seconds from 1 to 600."
        ),
        "on": Field((str, list), fix=f"List some of {words(NOTIFY_ON)}."),
    }
)


@dataclass(frozen=True)
class Notify:
    """Where to report a firing: a command (argv, no shell), a webhook URL, or both."""

    command: tuple[str, ...] = ()
    webhook: str | None = None
    timeout_seconds: float = NOTIFY_TIMEOUT
    on: frozenset[str] = frozenset({"failure"})


def parse_notify(table: dict[str, Any], bad: Callable[[str, str, str], None]) -> Notify | None:
    """The `notify` table (its keys' types and ranges already checked by `NOTIFY_TABLE`)."""
    command: tuple[str, ...] = ()
    raw = table.get("command")
    if isinstance(raw, str):
        try:
            command = tuple(shlex.split(raw))
        except ValueError as exc:
            bad("notify.command", f"cannot be split into arguments ({exc})", "")
    elif isinstance(raw, list):
        if raw and all(isinstance(a, str) for a in raw):
            command = tuple(raw)
        else:
            bad("notify.command", "must be a string or a non-empty list of strings", "")
    webhook = table.get("webhook")
    if not command and not webhook and raw is None and "webhook" not in table:
        bad("notify", "needs `command` or `webhook`", "")
    on = table.get("on", ["failure"])
    if isinstance(on, str):
        on = [on]
    if any(o not in NOTIFY_ON for o in on):
        bad("notify.on", f"{on!r} must list some of {words(NOTIFY_ON)}", "")
        on = ["failure"]
    return Notify(
        command=command,
        webhook=webhook,
        timeout_seconds=float(table.get("timeout_seconds", NOTIFY_TIMEOUT)),
        on=frozenset(on),
    )
