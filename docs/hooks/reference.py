"""MkDocs hook: the reference pages generated from the code at build time, never by hand.

- `reference/cli.md` from `orchestrator.cli`'s argument parser: every command, option, default
  and the environment variables that set them;
- `reference/files.md` from the schema tables (`orchestrator.schema.Table`) of the manifest, a
  program's `[tool.orchestrator]`, the config file, the schedules file and a tasks row: every
  field, its type, range or allowed values, and default;
- `performance.md` from the newest result of each benchmark in `benchmarks/results/`, then
  the figures behind the code (`benchmarks/results/code_figures.md`);
- `changelog.md` from the repository's CHANGELOG.md.

The pages exist only in the built site (`on_files` adds them), so they cannot drift from
the code; tests/project/test_docs.py renders them with the functions below.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import html
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

#: The pages this hook writes (relative to docs/); no hand-written page may take these paths.
GENERATED = ("reference/cli.md", "reference/files.md", "performance.md", "changelog.md")


def guides() -> dict[str, str]:
    """Where each command is explained (a guide under docs/), as its --help names it."""
    from orchestrator.cli.parser import COMMANDS

    return {c.name: c.guide.removeprefix("docs/") for c in COMMANDS}


def _cell(text: object) -> str:
    """Text safe inside a markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _code(text: object) -> str:
    """Text as code in a table cell: an HTML element, since a `|` inside backticks would
    still end the cell (and an escaped one shows its backslash)."""
    if text in (None, ""):
        return ""
    escaped = html.escape(str(text))
    for char in "|[]()*_\\`":  # nothing in it is read as markdown (links, emphasis, cells)
        escaped = escaped.replace(char, f"&#{ord(char)};")
    return f"<code>{escaped}</code>"


def _name(text: str) -> str:
    """An option's or a field's name as code: backticks, unless it holds a `|`."""
    return _code(text) if "|" in text else f"`{text}`"


# ---------------------------------------------------------------------------------- the CLI


def _walk(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """(path, parser, help line) of every command, group, action and verb, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {c.dest: c.help or "" for c in action._choices_actions}
            for name, child in action.choices.items():
                yield (*path, name), child, helps.get(name, "")
                yield from _walk(child, (*path, name))
                for verb_name, verb in getattr(child, "verbs", {}).items():
                    yield (*path, name, verb_name), verb, verb.description or ""
                    yield from _walk(verb, (*path, name, verb_name))


def _environment_variables() -> dict[str, list[str]]:
    """Every `ORCHESTRATOR_*` variable the host package reads, and where: named in the
    source, or an option's user default (`options.USER_DEFAULTS`, read in defaults.py)."""
    from orchestrator.options import USER_DEFAULTS

    found: dict[str, set[str]] = {}
    for source in sorted((REPO / "orchestrator").rglob("*.py")):
        for name in re.findall(r"[\"'](ORCHESTRATOR_[A-Z0-9_]+)[\"']", source.read_text()):
            found.setdefault(name, set()).add(str(source.relative_to(REPO)))
    for option in USER_DEFAULTS:
        found.setdefault(str(option.variable), set()).add("orchestrator/defaults.py")
    return {name: sorted(where) for name, where in sorted(found.items())}


def _option_rows(parser: argparse.ArgumentParser, env: dict[str, str]) -> list[str]:
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            names = ", ".join(_name(o) for o in action.option_strings)
            if action.nargs != 0 and action.metavar != "":
                metavar = action.metavar or action.dest.upper()
                names += f" {_name(str(metavar))}"
        else:
            names = _name(str(action.metavar or action.dest))
        help_text = (action.help or "") % {
            "default": action.default,
            "prog": parser.prog,
            "choices": action.choices,
        }
        shown = formatter._get_help_string(action) or ""
        default = ""
        if "%(default)s" in shown and action.default not in (None, False, [], argparse.SUPPRESS):
            default = _code(action.default)
        choices = ", ".join(_code(c) for c in action.choices) if action.choices else ""
        variable = env.get(action.dest, "")
        rows.append(
            f"| {names} | {_cell(help_text)} | {default} | {choices} | "
            f"{_code(variable) if variable else ''} |"
        )
    return rows


@contextlib.contextmanager
def built_in_backends() -> Iterator[None]:
    """Only the backends built into orchestrator while the pages are rendered: a plugin
    installed where the site is built (the tests' `mirror`) is no choice a user has."""
    from orchestrator import registry

    saved = registry.entry_points
    registry.entry_points = lambda **_: []  # type: ignore[assignment]
    registry.backend_entries.cache_clear()
    try:
        yield
    finally:
        registry.entry_points = saved
        registry.backend_entries.cache_clear()


def cli_reference() -> str:
    """The CLI reference page: every command's usage, description and options."""
    with built_in_backends():  # read while the page is written: `--backend` reads them late
        return _cli_reference()


def _cli_reference() -> str:
    from orchestrator.cli.parser import build_parser
    from orchestrator.defaults import OPTIONS
    from orchestrator.options import USER_DEFAULTS

    user_set = [
        f"{'batch ' if o.applies.isdisjoint({'run'}) else ''}`{o.flag}`" for o in USER_DEFAULTS
    ]
    parser = build_parser()
    parser.prog = "orchestrator"
    lines = [
        "# Command line",
        "",
        "Generated from the argument parser (`orchestrator.cli.parser.build_parser`) each time "
        "the site is built; `orchestrator COMMAND --help` prints the same. Backends are the "
        "built-in ones; `--backend` also takes any a package registers "
        "([backends](backends.md)).",
        "",
        f"A *default* here is the built-in one. {', '.join(user_set[:-1])} and {user_set[-1]} "
        "are also read, in this order, from the flag, the environment variable shown, the "
        "config file's `[defaults]` ([files](files.md#the-config-file)), the payload's "
        "manifest, then the built-in default (`orchestrator.options.USER_DEFAULTS`).",
        "",
        "## orchestrator",
        "",
        "```text",
        parser.format_usage().strip(),
        "```",
        "",
        parser.description or "",
        "",
        "| option | what | default | choices | environment |",
        "|---|---|---|---|---|",
        *_option_rows(parser, OPTIONS),
        "",
        parser.epilog or "",
        "",
    ]
    for path, child, help_line in _walk(parser):
        guide = guides().get(path[0])
        lines += [
            f"## orchestrator {' '.join(path)}",
            "",
            help_line[:1].upper() + help_line[1:] + ("." if help_line[-1:] not in ".)" else ""),
            "",
        ]
        if guide and len(path) == 1:
            lines += [f"Explained in [the guide](../{guide}).", ""]
        lines += ["```text", child.format_usage().strip(), "```", ""]
        if child.description and child.description != help_line:
            lines += ["```text", child.description.strip(), "```", ""]
        rows = _option_rows(child, OPTIONS)
        if rows:
            lines += [
                "| option | what | default | choices | environment |",
                "|---|---|---|---|---|",
                *rows,
                "",
            ]
        if child.epilog:
            lines += ["```text", child.epilog.strip(), "```", ""]
    lines += _run_options_section()
    lines += [
        "## Environment variables",
        "",
        "Every `ORCHESTRATOR_*` variable the host package reads, with the modules that read it "
        "(found in the source when the site is built).",
        "",
        "| variable | read in |",
        "|---|---|",
    ]
    for name, where in _environment_variables().items():
        lines.append(f"| `{name}` | {', '.join(f'`{w}`' for w in where)} |")
    return "\n".join(lines) + "\n"


def _run_options_section() -> list[str]:
    """Every run option (`orchestrator.options.RUN_OPTIONS`, the one declaration the parser,
    the schedules file and the tasks rows read) and where each may be given."""
    from orchestrator.options import RUN_OPTIONS

    lines = [
        "## Run options",
        "",
        "Generated from `orchestrator.options.RUN_OPTIONS`: what a run may be given, and where "
        "([files](files.md)): a flag of `run` and `batch`, a key of a `[[schedule]]` table, a "
        "field of a batch's tasks row (that task's own value), the user's default (its "
        "variable, and the same key in the config file's `[defaults]`). The rule holds in each "
        "place.",
        "",
        "| option | flag | schedule key | tasks field | user default | type | allowed | what |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for option in RUN_OPTIONS:
        flag = option.flag if option.applies & {"run", "batch"} else ""
        key = option.key if "schedule" in option.applies else ""
        task = (option.name, *option.aliases) if "task" in option.applies else ()
        variable = f"`{option.variable}`" if option.variable else ""
        lines.append(
            f"| `{option.name}` | {_name(flag) if flag else ''} | {_name(key) if key else ''} "
            f"| {', '.join(_name(t) for t in task)} | {variable} "
            f"| {_type_name(option.rule.kind)} | {_rule(option.rule)} "
            f"| {_cell(option.help_text())} |"
        )
    return [*lines, ""]


# ------------------------------------------------------------------------ the file schemas


def _type_name(kind: Any) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {
        str: "string",
        int: "integer",
        float: "number",
        bool: "boolean",
        list: "list",
        dict: "table",
        object: "any",
    }
    return " or ".join(names.get(k, getattr(k, "__name__", str(k))) for k in kinds)


def _rule(field: Any) -> str:
    """A field's range, allowed values or pattern, in words."""
    parts = []
    choices = field.choices() if callable(field.choices) else field.choices
    if choices:
        parts.append("one of " + ", ".join(f"`{c}`" for c in choices))
    if field.minimum is not None or field.maximum is not None:
        low = "" if field.minimum is None else f"{field.minimum:g}"
        high = "" if field.maximum is None else f"{field.maximum:g}"
        parts.append(f"{low} to {high}" if low and high else (f">= {low}" if low else f"<= {high}"))
    if field.pattern is not None:
        parts.append(f"matches {_code(field.pattern.pattern)}")
    if field.max_items is not None:
        parts.append(f"at most {field.max_items:,} entries")
    if field.items is not None:
        item = _type_name(field.items.kind)
        inner = _rule(field.items)
        parts.append(f"each a {item}" + (f" ({inner})" if inner else ""))
    if field.values is not None:
        parts.append(f"each value a {_type_name(field.values.kind)}")
    if field.fix:
        parts.append(field.fix)
    return _cell("; ".join(parts))


def _defaults_of(cls: Any) -> dict[str, Any]:
    """The defaults of a dataclass's fields, by name."""
    found = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            found[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            found[f.name] = f.default_factory()
    return found


def _show_default(value: Any) -> str:
    if value is None or value == () or value == {}:
        return ""
    if isinstance(value, (set, frozenset)):
        value = sorted(value)
    if isinstance(value, bool):
        value = str(value).lower()
    return _code(value)


def _table_rows(table: Any, defaults: dict[str, dict[str, Any]], prefix: str = "") -> list[str]:
    rows = []
    for key, field in table.fields.items():
        name = f"{prefix}{key}"
        section_defaults = defaults.get(prefix.rstrip("."), {})
        default = _show_default(section_defaults.get(key))
        required = "yes" if field.required else ""
        rows.append(
            f"| `{name}` | {_type_name(field.kind)} | {required} | {_rule(field)} | {default} |"
        )
        if field.table is not None:
            rows += _table_rows(field.table, defaults, f"{name}.")
    return rows


def schema_tables() -> list[tuple[str, str, Any, dict[str, dict[str, Any]]]]:
    """(title, introduction, Table, defaults by section) of every file a user writes."""
    from orchestrator.batch.tasks import ROW
    from orchestrator.defaults import CONFIG, OPTIONS
    from orchestrator.options import options_for
    from orchestrator.payloads.manifest import PROGRAM_SCHEMA, SCHEMA
    from orchestrator.schedules.file import FILE, SCHEDULE, Schedule
    from orchestrator.schedules.notify_table import Notify
    from orchestrator.spec import Limits

    limits = _defaults_of(Limits)
    schedule = {**{o.name: o.default for o in options_for("schedule")}, **_defaults_of(Schedule)}
    task = {**{o.name: o.default for o in options_for("task")}, **limits}
    return [
        (
            "The manifest",
            "A payload folder's `manifest.toml` (`orchestrator.payloads.manifest.SCHEMA`). "
            "A limit left out takes the default shown.",
            SCHEMA,
            {"limits": limits},
        ),
        (
            "A program's [tool.orchestrator]",
            "The `[tool.orchestrator.*]` tables of a program's PEP 723 `# /// script` block "
            "(`orchestrator.payloads.manifest.PROGRAM_SCHEMA`): the manifest's sections, "
            "without `entrypoint` and `requirements` (the block's `dependencies`), plus "
            "`payload.model`.",
            PROGRAM_SCHEMA,
            {"limits": limits},
        ),
        (
            "The config file",
            "`$ORCHESTRATOR_CONFIG`, else `$ORCHESTRATOR_HOME/config.toml` "
            "(`orchestrator.defaults.CONFIG`). Each option is also read from its variable: "
            + ", ".join(f"`{k}` from `{v}`" for k, v in OPTIONS.items())
            + ".",
            CONFIG,
            {},
        ),
        (
            "The schedules file",
            "`schedules.toml`: `[[schedule]]` tables and nothing else "
            "(`orchestrator.schedules.file.FILE`).",
            FILE,
            {},
        ),
        (
            "A [[schedule]] table",
            "One schedule (`orchestrator.schedules.file.SCHEDULE`).",
            SCHEDULE,
            {"": schedule, "limits": limits, "notify": _defaults_of(Notify)},
        ),
        (
            "A tasks row",
            "One JSONL line or CSV row of a batch's tasks file "
            "(`orchestrator.batch.tasks.ROW`); a limit left out is the payload's. "
            "`timeout` is read as `timeout_seconds`.",
            ROW,
            {"": task},
        ),
    ]


def files_reference() -> str:
    """The files reference page: every field of every file a user writes."""
    lines = [
        "# Files",
        "",
        "Generated from the schema tables in the code (`orchestrator.schema.Table`) each time "
        "the site is built: what `orchestrator validate` and every command check. A file "
        "that breaks a rule is refused with exit 2, naming the field, its line and the fix.",
        "",
    ]
    with built_in_backends():
        tables = schema_tables()
        rows = {title: _table_rows(table, defaults) for title, _, table, defaults in tables}
    for title, intro, _, _ in tables:
        lines += [
            f"## {title}",
            "",
            intro,
            "",
            "| field | type | required | allowed | default |",
            "|---|---|---|---|---|",
            *rows[title],
            "",
        ]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- performance

_DATE = re.compile(r"20\d\d-\d\d-\d\d(?:[ T]\d\d:\d\d(?::\d\d)?(?: UTC)?)?")
_MACHINE = re.compile(r"\d+ (?:CPUs|cores)")
#: Hand-written: the measurements behind constants in `orchestrator/` (no benchmark's result).
CODE_FIGURES = "code_figures.md"


def _summary(script: Path) -> str:
    """The first paragraph of a benchmark's docstring, without issue references."""
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    first = doc.split("\n\n", 1)[0].replace("\n", " ")
    return re.sub(r"\s*\(issue \d+[^)]*\)", "", first)


_DRIVER = re.compile(r"Docker \S+ \(([\w-]+)\)")


def latest_results() -> list[tuple[Path, Path, str]]:
    """(script, newest result file, its date) for each benchmark that has a result, and for
    each storage driver its results name (overlay2 and fuse-overlayfs differ by a fifth and
    more, so the newest of one never hides the other's)."""
    found = []
    for script in sorted((REPO / "benchmarks").glob("*.py")):
        dated: dict[str, list[tuple[str, Path]]] = {}
        for result in (REPO / "benchmarks" / "results").glob("*.md"):
            if result.stem == script.stem or result.stem.startswith(script.stem + "_"):
                text = result.read_text()
                date = _DATE.search(text)
                driver = _DRIVER.search(text)
                if date:
                    key = driver.group(1) if driver else ""
                    dated.setdefault(key, []).append((date.group(0), result))
        for _, results in sorted(dated.items()):
            date, newest = max(results)
            found.append((script, newest, date))
    return found


def performance_page() -> str:
    """The performance page: the newest result of each benchmark, with how to rerun it."""
    lines = [
        "# Performance",
        "",
        "Generated from `benchmarks/results/` each time the site is built: for each "
        "benchmark in `benchmarks/`, its newest result, as the benchmark wrote it. Every "
        "benchmark measures ours against the floor side by side in one run on the same "
        "machine, so read the ratios before the absolute figures (the development machines "
        "are small and shared). Earlier runs stay in `benchmarks/results/`.",
        "",
    ]
    for script, result, date in latest_results():
        text = result.read_text()
        machine = _MACHINE.search(text)
        body = text.split("\n", 1)[1] if text.startswith("# ") else text
        body = re.sub(r"^(#+) ", r"\1## ", body, flags=re.M)  # under this page's headings
        body = re.sub(r"\]\((?!https?:)[^)]*\)", "]", body)  # links into results/: plain text
        title = text.split("\n", 1)[0].lstrip("# ").strip() if text.startswith("# ") else ""
        lines += [
            f"## {title or script.stem}",
            "",
            _summary(script),
            "",
            f"- **Date:** {date}",
            f"- **Machine:** {machine.group(0) if machine else 'not recorded'} "
            "(the development machine)",
            f"- **Rerun:** `.venv/bin/python benchmarks/{script.name}` "
            f"(writes `benchmarks/results/{script.stem}.md`; see `--help`)",
            f"- **Result file:** `benchmarks/results/{result.name}`",
            "",
            body.strip(),
            "",
        ]
    # The figures behind the code's constants, which its comments point to.
    figures = (REPO / "benchmarks" / "results" / CODE_FIGURES).read_text()
    lines.append(re.sub(r"^(#+) ", r"#\1 ", figures, flags=re.M).strip())
    return "\n".join(lines) + "\n"


def changelog_page() -> str:
    return (REPO / "CHANGELOG.md").read_text()


PAGES = {
    "reference/cli.md": cli_reference,
    "reference/files.md": files_reference,
    "performance.md": performance_page,
    "changelog.md": changelog_page,
}


def on_files(files: Any, config: Any) -> Any:
    """Add the generated pages to the site."""
    from mkdocs.structure.files import File

    for path, render in PAGES.items():
        files.append(File.generated(config, path, content=render()))
    return files
