"""The `orchestrator` command: a thin layer over the Python API, one module per command group.

`main` installs the signal handlers (`signals.py`) before the commands are even imported, so
a SIGINT or SIGTERM at any moment is handled the same way.
"""

from __future__ import annotations

import contextlib
import os
import sys

from . import signals


def main(argv: list[str] | None = None) -> int:
    """The command's exit code; 141 when its reader closed the pipe (`| head`), whatever
    the command did meanwhile (a run goes on and is recorded as it ended)."""
    signals.install()
    from .output import guard_streams, reader_gone

    saved = guard_streams()
    try:
        code = _main(argv)
    finally:
        sys.stdout.flush()  # through the guards: what Python flushes at exit is written now
        sys.stderr.flush()
        sys.stdout, sys.stderr = saved
    return reader_went_away() if reader_gone() else code


def _main(argv: list[str] | None) -> int:
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
    with contextlib.suppress(OSError, ValueError):  # no descriptor (a test's StringIO)
        os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by the pipe
