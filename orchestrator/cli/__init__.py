"""The `orchestrator` command: a thin layer over the Python API, one module per command group.

`main` installs the signal handlers (`signals.py`) before the commands are even imported, so
a SIGINT or SIGTERM at any moment is handled the same way.
"""

from __future__ import annotations

import os
import sys

from . import signals


def main(argv: list[str] | None = None) -> int:
    signals.install()
    from ..errors import OrchestratorError
    from .output import error_object, print_json, say
    from .parser import UsageError, build_parser, commands_named

    words = sys.argv[1:] if argv is None else argv
    completing = "_ARGCOMPLETE" in os.environ  # the shell asks for completions: every command
    parser = build_parser(None if completing else commands_named(words))
    if completing:
        import argcomplete

        argcomplete.autocomplete(parser)
    args = None
    wants_json = "--json" in words
    try:
        args = parser.parse_args(argv)
        wants_json = bool(getattr(args, "json", False))
        if not getattr(args, "handler", None):
            parser.print_help()
            return 2
        from . import display

        display.VERBOSE = bool(args.verbose)
        display.route_logs()
        if not getattr(args, "watches_stop", False):
            signals.restore_defaults()
        code = int(args.handler(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return code
    except (OrchestratorError, UsageError) as exc:
        if isinstance(exc, UsageError):
            exc.parser.print_usage(sys.stderr)
        say(exc.cause, kind="error")
        if exc.fix:
            print(f"  fix: {exc.fix}", file=sys.stderr)
        if wants_json:  # scripts read stdout: they get an object, not an empty stream
            problems = getattr(exc, "problems", ())
            print_json(error_object(exc.cause, exc.fix, exc.exit_code, exc.field, problems))
        return exc.exit_code
    except KeyboardInterrupt:
        return signals.EXIT_STOPPED
    except BrokenPipeError:
        return reader_went_away()


def reader_went_away() -> int:
    """stdout's reader closed it (`| head`): stop quietly, as `cat` does. Python would print a
    traceback, then another one when it flushes stdout at exit, so stdout becomes /dev/null."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by the pipe
