"""Payload manifests: load `manifest.toml`, validate every field, and refuse what is unsafe."""

from __future__ import annotations

import re
import sys
from collections.abc import Collection
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator_runtime.protocol import ENTRYPOINT_RE, ENV_NAME_RE, MODULE_RE, is_dangerous_import

from ..errors import ManifestError, Problem
from ..options import option
from ..paths import examples_dir
from ..policy import REQUIREMENT_HELP, AllowedRequirement, check_requirement, hosts_field
from ..schema import Field, Table, TomlLines, check_table, decode_utf8, toml_named
from ..spec import SETTABLE_LIMITS_TABLE, Limits
from . import pysource
from .binding import BIND_FIELD, PASSTHROUGH_FIELD, SecretBinding, check_bindings, passthrough_hosts
from .program import (
    block_named,
    check_requires_python,
    check_syntax,
    derive_name,
    filter_smolagents,
    image_smolagents,
    is_program,
    main_file,
    problems_in_block,
    script_metadata,
    shipped_files,
    unknown_script_keys,
)
from .program_models import ModelUse, find_models
from .shipped import ShippedFile, payload_files, program_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

MANIFEST_NAME = "manifest.toml"


_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")

_ENTRYPOINT_FIX = (
    "It is required, as `module:function` (a function in the payload folder that takes the "
    "model and returns the manager agent)."
)


def _strings(pattern: re.Pattern[str] | None = None, what: str = "a string") -> Field:
    return Field(list, items=Field(str, pattern=pattern, fix=f"Each must be {what}."))


#: What a manifest may hold. Rules that need the payload folder or the run (the entrypoint's
#: module file, --allow-requirement) are checked by `_parse` after it, into the same list.
SCHEMA = Table(
    {
        "payload": Field(
            dict,
            table=Table(
                {
                    "name": Field(
                        str,
                        required=True,
                        pattern=_NAME_RE,
                        fix="It is required: lowercase letters, digits, _ and -.",
                    ),
                    "description": Field(str),
                    "entrypoint": Field(
                        str, required=True, pattern=ENTRYPOINT_RE, fix=_ENTRYPOINT_FIX
                    ),
                    "example_task": Field(str),
                    "example_answer": Field(str),
                    # the run options' own rules (a run's flag overrides the payload's)
                    "backend": option("backend").rule,
                    "sandbox_runtime": option("sandbox_runtime").rule,
                }
            ),
        ),
        "python": Field(
            dict,
            table=Table(
                {
                    "requirements": _strings(what="a pip requirement string"),
                    "authorized_imports": _strings(MODULE_RE, "a module name"),
                }
            ),
        ),
        "secrets": Field(
            dict,
            table=Table(
                {
                    "required": _strings(ENV_NAME_RE, "an environment variable name"),
                    "bind": BIND_FIELD,
                }
            ),
        ),
        "network": Field(
            dict,
            table=Table(
                {
                    "hosts": hosts_field(),
                    "passthrough": PASSTHROUGH_FIELD,
                }
            ),
        ),
        "limits": Field(dict, table=SETTABLE_LIMITS_TABLE),
        "mock": Field(
            dict,
            table=Table(
                {
                    "scripts": Field(dict, values=_strings(what="one model output")),
                }
            ),
        ),
    },
    noun="section",
    brackets=True,
)


def _program_schema() -> Table:
    """What a program's `[tool.orchestrator]` may hold: the manifest's sections, less what a
    program says otherwise (it runs as `__main__`: no entrypoint; its requirements are PEP
    723's `dependencies`), plus `payload.model`, the model its runs use by default."""
    payload_fields = {
        k: v
        for k, v in SCHEMA.fields["payload"].table.fields.items()  # type: ignore[union-attr]
        if k not in ("entrypoint", "name")
    }
    payload_fields["name"] = Field(str, pattern=_NAME_RE, fix="Lowercase letters, digits, _ and -.")
    payload_fields["model"] = Field(
        str, fix="`mock`, or `provider:model_id` as --model takes it (e.g. `openai:gpt-4o`)."
    )
    python_fields = {"authorized_imports": _strings(MODULE_RE, "a module name")}
    return Table(
        {
            **SCHEMA.fields,
            "payload": Field(dict, table=Table(payload_fields)),
            "python": Field(
                dict,
                table=Table(
                    python_fields,
                    unknown_fix=(
                        "A program's requirements are the `dependencies` of its `# /// "
                        "script` block."
                    ),
                ),
            ),
        },
        noun="section",
        brackets=True,
    )


PROGRAM_SCHEMA = _program_schema()


@dataclass(frozen=True)
class Manifest:
    """A validated payload manifest plus the folder it came from."""

    path: Path
    name: str
    entrypoint: str
    description: str = ""
    example_task: str | None = None
    example_answer: str | None = None
    requirements: tuple[str, ...] = ()
    authorized_imports: tuple[str, ...] = ()
    secrets: tuple[str, ...] = ()
    #: `[secrets.bind]`: secrets that go on the wire only to their hosts (binding.py).
    bindings: tuple[SecretBinding, ...] = ()
    hosts: tuple[str, ...] = ()
    #: `[network] passthrough`: hosts whose TLS a bound run's interceptor relays unread
    #: (clients that pin certificates); no secret is bound to one (binding.py).
    passthrough: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)
    #: The limits the file sets itself (the others are built-in defaults): an agent keeps its
    #: own `max_steps` unless the manifest or the run's options set one.
    limits_set: tuple[str, ...] = ()
    mock_scripts: dict[str, list[str]] = field(default_factory=dict)
    #: Where runs of this payload go unless the run names a backend (None: the registry's
    #: default).
    backend: str | None = None
    #: The sandbox runtime runs of this payload ask for unless the run names one (None: auto).
    sandbox_runtime: str | None = None
    #: A program (program.py): the file it runs, relative to `folder` (None: a payload with
    #: an entrypoint); `single_file`: the program is that file alone (nothing beside it is
    #: shipped); `requires_python`, its PEP 723 `requires-python`; `model`, its
    #: `payload.model` (the run's model unless the run names one); `model_uses`, where it
    #: makes smolagents models, as its source says.
    program: str | None = None
    single_file: bool = False
    requires_python: str | None = None
    model: str | None = None
    model_uses: tuple[ModelUse, ...] = ()

    @property
    def folder(self) -> Path:
        return self.path.parent

    def dangerous_imports(self) -> list[str]:
        return sorted(m for m in self.authorized_imports if is_dangerous_import(m))

    def missing_function(self) -> str | None:
        """What is wrong with the entrypoint's function, read from its module's source (no
        import: `orchestrator validate` uses it without a sandbox), naming the functions the
        module does define; None when the name is bound at module level, or when that cannot
        be told from the source (a syntax error, a `*` import: the sandbox's load finds out).
        """
        import ast

        module, function = self.entrypoint.split(":")
        source = self.folder / (module.replace(".", "/") + ".py")
        try:
            tree = pysource.parse(source.read_bytes())
        except (OSError, SyntaxError, ValueError):
            return None
        bound: set[str] = set()
        defined: list[str] = []
        for node in tree.body if isinstance(tree, ast.Module) else ():
            for inner in ast.walk(node):  # module level, inside if/try/with blocks too
                if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    bound.add(inner.name)
                    if node is inner:
                        defined.append(inner.name)
                elif isinstance(inner, ast.ClassDef):
                    bound.add(inner.name)
                elif isinstance(inner, (ast.Import, ast.ImportFrom)):
                    names = [a.asname or a.name.split(".")[0] for a in inner.names]
                    if "*" in names:
                        return None
                    bound.update(names)
                elif isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
                    bound.add(inner.id)
        if function in bound:
            return None
        listed = ", ".join(f"`{name}`" for name in defined) or "no function at its top level"
        return (
            f"names a function `{function}` that {source.name} does not define "
            f"(it defines {listed})"
        )

    def payload_files(self) -> dict[str, ShippedFile]:
        """The payload's files, ready to ship in (see orchestrator/payloads/shipped.py)."""
        if self.single_file:
            return program_file(self.path)
        return payload_files(self.folder)


def payload_path(payload: str | Path, base: Path | None = None) -> Path:
    """Where a payload named by a user is: a path (relative to `base`, else the working
    folder), or, for a bare name that is no folder there, the shipped example of that name
    (`orchestrator examples`). `run`, batch and the schedules file all name payloads so."""
    path = (base / Path(payload).expanduser()) if base is not None else Path(payload)
    example = examples_dir() / str(payload)
    bare = Path(str(payload)).name == str(payload)
    if not path.exists() and bare and (example / MANIFEST_NAME).is_file():
        return example
    return path


def shadowed_example(payload: str | Path) -> Path | None:
    """The shipped example a bare name would name, when a folder of that name here takes
    its place (`payload_path` prefers the folder); else None."""
    example = examples_dir() / str(payload)
    if Path(str(payload)).name != str(payload) or not (example / MANIFEST_NAME).is_file():
        return None
    here = Path(payload)
    return example if here.exists() and here.resolve() != example.resolve() else None


def load_manifest(payload: str | Path, *, allowed_requirements: Collection[str] = ()) -> Manifest:
    """Load and validate the manifest of a payload folder (or a manifest file path).

    `python.requirements` must be package specifications; a `name @ URL` reference passes
    only if `allowed_requirements` names exactly that string (the run's
    --allow-requirement), and is then kept as a `policy.AllowedRequirement` so the image
    build admits it too.
    """
    path = payload_path(payload)
    if is_program(path):
        return load_program(path, allowed_requirements)
    if path.is_dir():
        path = path / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(
            f"No payload manifest at {path}.{_did_you_mean(str(payload))}",
            f"Point to a payload folder that holds a `{MANIFEST_NAME}`, or name a shipped "
            "example (`orchestrator examples` lists them; `orchestrator new NAME` makes one).",
        )
    try:
        text = decode_utf8(path.read_bytes())
    except ValueError as exc:
        raise ManifestError(f"{path}: {exc}.", "Save the file as UTF-8.") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{path}: not valid TOML ({exc}).", "Fix the syntax.") from exc
    return _parse(path, text, data, allowed_requirements)


def load_program(path: Path, allowed_requirements: Collection[str] = ()) -> Manifest:
    """A program (program.py) as a Manifest: its PEP 723 block read and checked like a
    manifest (every problem at once, with its line in the program file), its files parsed
    (a syntax error names file and line), its models found. Raises ManifestError."""
    main = main_file(path)
    folder = main.parent
    try:
        text = decode_utf8(main.read_bytes())
    except ValueError as exc:
        raise ManifestError(f"{main}: {exc}.", "Save the file as UTF-8.") from exc
    data, toml_text, first_line = script_metadata(text, str(main))
    files = shipped_files(path)  # refuses links out, devices, FIFOs; limits
    trees = check_syntax(files, folder)
    tool = (
        data.get("tool", {}).get("orchestrator", {}) if isinstance(data.get("tool"), dict) else {}
    )
    values, found = check_table(PROGRAM_SCHEMA, tool if isinstance(tool, dict) else {})
    found = [p.replace(field=f"tool.orchestrator.{p.field}") for p in found]
    found += unknown_script_keys(data)
    sections: dict[str, dict[str, Any]] = {k: values.get(k, {}) for k in PROGRAM_SCHEMA.fields}
    dependencies = data.get("dependencies", [])
    if not isinstance(dependencies, list) or not all(isinstance(d, str) for d in dependencies):
        found.append(
            Problem(
                "dependencies",
                "must be a list of requirement strings",
                'For example dependencies = ["sqlalchemy>=2"].',
            )
        )
        dependencies = []
    requirements = _requirements(dependencies, "dependencies", allowed_requirements, found)
    binding_problems: list[Problem] = []
    bindings = check_bindings(sections, binding_problems)
    found += [p.replace(field=f"tool.orchestrator.{p.field}") for p in binding_problems]
    requires_python = data.get("requires-python")
    if requires_python is not None and (problem := check_requires_python(requires_python)):
        found.append(Problem("requires-python", problem, "Fix the specifier."))
    if found:
        placed = problems_in_block(
            [p.replace(message=f"{block_named(p.field)} {p.message}") for p in found],
            toml_text,
            first_line,
        )
        raise ManifestError.of_problems(
            str(main),
            sorted(placed, key=lambda p: p.line or 0),
            "Fix the `# /// script` block (`orchestrator validate PROGRAM` checks again).",
        )
    payload = sections["payload"]
    return _manifest(
        main,
        sections,
        requirements,
        name=payload.get("name") or derive_name(path),
        entrypoint="",
        program=main.relative_to(folder).as_posix(),
        single_file=path.is_file(),
        requires_python=requires_python,
        model=payload.get("model"),
        model_uses=find_models(trees),
        bindings=bindings,
    )


def _did_you_mean(payload: str) -> str:
    """` Did you mean X?` for a mistyped bare name: the shipped examples and the payload
    folders here that are close to it ("" when none is, or it is a path)."""
    if Path(payload).name != payload:
        return ""
    import difflib

    names = [p.parent.name for p in examples_dir().glob(f"*/{MANIFEST_NAME}")]
    with suppress(OSError):
        names += [p.parent.name for p in Path.cwd().glob(f"*/{MANIFEST_NAME}")]
    close = difflib.get_close_matches(payload, sorted(set(names)), n=3, cutoff=0.7)
    return f" Did you mean {' or '.join(close)}?" if close else ""


def _parse(
    path: Path, text: str, data: dict[str, Any], allowed_requirements: Collection[str]
) -> Manifest:
    """A Manifest from the parsed TOML, or ManifestError naming every problem (its field
    path, line, and what to do)."""
    values, found = check_table(SCHEMA, data)
    sections: dict[str, dict[str, Any]] = {k: values.get(k, {}) for k in SCHEMA.fields}
    payload = sections["payload"]
    entrypoint = payload.get("entrypoint")
    if entrypoint is not None:
        module_file = path.parent / (entrypoint.split(":")[0].replace(".", "/") + ".py")
        if not module_file.is_file():
            found.append(
                Problem(
                    "payload.entrypoint",
                    f"names a module with no file {module_file}",
                    _module_fix(path.parent, entrypoint),
                )
            )
    requirements = _requirements(
        sections["python"].get("requirements", []),
        "python.requirements",
        allowed_requirements,
        found,
    )
    bindings = check_bindings(sections, found)
    if found:
        lines = TomlLines(text)
        raise ManifestError.of_problems(
            str(path),
            sorted(
                (
                    p.replace(message=f"{toml_named(p.field)} {p.message}").replace(
                        line=lines.line(p.field)
                    )
                    for p in found
                ),
                key=lambda p: p.line or 0,  # in the file's order
            ),
            "Fix the fields named above (`orchestrator validate PAYLOAD` checks again).",
        )
    own = {"name": payload["name"], "entrypoint": payload["entrypoint"], "bindings": bindings}
    return _manifest(path, sections, requirements, **own)


def _requirements(
    items: list[str], field: str, allowed: Collection[str], found: list[Problem]
) -> list[str]:
    """The requirements of `field` checked (problems added to `found`), smolagents at the
    image's version (`filter_smolagents`); one that passes only because the run allowed it
    by name (--allow-requirement) is marked so, and the mark is carried to the image build."""
    items, problems = filter_smolagents(items, image_smolagents())
    found += [Problem(field, p.message, p.fix) for p in problems]
    requirements: list[str] = []
    for item in items:
        problem = check_requirement(item, allowed)
        if problem:
            found.append(Problem(field, f"has an entry {item!r} that {problem}", REQUIREMENT_HELP))
        requirements.append(AllowedRequirement(item) if check_requirement(item) else item)
    return requirements


def _manifest(
    path: Path, sections: dict[str, dict[str, Any]], requirements: list[str], **own: Any
) -> Manifest:
    """A Manifest of checked sections (a manifest's, or a program's `[tool.orchestrator]`);
    `own`: what the kind of payload says itself (name, entrypoint or program, ...)."""
    payload = sections["payload"]
    return Manifest(
        path=path,
        description=payload.get("description", ""),
        example_task=payload.get("example_task"),
        example_answer=payload.get("example_answer"),
        requirements=tuple(requirements),
        authorized_imports=tuple(sections["python"].get("authorized_imports", ())),
        secrets=tuple(sections["secrets"].get("required", ())),
        hosts=tuple(h.lower() for h in sections["network"].get("hosts", ())),
        passthrough=passthrough_hosts(sections),
        limits=Limits(**sections["limits"]),
        limits_set=tuple(sections["limits"]),
        mock_scripts=dict(sections["mock"].get("scripts", {})),
        backend=payload.get("backend"),
        sandbox_runtime=payload.get("sandbox_runtime"),
        **own,
    )


def _module_fix(folder: Path, entrypoint: str) -> str:
    """What to write instead of an entrypoint whose module has no file: the payload's own
    modules, the nearest first."""
    import difflib
    import itertools

    found = (f for f in folder.rglob("*.py") if f.is_file() and f.name != "__init__.py")
    modules = sorted(  # a bounded look: the folder is not checked for size yet
        str(f.relative_to(folder).with_suffix("")).replace("/", ".")
        for f in itertools.islice(found, 200)
    )
    name, _, function = entrypoint.partition(":")
    if not modules:
        return "Add the module's .py file to the payload folder, next to manifest.toml."
    near = difflib.get_close_matches(name, modules, n=1)
    hint = f"Did you mean `{near[0]}:{function}`? " if near else ""
    return f"{hint}Modules in this payload: {', '.join(modules)}."
