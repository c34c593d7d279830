"""The derived images' constraints (images/agent/constraints.txt): versions the newest
releases get wrong together, applied when a payload's requirements are resolved on top of
the agent image, unless the payload names that project with a version of its own."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from . import imagedef
from .imagedef import Progress, report

#: The file, in the agent image's definition folder.
CONSTRAINTS_FILE = "constraints.txt"


@dataclass(frozen=True)
class Constraint:
    """One line of the constraints file, and why it is there (the comment above it)."""

    line: str
    project: str  # canonical name
    why: str

    def describe(self) -> str:
        return f"constraint {self.line} applied (images/agent/{CONSTRAINTS_FILE}: {self.why})"


def read_constraints(path: Path | None = None) -> tuple[Constraint, ...]:
    """The constraints of the file (images/agent/constraints.txt by default; none when
    it is absent), each with the comment lines just above it as its reason. Raises
    ValueError for a line that is not a requirement (the file is ours, not the user's)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    path = path or imagedef.AGENT_IMAGE_DIR / CONSTRAINTS_FILE
    if not path.is_file():
        return ()
    found = []
    comment: list[str] = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#"):
            comment.append(line.lstrip("#").strip())
        elif not line:
            comment = []
        else:
            name = canonicalize_name(Requirement(line).name)
            found.append(Constraint(line, name, " ".join(c for c in comment if c) or "no reason"))
            comment = []
    return tuple(found)


def applicable(
    requirements: Iterable[str], constraints: Iterable[Constraint]
) -> tuple[Constraint, ...]:
    """The constraints a payload's requirements leave in force: not those of a project the
    requirements name with a version specifier or a direct reference (the payload's own pin
    wins: `mcp==1.25.0` gets mcp 1.25.0, `mcp>=2` mcp 2)."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    pinned = set()
    for item in requirements:
        try:
            requirement = Requirement(item)
        except InvalidRequirement:
            continue  # refused before the build (imagedef.normalize_requirements)
        if requirement.specifier or requirement.url:
            pinned.add(canonicalize_name(requirement.name))
    return tuple(c for c in constraints if c.project not in pinned)


def constraints_text(pins: str, constraints: Iterable[Constraint]) -> str:
    """The constraints file pip resolves a derived image with: the agent image's pins (so
    nothing it has changes), then the constraints in force."""
    lines = [c.line for c in constraints]
    return pins + ("\n".join(lines) + "\n" if lines else "")


def bearing(constraints: Iterable[Constraint], wheels: Iterable[str]) -> tuple[Constraint, ...]:
    """The constraints that bore on a resolution: those with a wheel of their project among
    `wheels` (the derived wheelhouse's file names)."""
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename

    projects = set()
    for name in wheels:
        try:
            projects.add(parse_wheel_filename(name)[0])
        except InvalidWheelFilename:
            continue
    return tuple(c for c in constraints if c.project in projects)


def report_applied(
    constraints: Iterable[Constraint], wheels: Iterable[str], progress: Progress | None
) -> list[str]:
    """Say which constraints bore on the resolution (`bearing`); returns what was said."""
    said = [c.describe() for c in bearing(constraints, wheels)]
    for message in said:
        report(progress, message)
    return said
