"""Count the checks each test makes, so that moving or splitting tests can be shown to
weaken none: `python scripts/count_assertions.py > before.txt`, move, run it again, then
`python scripts/count_assertions.py --compare before.txt after.txt`.

A check is an `assert` statement or a `pytest.raises`/`pytest.warns` call (a `with` context
or the call form). A test is a `test_*` function at a module's top level or in a `Test*`
class of a `test_*.py` file under tests/; checks in helper functions are totalled per file
(`file::<helpers>`), since a test that calls a helper relies on them too. Static counts:
a parametrized test counts once, a check in a loop once.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
CHECK_CALLS = frozenset({"raises", "warns"})
HELPERS = "<helpers>"


def checks_in(node: ast.AST) -> int:
    """Asserts and pytest.raises/pytest.warns calls anywhere under `node`."""
    count = 0
    for child in ast.walk(node):
        if isinstance(child, ast.Assert):
            count += 1
        elif isinstance(child, ast.Call):
            func = child.func
            if (
                isinstance(func, ast.Attribute)
                and func.attr in CHECK_CALLS
                and isinstance(func.value, ast.Name)
                and func.value.id == "pytest"
            ):
                count += 1
    return count


def tests_of(tree: ast.Module) -> dict[str, int]:
    """Each test's checks by its name in the file (`Class::test` for a method), and the
    checks outside any test under HELPERS."""
    found: dict[str, int] = {}
    in_tests = 0
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith(
            "test"
        ):
            found[node.name] = checks_in(node)
            in_tests += found[node.name]
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for item in node.body:
                if isinstance(
                    item, (ast.FunctionDef, ast.AsyncFunctionDef)
                ) and item.name.startswith("test"):
                    found[f"{node.name}::{item.name}"] = checks_in(item)
                    in_tests += found[f"{node.name}::{item.name}"]
    found[HELPERS] = checks_in(tree) - in_tests
    return found


def count(root: Path) -> dict[str, int]:
    """`file::test` -> checks, for every test module under `root`."""
    counts: dict[str, int] = {}
    for path in sorted(root.rglob("test_*.py")):
        relative = path.relative_to(REPO).as_posix()
        for name, checks in tests_of(ast.parse(path.read_text(), str(path))).items():
            counts[f"{relative}::{name}"] = checks
    return counts


def report(counts: dict[str, int]) -> str:
    tests = {key: n for key, n in counts.items() if not key.endswith(f"::{HELPERS}")}
    lines = [f"{key} {n}" for key, n in counts.items()]
    lines.append(f"TOTAL tests={len(tests)} test_checks={sum(tests.values())}")
    lines.append(f"TOTAL checks_with_helpers={sum(counts.values())}")
    return "\n".join(lines) + "\n"


def read(path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in path.read_text().splitlines():
        if line.startswith("TOTAL"):
            continue
        key, _, n = line.rpartition(" ")
        counts[key] = int(n)
    return counts


def by_name(counts: dict[str, int]) -> dict[str, list[int]]:
    """Checks per test name, the file left out (a moved test keeps its name); a name that
    several files use has several counts, compared in order."""
    named: dict[str, list[int]] = defaultdict(list)
    for key, n in counts.items():
        if not key.endswith(f"::{HELPERS}"):
            named[key.split("::", 1)[1]].append(n)
    return {name: sorted(ns) for name, ns in named.items()}


def compare(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """Every way `after` checks less than `before`: a test gone, fewer checks, fewer in all."""
    problems = []
    old, new = by_name(before), by_name(after)
    for name, counts in sorted(old.items()):
        now = new.get(name, [])
        if len(now) < len(counts):
            problems.append(f"missing: {name} (was {len(counts)}, now {len(now)})")
        elif any(a < b for a, b in zip(sorted(now)[::-1], counts[::-1], strict=False)):
            problems.append(f"fewer checks: {name} {counts} -> {now}")
    if sum(after.values()) < sum(before.values()):
        problems.append(f"fewer checks in all: {sum(before.values())} -> {sum(after.values())}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        problems = compare(read(args.compare[0]), read(args.compare[1]))
        print("\n".join(problems) or "ok: every test kept, none with fewer checks")
        return 1 if problems else 0
    sys.stdout.write(report(count(TESTS)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
