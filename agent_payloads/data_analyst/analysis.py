"""A manager and an analyst answer questions about a small sales table, then file a report.

The analyst computes statistics over `data/sales.csv` with its tool; the manager files the
result with a report store that needs the `ANALYTICS_TOKEN` secret (read from the environment,
never printed or returned). Everything is offline.
"""

from __future__ import annotations

import csv
import hashlib
import hmac
import json
import os
import statistics
from pathlib import Path

from smolagents import CodeAgent, Tool, tool

DATA = Path(__file__).parent / "data" / "sales.csv"
NUMERIC = ("units", "revenue")


def _number(text: str) -> int | float:
    value = float(text)
    return int(value) if value.is_integer() else value


def load_rows() -> list[dict]:
    with DATA.open(newline="", encoding="utf-8") as file:
        return [
            {key: _number(value) if key in NUMERIC else value for key, value in row.items()}
            for row in csv.DictReader(file)
        ]


@tool
def column_stats(column: str, group_by: str = "", where: str = "") -> str:
    """Computes statistics of a numeric column of the sales table (2024-01 to 2024-06).

    The table has the columns month (YYYY-MM), quarter (Q1 or Q2), region (North, South, East,
    West), units and revenue. Returns a JSON object that maps each group (or "all") to
    {"count", "sum", "mean", "median", "min", "max"}.

    Args:
        column: The numeric column to summarise: "units" or "revenue".
        group_by: Optional column to group by, e.g. "region" or "quarter".
        where: Optional filter "column=value", e.g. "quarter=Q1".
    """
    if column not in NUMERIC:
        raise ValueError(f"column must be one of {NUMERIC}, not {column!r}")
    rows = load_rows()
    if where:
        key, _, value = where.partition("=")
        rows = [row for row in rows if str(row.get(key.strip())) == value.strip()]
    groups: dict[str, list] = {}
    for row in rows:
        groups.setdefault(str(row[group_by]) if group_by else "all", []).append(row[column])
    return json.dumps(
        {
            name: {
                "count": len(values),
                "sum": sum(values),
                "mean": round(statistics.mean(values), 2),
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
            }
            for name, values in sorted(groups.items())
        }
    )


class ReportStoreTool(Tool):
    """Files a report with the team's report store (a stand-in kept in memory).

    The store wants the `ANALYTICS_TOKEN` secret: the receipt is signed with it, so it depends
    on the token without revealing it.
    """

    name = "report_store"
    description = (
        "Files a short report with the analytics report store and returns a receipt id. "
        "Needs the ANALYTICS_TOKEN secret to be configured."
    )
    inputs = {
        "title": {"type": "string", "description": "A short title for the report."},
        "body": {"type": "string", "description": "The report text."},
    }
    output_type = "string"

    def __init__(self) -> None:
        super().__init__()
        self.reports: list[dict] = []

    def forward(self, title: str, body: str) -> str:
        token = os.environ.get("ANALYTICS_TOKEN")
        if not token:
            raise PermissionError("ANALYTICS_TOKEN is not set: the report store refuses the report")
        signature = hmac.new(token.encode(), f"{title}\n{body}".encode(), hashlib.sha256)
        receipt = f"rpt-{signature.hexdigest()[:12]}"
        self.reports.append({"receipt": receipt, "title": title, "body": body})
        return f"Stored report {title!r} with receipt {receipt}."


def build_manager(model) -> CodeAgent:
    """The entrypoint: the runtime calls it with the model and runs the returned manager."""
    analyst = CodeAgent(
        tools=[column_stats],
        model=model,
        name="analyst",
        description=(
            "A data analyst with the 2024 sales table (month, quarter, region, units, revenue). "
            "Ask it a question about the sales; it computes the answer from the data."
        ),
        additional_authorized_imports=["json", "statistics"],
        max_steps=5,
    )
    return CodeAgent(
        tools=[ReportStoreTool()],
        model=model,
        managed_agents=[analyst],
        additional_authorized_imports=["json"],
        max_steps=6,
    )
