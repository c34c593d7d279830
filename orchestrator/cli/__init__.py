"""The `orchestrator` command: a thin layer over the Python API, one module per command group.

`main` installs the signal handlers (`signals.py`) before the commands are even imported, so
a SIGINT or SIGTERM at any moment is handled the same way.
"""

from __future__ import annotations

import sys

from . import signals


def main(argv: list[str] | None = None) -> int:
    signals.install()
    from ..errors import OrchestratorError
    from .parser import build_parser

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        if not getattr(args, "watches_stop", False):
            signals.restore_defaults()
        return int(args.handler(args) or 0)
    except OrchestratorError as exc:
        print(f"error: {exc.cause}", file=sys.stderr)
        if exc.fix:
            print(f"  fix: {exc.fix}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return signals.EXIT_STOPPED
