"""The documentation: the site builds in strict mode, its reference is generated from the code
and complete (every command, option and file field), no hand-written page names a commit or
a name the code does not have, and the README stays a short introduction. No Docker needed."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import os
import pkgutil
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from orchestrator.cli.parser import build_parser, subcommands
from tests.conftest import REPO

DOCS = REPO / "docs"
MKDOCS = Path(sys.executable).parent / "mkdocs"  # installed with the test tools


def hook() -> ModuleType:
    """docs/hooks/reference.py, the module MkDocs loads to generate the reference pages."""
    spec = importlib.util.spec_from_file_location("docs_reference", DOCS / "hooks" / "reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REFERENCE = hook()


def build_site(into: Path) -> subprocess.CompletedProcess[str]:
    """`mkdocs build --strict`: a broken link, a missing page or anchor fails it."""
    return subprocess.run(
        [str(MKDOCS), "build", "--strict", "-d", str(into)],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    built = build_site(tmp_path / "site")
    assert built.returncode == 0, built.stdout + built.stderr
    for page in ("index.html", "reference/cli/index.html", "performance/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    # Material's own fonts are off: no page asks Google (or anyone) for anything.
    home = (tmp_path / "site" / "index.html").read_text()
    assert "fonts.googleapis.com" not in home and "fonts.gstatic.com" not in home


def sections(page: str) -> dict[str, str]:
    """A generated page's `## heading` sections, by heading."""
    parts = re.split(r"^## (.+)$", page, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_every_command_and_option_is_in_the_cli_reference() -> None:
    """A new option cannot be left undocumented: the page is the parser, and this checks it
    names every command and every option of each (its dest, for a positional)."""
    page = sections(REFERENCE.cli_reference())
    parser = build_parser()
    missing = []
    for child in [parser, *subcommands(parser)]:
        heading = child.prog
        assert heading in page, f"no section for {heading}"
        for action in child._actions:
            if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
                continue
            names = action.option_strings or [action.metavar or action.dest]
            for name in names:
                shown = REFERENCE._name(name)
                if shown not in page[heading]:
                    missing.append(f"{heading} {name}")
    assert not missing, f"not in the CLI reference: {missing}"
    assert "ORCHESTRATOR_MODEL" in page["Environment variables"]


def field_paths(table: Any, prefix: str = "") -> list[str]:
    found = []
    for key, field in table.fields.items():
        found.append(f"{prefix}{key}")
        if field.table is not None:
            found += field_paths(field.table, f"{prefix}{key}.")
    return found


def test_every_schema_field_is_in_the_files_reference() -> None:
    page = sections(REFERENCE.files_reference())
    missing = []
    with REFERENCE.built_in_backends():
        tables = REFERENCE.schema_tables()
    assert len(tables) == 6
    for title, _, table, _ in tables:
        missing += [f"{title}: {p}" for p in field_paths(table) if f"| `{p}` |" not in page[title]]
    assert not missing, f"not in the files reference: {missing}"
    # the limits' defaults come from the code (spec.Limits), not from a copy
    assert "| `limits.max_tokens` | integer |" in page["The manifest"]
    assert "<code>2000000</code>" in page["The manifest"]


def test_the_performance_page_has_each_benchmarks_newest_result_with_date_and_rerun() -> None:
    page = REFERENCE.performance_page()
    results = REFERENCE.latest_results()
    assert len(results) >= 8, results
    for script, result, date in results:
        assert f"benchmarks/{script.name}" in page and result.name in page
        assert re.fullmatch(r"20\d\d-\d\d-\d\d.*", date)
    assert page.count("- **Date:**") == page.count("- **Rerun:**") == len(results)


def test_each_pointer_from_the_code_to_its_figures_names_a_section_of_them() -> None:
    """Comments in orchestrator/ keep the reason and point to the measurement
    (`benchmarks/results/code_figures.md#section`), which the performance page carries."""
    figures = REPO / "benchmarks" / "results" / REFERENCE.CODE_FIGURES
    sections = {
        re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in figures.read_text().splitlines()
        if line.startswith("## ")
    }
    pointers = {
        f"{path.relative_to(REPO)}: {anchor}"
        for path in (REPO / "orchestrator").rglob("*.py")
        for anchor in re.findall(r"code_figures\.md#([\w-]+)", path.read_text())
        if anchor not in sections
    }
    assert not pointers, (pointers, sections)
    assert len(re.findall(r"code_figures\.md#", (REPO / "orchestrator" / "schema.py").read_text()))
    assert "## Figures behind the code" in REFERENCE.performance_page()


#: A commit hash as a page would name one: 7 to 12 hex digits (git's short form) or 40, with
#: at least one digit and one letter (so `1024` or `facade` do not count; nor do the 16 and
#: 32 digits of an OpenTelemetry span or trace id in an example).
COMMIT = re.compile(
    r"(?<![\w./-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])(?:[0-9a-f]{40}|[0-9a-f]{7,12})(?![\w-])"
)


def hand_written_pages() -> list[Path]:
    pages = [p for p in DOCS.rglob("*.md") if "hooks" not in p.parts]
    return [*pages, REPO / "README.md", REPO / "CHANGELOG.md"]


def test_no_hand_written_page_names_a_commit() -> None:
    """History lives in git and benchmarks/results/, not in prose; the generated
    performance page may quote a result's commit."""
    named = [
        f"{p.relative_to(REPO)}: {m.group(0)}"
        for p in hand_written_pages()
        for m in COMMIT.finditer(p.read_text())
    ]
    assert not named, named
    assert COMMIT.search("run on commit 5785b10 today") and not COMMIT.search("r-20261124-0425")


def test_generated_pages_are_not_also_written_by_hand() -> None:
    assert not [p for p in REFERENCE.GENERATED if (DOCS / p).exists()]


def our_modules() -> dict[str, list[str]]:
    """Each module of ours by its last name (`runner` -> orchestrator.lifecycle.runner)."""
    import orchestrator
    import orchestrator_runtime

    found: dict[str, list[str]] = {"orchestrator": ["orchestrator"]}
    for package in (orchestrator, orchestrator_runtime):
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            found.setdefault(info.name.rsplit(".", 1)[-1], []).append(info.name)
    return found


def resolves(module_name: str, rest: list[str]) -> bool:
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError:
        return False
    for i, name in enumerate(rest):
        if hasattr(target, name):
            target = getattr(target, name)
            continue
        try:
            target = importlib.import_module(f"{module_name}.{'.'.join(rest[: i + 1])}")
        except ImportError:
            return False
    return True


#: The last part of a file's name (`run.png`), not an attribute.
FILE_SUFFIXES = {"py", "toml", "json", "jsonl", "html", "md", "png", "svg", "csv", "sh", "log"}
FILE_SUFFIXES |= {"txt", "gz", "yml", "yaml", "sqlite3", "env", "lock", "whl", "css", "js"}
#: Dotted names in docs that are data, not code: record fields, span attributes, labels.
NOT_CODE = {"payload", "events", "traces", "session", "attempts", "schedules", "batches"}


def test_docs_name_only_code_that_exists() -> None:
    """Every `module.name` a page names in backticks (`runner.execute`,
    `defaults.choose_sandbox_runtime`, `orchestrator.cluster.RayExecutor`) exists in the code
    under that module: a page cannot keep a name the code has moved or dropped."""
    modules = our_modules()
    stale = []
    for page in hand_written_pages():
        text = page.read_text()
        for ref in set(re.findall(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`", text)):
            parts = ref.split(".")
            if parts[-1] in FILE_SUFFIXES or parts[0] in NOT_CODE:
                continue
            if parts[0] == "orchestrator" and not resolves("orchestrator", parts[1:2]):
                continue  # a label or span attribute (`orchestrator.store`, ...)
            candidates = modules.get(parts[0], [])
            if not candidates:
                continue
            if not any(resolves(name, parts[1:]) for name in candidates):
                stale.append(f"{page.relative_to(REPO)}: {ref}")
    assert not stale, f"names the code does not have: {stale}"


@pytest.mark.parametrize("package", ["orchestrator.batch", "orchestrator.schedules"])
def test_a_package_docstring_lists_exactly_its_modules(package: str) -> None:
    module = importlib.import_module(package)
    assert module.__file__
    folder = Path(module.__file__).parent
    doc = ast.get_docstring(ast.parse(Path(module.__file__).read_text())) or ""
    named = set(re.findall(r"`(\w+)\.py`", doc))
    actual = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    assert named == actual, f"missing: {actual - named}; not modules: {named - actual}"


README = (REPO / "README.md").read_text()


def test_the_readme_is_a_short_introduction_without_history() -> None:
    assert len(README.splitlines()) <= 250
    assert not re.search(r"20\d\d-\d\d-\d\d", README), "a date in the README"
    for section in (
        "## Quick start",
        "## Commands",
        "## Where to read next",
        "## Running the tests",
    ):
        assert section in README


def readme_command_lines() -> list[list[str]]:
    """Every `orchestrator ...` command of the README's shell blocks, as argv after the word
    `orchestrator` (continuation lines joined, `VAR=value` prefixes and comments dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("#", 1)[0].split("&&"):
                words = shlex.split(part)
                while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
                    words.pop(0)
                if words and words[0] == "orchestrator":
                    commands.append(words[1:])
    return commands


def test_every_command_the_readme_shows_parses() -> None:
    """The commands a reader copies from the README are commands the parser takes (the quick
    start itself is run by tests/project/test_packaging.py and scripts/quickstart.sh)."""
    commands = readme_command_lines()
    assert len(commands) >= 3, commands
    for argv in commands:
        build_parser().parse_args(argv)


def test_the_readmes_python_example_uses_public_names() -> None:
    (example,) = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    tree = ast.parse(example)
    import orchestrator

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.module == "orchestrator"
            for alias in node.names:
                assert alias.name in orchestrator.__all__, alias.name
                assert getattr(orchestrator, alias.name)


def test_the_readmes_links_reach_files_of_the_repository() -> None:
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith(("http://", "https://")):
            assert (REPO / target).exists(), target


def test_every_commands_help_names_the_guide_that_explains_it() -> None:
    from orchestrator.cli.parser import COMMANDS

    parser = build_parser()
    assert "Documentation: docs/" in parser.format_help()
    by_name = {c.name: c.guide for c in COMMANDS}
    for child in subcommands(parser):
        command = child.prog.split()[1]
        guide = by_name[command]
        assert (REPO / guide).is_file(), guide
        assert child.format_help().rstrip().endswith(f"Explained in {guide}."), child.prog


def test_the_failures_guide_explains_every_exit_code() -> None:
    from orchestrator.schedules.firing import EXIT_SKIPPED
    from orchestrator.spec import EXIT_CODES

    page = (DOCS / "guides" / "failures.md").read_text()
    for status, code in EXIT_CODES.items():
        assert f"| `{code}` | `{status}` |" in page, status
    assert f"| `{EXIT_SKIPPED}` | skipped |" in page and "| `2` | bad input |" in page


def test_every_test_a_page_names_exists() -> None:
    """A page that says where a promise is tested names a test file that is there."""
    named = {
        (page, path)
        for page in hand_written_pages()
        for path in re.findall(r"`(tests/[\w/.]+?)/?`", page.read_text())
    }
    missing = [f"{p.relative_to(REPO)}: {path}" for p, path in named if not (REPO / path).exists()]
    assert not missing, missing


def test_every_per_task_limit_is_named_where_a_tasks_file_is_explained() -> None:
    """The batch help's list of a tasks row's limits is made from the code, and the batch
    guide names each of them too."""
    from orchestrator.spec import SETTABLE_LIMITS

    parser = build_parser()
    (batch,) = [p for p in subcommands(parser) if p.prog == "orchestrator batch"]
    help_text = batch.format_help()
    guide = (DOCS / "guides" / "batch.md").read_text().split("## Output directory")[0]
    for limit in SETTABLE_LIMITS:
        assert limit in help_text, limit
        assert f"`{limit}`" in guide, limit
