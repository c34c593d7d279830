"""The argument parser of the `orchestrator` command: every command group's module adds its
own subcommands."""

from __future__ import annotations

import argparse
from typing import Any

from .batch import add_batch_parser
from .common import EPILOG_EXIT
from .images import add_images_parser
from .payload import add_cleanup_parser, add_payload_parser
from .report import add_batch_verbs
from .run import add_run_parser
from .runs import add_runs_parser
from .schedule import add_schedule_parser
from .view import add_view_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orchestrator",
        description="Run whole smolagents multi-agent programs in hardened sandboxes.",
        epilog=EPILOG_EXIT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
    return parser


class CommandParser(argparse.ArgumentParser):
    """A command's parser that may also hold verbs beside its own positionals, as `batch`
    does: `batch report DIR` goes to the `report` parser and `batch PAYLOAD TASKS` keeps
    working (argparse's subparsers would make every first word a verb)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.verbs: dict[str, argparse.ArgumentParser] = {}

    def add_verb(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        verb = argparse.ArgumentParser(prog=f"{self.prog} {name}", **kwargs)
        self.verbs[name] = verb
        return verb

    def parse_known_args(  # type: ignore[override]
        self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if args and args[0] in self.verbs:
            return self.verbs[args[0]].parse_known_args(args[1:], namespace)
        return super().parse_known_args(args, namespace)
