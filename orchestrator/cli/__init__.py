"""The `orchestrator` command: a thin layer over the Python API, one module per command group.

`main` installs the signal handlers (`signals.py`) before the commands are even imported, so
a SIGINT or SIGTERM at any moment is handled the same way.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import threading
from typing import NoReturn

from . import signals

#: Whether the command that just ran left nothing of its own to finish (its parser's
#: `leaves_at_once`, set by `_main` when its handler returned): see `command`.
_done_with_process = False
#: Whether the cyclic garbage collector is held off for the process's start-up (`command`
#: holds it; `start_up_done` lets it go).
_collector_held = False


def command() -> NoReturn:
    """`orchestrator` as a process (the console script, `python -m orchestrator`): `main`,
    then the exit. A command whose parser says `leaves_at_once` (`run`: its record written
    and closed, its sandbox removed, its store's transactions committed) leaves without the
    interpreter's shutdown when no other thread of ours runs, as the in-sandbox runtime
    does: the module teardown and the store's WAL checkpoint (an fsync) took a noticeable
    share of each cold run after its result was printed
    (benchmarks/results/code_figures.md#leaving-the-process-at-once). atexit's functions run
    first (logging's flush, temporary directories' finalizers).

    The cyclic garbage collector is held off until the command's start-up is done
    (`start_up_done`): importing a command's modules (and, for `run`, the Docker SDK's)
    makes hundreds of thousands of objects and almost no garbage, yet triggers a collection
    every 700 of them."""
    global _collector_held
    gc.disable()
    _collector_held = True
    code = main()
    if _done_with_process and threading.active_count() == 1:
        atexit._run_exitfuncs()
        with contextlib.suppress(Exception):  # a reader gone: reader_went_away said so
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def start_up_done() -> None:
    """The end of the command's start-up, where `command` held the collector off (else
    nothing): what the start-up made is frozen (never scanned again: it lives as long as
    the process) and the collector runs again for what the command makes from now on. For
    `run`, once its payload is checked: the sandbox's create call comes next."""
    global _collector_held
    if _collector_held:
        _collector_held = False
        gc.freeze()
        gc.enable()


def main(argv: list[str] | None = None) -> int:
    """The command's exit code; 141 when its reader closed the pipe (`| head`), whatever
    the command did meanwhile (a run goes on and is recorded as it ended). A process's
    `run` begins restoring its sandbox first, where runsc-direct can (its head start:
    runsc_direct/head_start.py), and ends with what of it its run did not take removed."""
    signals.install()
    from .output import guard_streams, reader_gone

    saved = guard_streams()
    runs = argv is None and sys.argv[1:2] == ["run"]  # a process's `run`: its head start
    try:
        if runs:
            from ..backends.docker.runsc_direct import head_start

            head_start.begin(sys.argv[1:])
        code = _main(argv)
    except KeyboardInterrupt:  # while the head start began (`_main` catches its own)
        code = signals.EXIT_STOPPED
    finally:
        if runs:
            from ..backends.docker.runsc_direct import head_start

            head_start.finish()
        sys.stdout.flush()  # through the guards: what Python flushes at exit is written now
        sys.stderr.flush()
        sys.stdout, sys.stderr = saved
    return reader_went_away() if reader_gone() else code


def _main(argv: list[str] | None) -> int:
    from ..errors import OrchestratorError
    from .output import error_object, print_json, say
    from .parser import UsageError, build_parser, commands_named, lists_commands

    words = sys.argv[1:] if argv is None else argv
    completing = "_ARGCOMPLETE" in os.environ  # the shell asks for completions: every command
    if completing:
        import argcomplete

        parser = build_parser()
        argcomplete.autocomplete(parser)
    else:
        parser = build_parser(commands_named(words), listed=lists_commands(words))
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
        if not getattr(args, "starts_up_in_handler", False):  # (`run`: start_up_done)
            start_up_done()
        code = int(args.handler(args) or 0)
        global _done_with_process
        _done_with_process = bool(getattr(args, "leaves_at_once", False))
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
