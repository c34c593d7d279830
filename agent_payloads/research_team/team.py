"""A manager and a librarian answer questions about world landmarks from a small knowledge base.

The librarian owns the knowledge base tools; the manager delegates look-ups to it and does the
arithmetic with its own tool. Everything is offline: the data ships in `data/landmarks.json`.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from smolagents import CodeAgent, Tool, tool

DATA = Path(__file__).parent / "data" / "landmarks.json"


@cache
def landmarks() -> dict[str, dict]:
    return json.loads(DATA.read_text(encoding="utf-8"))


@tool
def search_landmarks(query: str) -> str:
    """Searches the landmark knowledge base and lists the entries that match.

    Args:
        query: Words to look for in a landmark's name, city, country or summary.
    """
    words = query.lower().split()
    hits = [
        entry["name"]
        for entry in landmarks().values()
        if any(word in json.dumps(entry).lower() for word in words)
    ]
    return "Matching landmarks: " + (", ".join(hits) if hits else "none")


class LandmarkLookupTool(Tool):
    name = "lookup_landmark"
    description = (
        "Returns the knowledge-base entry of one landmark as a JSON object with the keys "
        "name, city, country, opened (year), height_m and summary."
    )
    inputs = {"name": {"type": "string", "description": "The landmark's name, e.g. 'CN Tower'."}}
    output_type = "string"

    def forward(self, name: str) -> str:
        # A plain print from tool code: the runtime sends it to stderr, never to the events.
        print(f"[knowledge base] lookup {name!r}")
        for entry in landmarks().values():
            if entry["name"].lower() == name.strip().lower():
                return json.dumps(entry)
        known = ", ".join(entry["name"] for entry in landmarks().values())
        raise KeyError(f"no landmark named {name!r}; known landmarks: {known}")


@tool
def years_between(start: int, end: int) -> int:
    """Counts the whole years from one year to a later one.

    Args:
        start: The earlier year.
        end: The later year.
    """
    return end - start


def build_manager(model) -> CodeAgent:
    """The entrypoint: the runtime calls it with the model and runs the returned manager."""
    librarian = CodeAgent(
        tools=[search_landmarks, LandmarkLookupTool()],
        model=model,
        name="librarian",
        description=(
            "Knows a knowledge base of world landmarks (city, country, opening year, height). "
            "Give it a question about landmarks; it answers from the knowledge base."
        ),
        additional_authorized_imports=["json"],
        max_steps=5,
    )
    return CodeAgent(
        tools=[years_between],
        model=model,
        managed_agents=[librarian],
        additional_authorized_imports=["json"],
        max_steps=6,
    )
