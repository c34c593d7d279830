"""Pages as HTML strings, the same for the server and the static export: Jinja2 with
autoescaping on for every template (agent output is untrusted: an answer carrying `<script>`
is shown as text), and links that fit where the page will be opened."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from jinja2 import Environment, PackageLoader, Undefined

#: The Content-Security-Policy of every page: scripts and styles only from the viewer's own
#: files (no inline script, no inline event handler, no eval), pictures from itself or data
#: URIs (the charts), fetches only back to itself, no frames, no plugins, no forms elsewhere.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
#: The same policy as a page's `<meta>` (what an exported page has, with no server to send
#: headers): browsers ignore `frame-ancestors` there and say so in the console, so it is left
#: out; served pages get the whole policy as a header (`security.py`).
CSP_META = "; ".join(part for part in CSP.split("; ") if not part.startswith("frame-ancestors"))


@dataclass(frozen=True)
class Links:
    """Where a page's links go. Served: absolute paths. Exported: flat file names relative
    to the page (file:// has no server to route `/run/ID`), and only to exported pages."""

    static: bool = False
    exported_runs: frozenset[str] = frozenset()
    exported_batches: frozenset[str] = frozenset()

    def runs(self, **params: Any) -> str:
        query = urlencode({k: v for k, v in params.items() if v not in ("", None)})
        if self.static:
            return "index.html"
        return "/" + (f"?{query}" if query else "")

    def run(self, run_id: str) -> str | None:
        if self.static:
            return f"run-{run_id}.html" if run_id in self.exported_runs else None
        return f"/run/{quote(run_id)}"

    def batch(self, batch_id: str) -> str | None:
        if self.static:
            return f"batch-{batch_id}.html" if batch_id in self.exported_batches else None
        return f"/batch/{quote(batch_id)}"

    def batches(self) -> str:
        return "batches.html" if self.static else "/batches"

    def schedules(self) -> str:
        return "schedules.html" if self.static else "/schedules"

    def asset(self, name: str) -> str:
        return f"static/{name}" if self.static else f"/static/{name}"


def _missing(value: Any) -> bool:
    return value is None or isinstance(value, Undefined) or value == ""


def when(epoch: float | None) -> str:
    if epoch is None or _missing(epoch):
        return ""
    return datetime.fromtimestamp(float(epoch), timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def seconds(value: float | None) -> str:
    if value is None or _missing(value):
        return ""
    value = float(value)
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 120:
        return f"{value:.1f} s"
    return f"{int(value) // 60} min {int(value) % 60:02d} s"


def shown(value: Any) -> str:
    """A value as a person reads it: text as is, anything else as indented JSON."""
    if value is None or isinstance(value, Undefined):
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, indent=2, default=str, ensure_ascii=False)


def folder(value: str | Path | None) -> str:
    """A batch's folder as the person who gave it knows it: relative to the folder the viewer
    was started in when inside it (`runs/eval-1`), `~/...` inside the home folder, else
    whole (an absolute path is mostly the same long prefix on every page)."""
    if value is None or _missing(value):
        return ""
    path = Path(value)
    cwd, home = Path.cwd(), Path(os.path.expanduser("~"))
    if cwd != Path("/") and path.is_relative_to(cwd):
        return str(path.relative_to(cwd))
    if home.is_absolute() and home != Path("/") and path.is_relative_to(home):
        return str(Path("~") / path.relative_to(home))
    return str(path)


def percent(value: float | None) -> str:
    return "n/a" if _missing(value) else f"{value:.1%}"


def make_env() -> Environment:
    env = Environment(
        loader=PackageLoader("orchestrator.view", "templates"),
        autoescape=True,  # every template, whatever its name
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(when=when, seconds=seconds, shown=shown, percent=percent, folder=folder)
    return env


ENV = make_env()


def render(template: str, links: Links, **context: Any) -> str:
    return ENV.get_template(template).render(
        links=links, csp=CSP_META, rendered_at=when(time.time()), **context
    )
