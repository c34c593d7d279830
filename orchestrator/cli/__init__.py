"""The `orchestrator` command: a thin layer over the Python API, one module per command group."""

from __future__ import annotations

import argparse
import sys

from ..errors import OrchestratorError
from .batch import add_batch_parser
from .common import EPILOG_EXIT
from .images import add_images_parser
from .payload import add_cleanup_parser, add_payload_parser
from .run import add_run_parser
from .runs import add_runs_parser
from .schedule import add_schedule_parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except OrchestratorError as exc:
        print(f"error: {exc.cause}", file=sys.stderr)
        if exc.fix:
            print(f"  fix: {exc.fix}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


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
