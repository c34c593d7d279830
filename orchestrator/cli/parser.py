"""The argument parser of the `orchestrator` command: every command group's module adds its
own subcommands."""

from __future__ import annotations

import argparse

from .batch import add_batch_parser
from .common import EPILOG_EXIT
from .images import add_images_parser
from .payload import add_cleanup_parser, add_payload_parser
from .run import add_run_parser
from .runs import add_runs_parser
from .schedule import add_schedule_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orchestrator",
        description="Run whole smolagents multi-agent programs in hardened sandboxes.",
        epilog=EPILOG_EXIT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    add_run_parser(sub)
    add_images_parser(sub)
    add_runs_parser(sub)
    add_payload_parser(sub)
    add_cleanup_parser(sub)
    add_batch_parser(sub)
    add_schedule_parser(sub)
    return parser
