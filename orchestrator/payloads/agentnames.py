"""The names of a payload's agents, read from its source (never by running it), so that a
mock script keyed for no agent is refused before any sandbox starts.

The runtime checks the tree it loaded (`tree_problems` in orchestrator_runtime/__main__.py)
in `validate` and `run` alike; this is the same check made earlier, on the host, whenever
the source tells every name an agent can have: the literal `name="..."` of each call of a
smolagents agent class (`CodeAgent`, `ToolCallingAgent`, `MultiStepAgent`, a subclass the
payload defines), and `manager` for one made without a name (smolagents leaves it None; the
runtime calls the top level `manager`, a program's later ones `manager_2`, ...). When the
source cannot tell (a name that is not a literal, an agent made by code the payload does not
ship, classes used other than by a call), `agent_names` says None and the runtime's check
alone decides.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterable

from orchestrator_runtime.protocol import unknown_script_problem

from ..errors import ManifestError, Problem
from ..schema import TomlLines, did_you_mean, toml_named
from . import pysource
from .manifest import Manifest
from .pysource import callee
from .shipped import ShippedFile

#: smolagents' agent classes (smolagents/agents.py).
AGENT_CLASSES = frozenset({"MultiStepAgent", "CodeAgent", "ToolCallingAgent"})
#: The name the runtime gives a top-level agent made without one (agents.TOP_LEVEL_NAME).
UNNAMED = "manager"
#: A program's later unnamed top-level agents (orchestrator_runtime/program.py).
NUMBERED_RE = re.compile(rf"{UNNAMED}_[0-9]+")
#: Calls that make agents or run code the source does not show.
DYNAMIC_CALLS = frozenset({"exec", "eval", "compile", "__import__", "setattr", "import_module"})
DYNAMIC_ATTRIBUTES = frozenset({"from_hub", "from_folder", "from_dict", "run_path"})


class _Unknown(Exception):
    """The source does not tell every agent name."""


def agent_names(files: dict[str, ShippedFile], requirements: Iterable[str]) -> list[str] | None:
    """Every name an agent of these files can have, in source order (a superset of any tree
    they make), or None when the source cannot tell. `requirements`: what the image installs
    beyond smolagents; code the payload imports from one of those may make agents too."""
    trees = {}
    for path, content in files.items():
        if not path.endswith(".py") or not isinstance(content, str):
            continue
        try:
            trees[path] = pysource.parse(content, filename=path)
        except (SyntaxError, ValueError):
            return None  # the sandbox's load reports it
    try:
        names = _names(trees, _local_modules(files) if requirements else None)
    except _Unknown:
        return None
    return names or None  # no agent made in sight: made out of it, or the load fails


def _local_modules(files: dict[str, ShippedFile]) -> set[str]:
    """The top-level modules the payload ships (`team` for team.py, `pkg` for pkg/x.py)."""
    return {path.split("/")[0].removesuffix(".py") for path in files}


def _names(trees: dict[str, ast.Module], local: set[str] | None) -> list[str]:
    classes = set(AGENT_CLASSES)
    subclasses: dict[str, ast.ClassDef] = {}
    changed = True
    while changed:  # subclasses of subclasses, aliases of either
        changed = False
        for tree in trees.values():
            for node in ast.walk(tree):
                new: set[str] = set()
                if isinstance(node, ast.ClassDef) and any(
                    callee(base) in classes for base in node.bases
                ):
                    new.add(node.name)
                    subclasses[node.name] = node
                elif isinstance(node, ast.ImportFrom):
                    new |= {a.asname for a in node.names if a.name in classes and a.asname}
                if new - classes:
                    classes |= new
                    changed = True
    for cls in subclasses.values():
        _check_subclass(cls)
    names: list[str] = []
    for tree in trees.values():
        allowed = _allowed_references(tree)
        for node in ast.walk(tree):
            _check_node(node, local)
            if isinstance(node, ast.Call) and callee(node.func) in classes:
                names.append(_name_of(node))
            elif isinstance(node, (ast.Name, ast.Attribute)) and callee(node) in classes:
                if id(node) not in allowed:
                    raise _Unknown  # an alias, a partial, a classmethod: not read here
    return list(dict.fromkeys(names))


def _check_subclass(cls: ast.ClassDef) -> None:
    """A subclass whose own code may set the name (its `__init__`, a `name` it defines)."""
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in (
            "__init__",
            "_validate_name",
            "name",
        ):
            raise _Unknown
        if isinstance(node, ast.Name) and node.id == "name" and isinstance(node.ctx, ast.Store):
            raise _Unknown


def _check_node(node: ast.AST, local: set[str] | None) -> None:
    """Refuse to tell for code that names agents out of sight."""
    if isinstance(node, ast.Call) and callee(node.func) in DYNAMIC_CALLS:
        raise _Unknown
    if isinstance(node, ast.Attribute) and node.attr in DYNAMIC_ATTRIBUTES:
        raise _Unknown
    if isinstance(node, ast.Attribute) and node.attr == "name" and isinstance(node.ctx, ast.Store):
        raise _Unknown  # `agent.name = ...` after the fact
    if local is None:
        return
    modules: list[str] = []
    if isinstance(node, ast.Import):
        modules = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
        modules = [node.module]
    for module in modules:
        top = module.split(".")[0]
        if top not in sys.stdlib_module_names and top != "smolagents" and top not in local:
            raise _Unknown  # a requirement's code may make agents of its own


def _allowed_references(tree: ast.Module) -> set[int]:
    """The nodes where an agent class may be named without making an agent: a call's
    function, a class's base, an annotation, `isinstance`'s and `issubclass`'s classes."""
    allowed: set[int] = set()

    def add(node: ast.AST | None) -> None:
        if node is not None:
            allowed.update(id(inner) for inner in ast.walk(node))

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            allowed.add(id(node.func))
            if callee(node.func) in ("isinstance", "issubclass"):
                for arg in node.args[1:]:
                    add(arg)
        elif isinstance(node, ast.ClassDef):
            for base in node.bases:
                add(base)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            add(node.returns)
        elif isinstance(node, ast.arg):
            add(node.annotation)
        elif isinstance(node, ast.AnnAssign):
            add(node.annotation)
    return allowed


def _name_of(call: ast.Call) -> str:
    """The name an agent made by `call` has, as the runtime names it."""
    if any(isinstance(arg, ast.Starred) for arg in call.args):
        raise _Unknown
    for keyword in call.keywords:
        if keyword.arg is None:  # **options
            raise _Unknown
        if keyword.arg == "name":
            value = keyword.value
            if isinstance(value, ast.Constant) and value.value is None:
                return UNNAMED
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                return value.value
            raise _Unknown
    return UNNAMED


def check_mock_scripts(manifest: Manifest, files: dict[str, ShippedFile], provider: str) -> None:
    """Refuse (ManifestError, exit 2) a mock script keyed for no agent the source can make
    (`known_scripts`): `run`, `batch` and schedules through `runner.prepare`, `validate`
    with the problems its load finds (cli/payload.py)."""
    _, error = known_scripts(manifest, files, provider)
    if error is not None:
        raise error


def known_scripts(
    manifest: Manifest, files: dict[str, ShippedFile], provider: str
) -> tuple[dict[str, list[str]], ManifestError | None]:
    """The mock scripts keyed for an agent the source can make, and the error naming the
    others in the runtime's words (`unknown_script_problem`): the file, the field, the agent
    names found and the closest. A program may make agents the check has not seen yet: its
    keys are refused only when they look like a known name misspelled, as in the runtime.
    Nothing is refused when the source cannot tell every name, nor for a run on another
    model than the mock (`provider`), which plays no script."""
    scripts = manifest.mock_scripts
    names = agent_names(files, manifest.requirements) if provider == "mock" and scripts else None
    if names is None:
        return scripts, None
    program = manifest.program is not None
    unknown = [
        key
        for key in scripts
        if key not in names
        and not (program and UNNAMED in names and NUMBERED_RE.fullmatch(key))
        and (not program or did_you_mean(key, names))
    ]
    if not unknown:
        return scripts, None
    prefix = "tool.orchestrator." if program else ""
    read_from = ", ".join(sorted(p for p in files if p.endswith(".py")))
    problems = [
        Problem(
            f"{prefix}mock.scripts.{key}",
            f"{toml_named(f'{prefix}mock.scripts.{key}')}: {unknown_script_problem(key, names)}"
            f", as read from {read_from}{did_you_mean(key, names)}",
            "Key each mock script by the name of its agent (the `name=` it is made with; "
            f"`{UNNAMED}` for a top-level agent made without one).",
        )
        for key in unknown
    ]
    if program:
        from .program import problems_in_block, script_metadata

        text = files[manifest.program or ""]
        assert isinstance(text, str)
        _, toml_text, first_line = script_metadata(text, str(manifest.path))
        problems = problems_in_block(problems, toml_text, first_line)
    else:
        lines = TomlLines(manifest.path.read_text(encoding="utf-8"))
        problems = [p.replace(line=lines.line(p.field)) for p in problems]
    error = ManifestError.of_problems(
        str(manifest.path),
        problems,
        "Rename the keys to the agents' names (`orchestrator validate` checks again).",
    )
    return {k: v for k, v in scripts.items() if k not in unknown}, error
