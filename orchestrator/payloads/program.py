"""Programs as their authors wrote them: a smolagents script (or a folder with `__main__.py`
or `main.py`) run unchanged, read here into the same `Manifest` a payload folder gives.

What a program needs is said the way single-file Python scripts already say it, PEP 723's
inline metadata (a `# /// script` block of TOML): `dependencies` become the run's derived
image as a manifest's `[python] requirements` do, `requires-python` is checked against the
sandbox's interpreter, and a `[tool.orchestrator]` table takes the manifest's own sections
(`payload`, `python`, `secrets`, `network`, `limits`, `mock`) plus `payload.model`, the
model its runs use unless the run names one. The models it makes are read from its
source by `program_models.py`.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ManifestError, Problem
from . import pysource
from .shipped import ShippedFile, payload_files, program_file

#: The file a folder program runs, in the order looked for.
MAIN_FILES = ("__main__.py", "main.py")

#: PEP 723's reference expression for a metadata block.
BLOCK_RE = re.compile(r"(?m)^# /// (?P<type>[a-zA-Z0-9-]+)$\s(?P<content>(^#(| .*)$\s)+)^# ///$")


def is_program(path: Path) -> bool:
    """A `.py` file, or a folder without `manifest.toml` that has `__main__.py`/`main.py`."""
    if path.is_file():
        return path.suffix == ".py"
    return (
        path.is_dir()
        and not (path / "manifest.toml").exists()
        and any((path / name).is_file() for name in MAIN_FILES)
    )


def main_file(path: Path) -> Path:
    """The file a program runs: itself, or its folder's `__main__.py` or `main.py`."""
    if path.is_file():
        return path
    return next(path / name for name in MAIN_FILES if (path / name).is_file())


def shipped_files(path: Path) -> dict[str, ShippedFile]:
    """What a program ships: a single file alone (never the files beside it, which may be
    anything in a user's folder), a folder program's whole folder (shipped.py's rules)."""
    return program_file(path) if path.is_file() else payload_files(path)


def script_metadata(text: str, source: str) -> tuple[dict[str, Any], str, int]:
    """The program's `# /// script` block as TOML data, its TOML text and the file line
    its first TOML line is on; ({}, "", 0) without one. Raises ManifestError for two blocks
    or TOML that does not parse (naming the line)."""
    import tomllib

    blocks = [m for m in BLOCK_RE.finditer(text) if m.group("type") == "script"]
    if not blocks:
        return {}, "", 0
    if len(blocks) > 1:
        line = text.count("\n", 0, blocks[1].start()) + 1
        raise ManifestError(
            f"{source}:{line}: a second `# /// script` block (PEP 723 allows one).",
            "Merge the two blocks into one.",
        )
    block = blocks[0]
    first_line = text.count("\n", 0, block.start()) + 2
    content = "".join(
        line[2:] if line.startswith("# ") else line[1:]
        for line in block.group("content").splitlines(keepends=True)
    )
    try:
        return tomllib.loads(content), content, first_line
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(
            f"{source}: its `# /// script` block is not valid TOML ({exc}; lines count from "
            f"line {first_line}).",
            "Fix the block's syntax: each line is `# ` and a line of TOML.",
        ) from exc


def check_syntax(files: dict[str, ShippedFile], folder: Path) -> dict[str, ast.Module]:
    """Every Python file of the program parsed; ManifestError naming file and line for the
    first that does not (nothing is started for a program that cannot even be compiled)."""
    trees = {}
    for name, content in files.items():
        if not name.endswith(".py") or not isinstance(content, str):
            continue
        try:
            trees[name] = pysource.parse(content, filename=name)
        except SyntaxError as exc:
            where = f"{folder / name}:{exc.lineno}" if exc.lineno else str(folder / name)
            raise ManifestError(
                f"{where}: a syntax error ({exc.msg}).",
                "Fix the program (`python -m py_compile FILE` shows the same error).",
            ) from None
    return trees


#: The extras smolagents declares (its `Provides-Extra`) at the version the agent image pins
#: (`image_smolagents`): a payload's `smolagents[...]` may name these only (pip skips an
#: unknown one with a warning, and the program then fails at its import, in the sandbox).
#: tests/payloads/test_program.py compares the list with smolagents' own metadata.
SMOLAGENTS_EXTRAS = (
    "all",
    "audio",
    "bedrock",
    "blaxel",
    "dev",
    "docker",
    "e2b",
    "gradio",
    "litellm",
    "mcp",
    "mlx-lm",
    "modal",
    "openai",
    "quality",
    "telemetry",
    "test",
    "toolkit",
    "torch",
    "transformers",
    "vision",
    "vllm",
)


@dataclass(frozen=True)
class SmolagentsProblem:
    """What is wrong with a payload's `smolagents` requirement, and what to do."""

    message: str
    fix: str


def filter_smolagents(
    dependencies: list[str], image_version: str
) -> tuple[list[str], list[SmolagentsProblem]]:
    """The dependencies with smolagents taken at the image's own version (the runtime is
    built against it): a plain `smolagents` dropped (the image has it), `smolagents[x,...]`
    kept as `smolagents[x,...]==<image_version>`, so that its extras' packages are resolved
    with the payload's other requirements, at the versions that smolagents asks for.

    Also what is wrong: a specifier that excludes the image's version, an extra smolagents
    does not have (`SMOLAGENTS_EXTRAS`). Raises nothing."""
    # Most payloads: `packaging` not imported (its cost:
    # benchmarks/results/code_figures.md#import-costs-on-the-start-path).
    if not dependencies:
        return [], []
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    kept: list[str] = []
    problems: list[SmolagentsProblem] = []
    for item in dependencies:
        try:
            requirement = Requirement(item)
        except InvalidRequirement:
            kept.append(item)  # named by the requirement check, with its fix
            continue
        if requirement.name.lower() != "smolagents":
            kept.append(item)
            continue
        if not requirement.specifier.contains(image_version, prereleases=True):
            problems.append(
                SmolagentsProblem(
                    f"has {item!r}, and the sandbox's image has smolagents {image_version}",
                    f"Accept that version of smolagents (smolagents>={image_version}, or no "
                    "version at all).",
                )
            )
            continue
        extras = sorted({str(canonicalize_name(e)) for e in requirement.extras})
        unknown = [e for e in extras if e not in SMOLAGENTS_EXTRAS]
        if unknown:
            problems.append(_unknown_extras(item, unknown, image_version))
        elif extras:
            marker = f"; {requirement.marker}" if requirement.marker else ""
            kept.append(f"smolagents[{','.join(extras)}]=={image_version}{marker}")
    return kept, problems


def _unknown_extras(item: str, unknown: list[str], image_version: str) -> SmolagentsProblem:
    """The problem of extras smolagents does not have: its own named, the nearest first."""
    import difflib

    near = [m for e in unknown for m in difflib.get_close_matches(e, SMOLAGENTS_EXTRAS, 1)]
    hint = f"Did you mean {', '.join(near)}? " if near else ""
    return SmolagentsProblem(
        f"has {item!r}, and smolagents {image_version} has no extra "
        f"{', '.join(repr(e) for e in unknown)} (it has {', '.join(SMOLAGENTS_EXTRAS)})",
        f"{hint}Name only extras smolagents has, e.g. smolagents[mcp] for MCP tools.",
    )


@functools.cache
def image_smolagents() -> str:
    """The smolagents version the agent image pins (images/agent/requirements.txt)."""
    from ..paths import data_root

    text = (data_root() / "images" / "agent" / "requirements.txt").read_text()
    for line in text.splitlines():
        name, _, version = line.split("#", 1)[0].partition("==")
        if name.strip().lower() == "smolagents":
            return version.strip()
    raise RuntimeError("images/agent/requirements.txt pins no smolagents version")


def check_requires_python(value: Any) -> str | None:
    """What is wrong with a `requires-python` value, or None."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    if not isinstance(value, str):
        return 'must be a string such as ">=3.10"'
    try:
        SpecifierSet(value)
    except InvalidSpecifier:
        return f'= {value!r} is not a version specifier (e.g. ">=3.10")'
    return None


def block_named(path: str) -> str:
    """How a message names a field of the block: its top-level entries (`dependencies`,
    `requires-python`) are keys, not tables as a manifest's top-level entries are."""
    from ..schema import toml_named

    return f"field `{path}`" if "." not in path and path != "tool" else toml_named(path)


def problems_in_block(problems: list[Problem], toml_text: str, first_line: int) -> list[Problem]:
    """Problems of the metadata block, each with its line in the program file."""
    from ..schema import TomlLines

    lines = TomlLines(toml_text)
    placed = []
    for problem in problems:
        line = lines.line(problem.field)
        placed.append(problem.replace(line=line + first_line - 1 if line else first_line - 1))
    return placed


def unknown_script_keys(data: dict[str, Any]) -> list[Problem]:
    """Keys of the block that are neither PEP 723's nor a tool table."""
    known = {"dependencies", "requires-python", "tool"}
    return [
        Problem(
            key,
            "is not a key of PEP 723's script block",
            "Use `dependencies`, `requires-python` and `[tool.orchestrator]`.",
        )
        for key in data
        if key not in known
    ]


def derive_name(path: Path) -> str:
    """A payload name from the program's file or folder name (lowercase, `-` for others)."""
    stem = path.stem if path.is_file() else path.name
    name = re.sub(r"[^a-z0-9_-]+", "-", stem.lower()).strip("-_") or "program"
    return name[:63]
