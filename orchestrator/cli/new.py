"""`orchestrator new` and `orchestrator examples`: start a payload, or from a shipped one."""

from __future__ import annotations

import argparse
from typing import Any

from .output import print_json, print_table, say
from .parser import HELP


def add_new_parser(sub: Any) -> None:
    p = sub.add_parser(
        "new",
        help=HELP["new"],
        description="Write NAME/ with manifest.toml and agents.py (with --program: NAME.py, a "
        "plain smolagents program with a PEP 723 block): a manager CodeAgent, a managed "
        "ToolCallingAgent with one tool, and mock scripts for both, so that `orchestrator "
        "run NAME` (NAME.py) works offline at once. Change it from there.",
    )
    p.add_argument("name", help="payload name and folder (lowercase letters, digits, _ and -)")
    p.add_argument(
        "--program",
        action="store_true",
        help="write NAME.py, a program as its author would write it, instead of a payload folder",
    )
    p.add_argument("--dir", default=".", help="folder to create it in")
    p.add_argument("--json", action="store_true", help="print {name, path} as JSON")
    p.set_defaults(handler=cmd_new)


def add_examples_parser(sub: Any) -> None:
    ex = sub.add_parser(
        "examples",
        help=HELP["examples"],
        description="The shipped examples; run one by name: `orchestrator run research_team`.",
    )
    ex.add_argument("--json", action="store_true", help="print the examples as a JSON array")
    ex.set_defaults(handler=cmd_examples)


def cmd_new(args: argparse.Namespace) -> int:
    from ..payloads.scaffold import scaffold, scaffold_program

    folder = (
        scaffold_program(args.name, args.dir) if args.program else scaffold(args.name, args.dir)
    )
    if args.json:
        print_json({"name": args.name, "path": str(folder)})
        return 0
    print(folder)
    say(f"try it: orchestrator run {folder}   (then: orchestrator validate {folder})")
    if args.program:
        say(f"with its own models: HF_TOKEN=... orchestrator run --model program {folder}")
    return 0


def cmd_examples(args: argparse.Namespace) -> int:
    from ..payloads.examples import list_examples

    examples = list_examples()
    if args.json:
        print_json(examples)
        return 0
    if not examples:
        say("no examples are installed")
        return 0
    print_table(
        ("NAME", "DESCRIPTION", "EXAMPLE TASK"),
        [
            (e["name"], e.get("description") or e.get("error"), e.get("example_task"))
            for e in examples
        ],
    )
    say("run one by name: orchestrator run NAME")
    return 0
