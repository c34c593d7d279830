"""The MCP servers a payload starts over stdio, read from its source (never by running it),
so that one the sandbox cannot start is refused before anything exists.

smolagents' MCP tools (`ToolCollection.from_mcp`, `MCPClient`) start a stdio server as a
process of the sandbox: `StdioServerParameters(command=..., args=[...])`. The agent image
has Python and nothing else to start one with: no Node.js (`npx`), no uv (`uvx`), no Docker.
A literal `command=` naming one of those is refused (exit 2, file and line) with what works
instead: the server shipped as Python beside the program, or installed as a package, each
started with the sandbox's own Python. A command the source does not spell out (an
expression) is left to the run.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..errors import ManifestError
from . import pysource
from .pysource import callee
from .shipped import ShippedFile

#: The class that starts a stdio server (mcp's, re-exported by smolagents' MCP guides).
STDIO_PARAMETERS = "StdioServerParameters"
#: Commands stdio MCP servers are commonly started with that the sandbox's image lacks, and
#: what each would need.
MISSING_COMMANDS = {
    "npx": "Node.js",
    "node": "Node.js",
    "npm": "Node.js",
    "pnpm": "Node.js",
    "bunx": "Bun",
    "bun": "Bun",
    "deno": "Deno",
    "uvx": "uv",
    "uv": "uv",
    "pipx": "pipx",
    "docker": "Docker",
}

#: What to do instead, whatever the command was.
FIX = (
    "Ship the server as Python beside the program (a folder program: main.py and "
    "server.py) and start it with the sandbox's own Python: "
    'StdioServerParameters(command=sys.executable, args=["server.py"]); or, for a server '
    "published as a Python package, add the package to the program's `dependencies` (a "
    "payload's `[python] requirements`) and start it with command=sys.executable, "
    'args=["-m", "<its module>"].'
)


@dataclass(frozen=True)
class ServerStart:
    """One `StdioServerParameters(command="...")` of the source, with a literal command."""

    file: str
    line: int
    command: str


def server_starts(files: dict[str, ShippedFile]) -> list[ServerStart]:
    """Every stdio server start whose command is a literal, in file order (a file that does
    not parse is skipped: the program's syntax check or the sandbox's load reports it)."""
    found = []
    for name, content in sorted(files.items()):
        if not name.endswith(".py") or not isinstance(content, str):
            continue
        if STDIO_PARAMETERS not in content:
            continue  # most files: no parse
        try:
            tree = pysource.parse(content, filename=name)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and callee(node.func) == STDIO_PARAMETERS:
                command = next((k.value for k in node.keywords if k.arg == "command"), None)
                if isinstance(command, ast.Constant) and isinstance(command.value, str):
                    found.append(ServerStart(name, node.lineno, command.value))
    return sorted(found, key=lambda s: (s.file, s.line))


def check_servers(files: dict[str, ShippedFile], folder: Path, noun: str = "program") -> None:
    """Refuse the payload (`noun`: program or payload, as the message names it) when its
    source starts a stdio MCP server with a command the sandbox's image lacks
    (`MISSING_COMMANDS`). Raises ManifestError naming each, with file and line under
    `folder`."""
    missing = [s for s in server_starts(files) if PurePosixPath(s.command).name in MISSING_COMMANDS]
    if not missing:
        return
    starts = "; ".join(
        f"{folder / s.file}:{s.line}: `{s.command}` (the image has no "
        f"{MISSING_COMMANDS[PurePosixPath(s.command).name]})"
        for s in missing
    )
    raise ManifestError(
        f"The {noun} starts an MCP server over stdio with a command the sandbox does not "
        f"have, so the server could never start: {starts}. The sandbox has Python and the "
        "installed packages, nothing else. Nothing was started.",
        FIX,
    )
