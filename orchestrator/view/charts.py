"""A batch's charts as SVG drawn on the server by pygal, shown as `<img>` data URIs.

Why this way: an SVG inside `<img>` can run no script and fetch nothing (the browser treats
it as a picture), so a task id or answer that ends up in a label cannot do anything; it needs
no JavaScript library in the page, works the same served or opened from file://, and pygal
is pure Python (no numpy, no browser to render). Its own tooltip script is switched off
(`js=[]`): by default it would be loaded from a CDN."""

from __future__ import annotations

import base64
import re
from typing import Any

import pygal
from pygal.style import Style

STYLE = Style(
    background="white",
    plot_background="white",
    foreground="#333",
    foreground_strong="#111",
    foreground_subtle="#888",
    colors=("#2b6cb0", "#c53030", "#d69e2e", "#718096", "#2f855a", "#805ad5"),
    font_family="sans-serif",
    title_font_size=18,
    label_font_size=13,
    major_label_font_size=13,
    legend_font_size=13,
    value_font_size=13,
)
_SCRIPT = re.compile(r"<script\b.*?</script>", re.S)
STATUS_COLOURS = {
    "correct": "#2f855a",
    "wrong": "#dd6b20",
    "partial": "#d69e2e",
    "unscored": "#4a5568",
    "succeeded": "#2f855a",
    "failed": "#c53030",
    "timed_out": "#d69e2e",
    "oom_killed": "#805ad5",
    "infra_error": "#718096",
}


def _config() -> dict[str, Any]:
    return {
        "style": STYLE,
        "js": [],
        "width": 640,
        "height": 300,
        "show_legend": False,
        "disable_xml_declaration": True,
    }


def whole_counts(chart: Any, top: int) -> None:
    """Label a count axis with whole numbers (pygal would write 0.2, 0.4... for small ones)."""
    step = max(1, -(-top // 10))
    chart.y_labels = list(range(0, top + step, step))


def data_uri(chart: Any) -> str:
    """The chart as a data URI, without the configuration script pygal always writes (inert
    in an `<img>`, but a picture needs none; labels are escaped, so only pygal's is matched)."""
    svg = chart.render(is_unicode=True)
    svg = _SCRIPT.sub("", svg).encode("utf-8")
    return "data:image/svg+xml;base64," + base64.b64encode(svg).decode("ascii")


#: The narrowest duration bin: differences below it are start-up noise, not the task's.
MIN_BIN_SECONDS = 0.1


def nice_width(raw: float) -> float:
    """The bin width a person reads at a glance: 1, 2 or 5 times a power of ten, at least
    `raw` and MIN_BIN_SECONDS."""
    import math

    raw = max(raw, MIN_BIN_SECONDS)
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw - 1e-12)


def duration_histogram(durations: list[float], bins: int = 12) -> str | None:
    """How long tasks took: counts per duration bin (round widths, at most `bins` bins)."""
    if not durations:
        return None
    width = nice_width((max(durations) - min(durations)) / bins)
    low = int(min(durations) / width) * width
    bins = int((max(durations) - low) / width) + 1
    counts = [0] * bins
    for value in durations:
        counts[min(bins - 1, int((value - low) / width))] += 1
    chart = pygal.Histogram(
        **_config(), title="Task duration (s)", x_title="seconds", y_title="tasks"
    )
    chart.add("tasks", [(n, low + i * width, low + (i + 1) * width) for i, n in enumerate(counts)])
    whole_counts(chart, max(counts))
    return data_uri(chart)


def tokens_per_task(rows: list[dict[str, Any]], limit: int = 60) -> str | None:
    """Input and output tokens of each task (the `limit` biggest, when there are more)."""
    rows = [r for r in rows if (r.get("input_tokens") or r.get("output_tokens"))]
    if not rows:
        return None
    rows = sorted(rows, key=lambda r: -(r["input_tokens"] + r["output_tokens"]))[:limit]
    chart = pygal.StackedBar(
        **{**_config(), "show_legend": True, "legend_at_bottom": True},
        title="Tokens per task",
        x_label_rotation=40,
        truncate_label=18,
    )
    chart.x_labels = [str(r["id"]) for r in rows]
    chart.add("input", [r["input_tokens"] for r in rows])
    chart.add("output", [r["output_tokens"] for r in rows])
    return data_uri(chart)


def status_breakdown(counts: dict[str, int], title: str = "Tasks by status") -> str | None:
    """Tasks by how they ended (statuses, or a report's verdicts)."""
    present = {k: v for k, v in counts.items() if v}
    if not present:
        return None
    colours = tuple(STATUS_COLOURS.get(k, "#4a5568") for k in present)
    style = Style(**{**STYLE.to_dict(), "colors": colours})
    chart = pygal.HorizontalBar(
        **{**_config(), "style": style, "show_legend": True, "height": 120 + 40 * len(present)},
        title=title,
    )
    for status, count in present.items():
        chart.add(status, count)
    whole_counts(chart, max(present.values()))
    return data_uri(chart)
