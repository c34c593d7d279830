"""Live run output: colours and a spinner on a terminal, plain lines otherwise (cron, CI)."""

from __future__ import annotations

import sys
from functools import cached_property
from typing import Any

from ..images.imagedef import is_detail
from ..policy import hosts_line
from .output import PREFIX, is_terminal

#: Show detail progress lines (build tools' output, repeated notices): `-v`, set by `main`.
VERBOSE = False


def _short(value: Any, limit: int | None = 100) -> str:
    """One line, cut at `limit` characters (None: whole); never Python's `None`."""
    if value is None:
        return "-"
    text = " ".join(str(value).split())
    if limit is None or len(text) <= limit:
        return text
    return text[: limit - 1] + "…"


def shown(message: str, *, quiet: bool = False) -> bool:
    """Whether a progress message is worth a line: not when quiet; details only with -v."""
    return not quiet and (VERBOSE or not is_detail(message))


def route_logs() -> None:
    """The orchestrator's own log warnings (a base image fallback, say, where no progress
    line is shown: `cleanup`, `images prune`) as message lines: `orchestrator: ...` on
    stderr; details (a repeated notice) only with -v. Python's default would print them
    bare."""
    import logging

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if shown(message):
                sys.stderr.write(f"{PREFIX}{message}\n")

    logger = logging.getLogger("orchestrator")
    if not any(type(h).__name__ == "Lines" for h in logger.handlers):
        logger.addHandler(Lines(logging.WARNING))
        logger.propagate = False


class RunDisplay:
    """Renders events and progress messages of one run, one line each."""

    def __init__(self, *, quiet: bool = False, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = is_terminal(self.stream)  # styled (FORCE_COLOR=1 asks for it in a pipe)
        self.interactive = self.stream.isatty()  # a spinner only where a person watches
        self.quiet = quiet
        self._status: Any = None
        #: The run's network policy, from the host's `sandbox_created` event: shown on the
        #: run-started line, where a person looks for what the run may reach.
        self.network: str | None = None

    @cached_property
    def console(self) -> Any:
        """rich, for styled lines only: plain lines (a pipe, cron) never import it, and a
        styled run imports it at its first line, while the sandbox is already starting."""
        from rich.console import Console

        return Console(file=self.stream, highlight=False, no_color=not self.tty)

    def progress(self, message: str) -> None:
        if not shown(message, quiet=self.quiet):
            return
        if self.tty:
            from rich.markup import escape

            self.console.print(f"[dim]· {escape(message)}[/dim]")
        else:
            print(f"{PREFIX}{message}", file=self.stream, flush=True)

    def event(self, event: dict[str, Any]) -> None:
        if event.get("type") == "sandbox_created":
            self.network = network_of(event)
        if self.quiet:
            return
        line = describe_event(event, network=self.network)
        if line is None:
            return
        if self.tty:
            from rich.markup import escape

            self.console.print(escape(line))
            if self.interactive:
                self._spin(event)
        else:
            print(line, file=self.stream, flush=True)

    def _spin(self, event: dict[str, Any]) -> None:
        if event["type"] in ("run_end", "run_finished", "timed_out", "cancelled"):
            self.stop()
            return
        text = f"running… ({event.get('agent') or 'sandbox'})"
        if self._status is None:
            self._status = self.console.status(text)
            self._status.start()
        else:
            self._status.update(text)

    def stop(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None


def network_of(event: dict[str, Any]) -> str | None:
    """`none`, `open`, or `allowlist (host, ...)` from a `sandbox_created` event, the
    secrets whose values are inside the sandbox (` · secrets in the sandbox: NAME, ...`)
    and those bound to hosts, whose placeholders alone are inside."""
    mode = event.get("network")
    hosts = event.get("allowlist") or []
    listed = hosts_line([str(h) for h in hosts])
    text = f"{mode} ({listed})" if mode == "allowlist" and hosts else mode
    inside = event.get("secrets_inside") or []
    if inside and text is not None:
        text += f" · secrets in the sandbox: {', '.join(map(str, inside))}"
    bound = event.get("secrets_bound") or []
    if bound and text is not None:
        text += f" · secrets bound (placeholders inside): {'; '.join(map(str, bound))}"
    return text


def describe_event(
    event: dict[str, Any], *, full: bool = False, network: str | None = None
) -> str | None:
    """One human line per event, or None for events not worth a line. `full`: code and
    observations whole, on the lines under the step's (for `runs logs --full`). `network`:
    the run's network policy, for the run-started line."""
    limit = None if full else 100
    kind = event.get("type")
    if kind == "run_start":
        agents = ", ".join(a.get("name", "?") for a in event.get("agents", []))
        where = f" · network {network}" if network else ""
        return f"▶ run started: payload {event.get('payload')} · agents {agents}{where}"
    if kind == "step":
        usage = event.get("token_usage") or {}
        tokens = (
            f" · {usage.get('input_tokens', 0)}+{usage.get('output_tokens', 0)} tok"
            if usage
            else ""
        )
        duration = f" · {event.get('duration', 0):.1f}s" if event.get("duration") else ""
        head = f"  [{event.get('agent')}] step {event.get('step_number')}{duration}{tokens}"
        if full:
            return head + _full_step(event)
        if event.get("error"):
            error = event["error"]
            return f"{head} ✗ {_short(error.get('type'))}: {_short(error.get('message'))}"
        if event.get("is_final_answer"):
            return f"{head} ✓ final answer"
        return f"{head} · {_short(event.get('observations') or event.get('code') or '')}"
    if kind == "managed_agent_call":
        task = _short(event.get("task"), None if full else 80)
        return f"  → {event.get('caller')} asks {event.get('agent')}: {task}"
    if kind == "managed_agent_result":
        error = event.get("error")
        if error:
            return (
                f"  ← {event.get('agent')} failed: {_short(error.get('type'))}: "
                f"{_short(error.get('message'), limit)}"
            )
        return f"  ← {event.get('agent')} answered: {_short(event.get('output'), limit)}"
    if kind == "error":
        error = event.get("error") or {}
        return (
            f"  ✗ {event.get('stage')} error: {_short(error.get('type'))}: "
            f"{_short(error.get('message'), limit)}"
        )
    if kind == "run_end":
        return f"■ agent finished: {event.get('state')}"
    if kind in ("timed_out", "cancelled"):
        return f"■ {kind.replace('_', ' ')}: sandbox killed"
    if kind in ("egress_blocked", "egress_failed"):
        where = ""
        if event.get("agent"):
            step = event.get("step_number")
            where = f" [{event.get('agent')}{f' step {step}' if step is not None else ''}]"
        if event.get("secret"):  # a bound secret's placeholder where it may not go
            detail = f" ({_short(event.get('detail'), limit)})" if event.get("detail") else ""
            return (
                f"  ⛔{where} refused {event['secret']} to {event.get('host')} "
                f"{event.get('place')}: {event.get('reason')}{detail}"
            )
        what = "blocked egress to" if kind == "egress_blocked" else "egress failed:"
        reason = f": {_short(event.get('reason'), limit)}" if event.get("reason") else ""
        port = f":{event.get('port')}" if event.get("port") is not None else ""
        return f"  ⛔{where} {what} {event.get('host')}{port}{reason}"
    if kind == "secret_injected":
        times = f" ({event['count']} requests)" if (event.get("count") or 1) > 1 else ""
        return (
            f"  🔑 injected {event.get('secret')} {event.get('host')} {event.get('place')}{times}"
        )
    return None


def _full_step(event: dict[str, Any]) -> str:
    """A step's code, observations and error, whole, indented under its head line."""
    parts = []
    for label, value in (
        ("code", event.get("code")),
        ("model output", None if event.get("code") else event.get("model_output")),
        ("observations", event.get("observations")),
        ("error", _error_text(event.get("error"))),
    ):
        if value not in (None, ""):
            body = "\n".join("      " + line for line in str(value).splitlines())
            parts.append(f"\n    {label}:\n{body}")
    return "".join(parts)


def _error_text(error: dict[str, Any] | None) -> str | None:
    return f"{error.get('type')}: {error.get('message')}" if error else None
