"""The argument parser of the `orchestrator` command: every command group's module adds its
own subcommands."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from ..config import VERSION
from .batch import add_batch_parser
from .common import EPILOG_EXIT
from .images import add_images_parser
from .new import add_new_parser
from .payload import add_cleanup_parser, add_payload_parser
from .report import add_batch_verbs
from .run import add_run_parser
from .runs import add_runs_parser
from .schedule import add_schedule_parser
from .view import add_view_parser


class UsageError(Exception):
    """A command line argparse refuses: reported like every other bad input (exit 2, a JSON
    error object under --json) instead of argparse's own exit."""

    exit_code = 2
    fix = "See the command's --help."
    field: str | None = None

    def __init__(self, parser: argparse.ArgumentParser, cause: str) -> None:
        super().__init__(cause)
        self.parser = parser
        self.cause = cause


class Parser(argparse.ArgumentParser):
    """argparse, with every option's default shown in --help and errors raised, not exited."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        if kwargs.get("formatter_class") in (None, argparse.RawDescriptionHelpFormatter):
            kwargs["formatter_class"] = HelpFormatter
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(self, message)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written; each option's default appended to its help
    unless the help already says it (`default`) or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text.lower()
            or default in (None, False, [], argparse.SUPPRESS)
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="orchestrator",
        description="Run whole smolagents multi-agent programs in hardened sandboxes.",
        epilog=EPILOG_EXIT,
    )
    parser.add_argument("--version", action="version", version=f"orchestrator {VERSION}")
    parser.add_argument(
        "--verbose", "-v", action="store_true",
        help="also show build tools' output (pip, docker build) and repeated notices",
    )  # fmt: skip
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=CommandParser)
    add_run_parser(sub)
    add_images_parser(sub)
    add_runs_parser(sub)
    add_payload_parser(sub)
    add_cleanup_parser(sub)
    add_batch_parser(sub)
    add_schedule_parser(sub)
    add_batch_verbs(sub)
    add_view_parser(sub)
    add_new_parser(sub)
    for command in subcommands(parser):  # -v works after the command too: `run -v ...`
        command.add_argument(
            "--verbose", "-v", action="store_true", default=argparse.SUPPRESS,
            help="also show build tools' output and repeated notices",
        )  # fmt: skip
    return parser


class CommandParser(Parser):
    """A command's parser that may also hold verbs beside its own positionals, as `batch`
    does: `batch report DIR` goes to the `report` parser and `batch PAYLOAD TASKS` keeps
    working (argparse's subparsers would make every first word a verb)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.verbs: dict[str, argparse.ArgumentParser] = {}

    def add_verb(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        verb = Parser(prog=f"{self.prog} {name}", **kwargs)
        self.verbs[name] = verb
        return verb

    def parse_known_args(  # type: ignore[override]
        self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if args and args[0] in self.verbs:
            return self.verbs[args[0]].parse_known_args(args[1:], namespace)
        return super().parse_known_args(args, namespace)


def subcommands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every command's parser that takes options (leaves, groups and verbs), depth first."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                found += [child, *subcommands(child)]
                for verb in getattr(child, "verbs", {}).values():
                    found += [verb, *subcommands(verb)]
    return found
