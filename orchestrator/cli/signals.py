"""SIGINT and SIGTERM as a request to stop, not an exception at a random line.

`main()` installs these handlers before anything else is imported, so a signal at any moment
of a command's life only sets `STOP`: a run checks it at safe points (never between creating
a container and holding on to it), removes what it started, records `cancelled` and the
command exits 130. A second signal says it is still cleaning up; a third exits at once,
leaving leftovers to the next command (which closes orphaned runs) or `orchestrator cleanup`.

Commands that do not watch `STOP` get Python's usual behaviour back (`restore_defaults`).
Standard library only: this module is imported first, on every command.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

#: Set by the first SIGINT or SIGTERM.
STOP = threading.Event()
#: Exit status of a command stopped by a signal (the `cancelled` status's exit code).
EXIT_STOPPED = 130
_count = [0]
_listeners: list[Callable[[str], None]] = []


def _handler(signum: int, frame: Any) -> None:
    _count[0] += 1
    name = signal.Signals(signum).name
    if _count[0] >= 3:
        sys.stderr.write(
            f"orchestrator: {name} again: exiting without cleanup; the next orchestrator "
            "command (or `orchestrator cleanup`) removes what was left\n"
        )
        os._exit(EXIT_STOPPED)
    message = (
        f"{name}: stopping; what was started is being removed"
        if _count[0] == 1
        else f"{name}: still removing what was started; once more to exit without cleanup"
    )
    STOP.set()
    for listener in list(_listeners):
        listener(message)


def install() -> None:
    """Turn SIGINT and SIGTERM into `STOP` (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _handler)


def on_stop(listener: Callable[[str], None]) -> None:
    """Call `listener` with a one-line message on each stopping signal (for live displays)."""
    _listeners.append(listener)


def restore_defaults() -> None:
    """Python's usual SIGINT (KeyboardInterrupt) and SIGTERM, for commands that do not watch
    STOP; a signal that came already is acted on now."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if STOP.is_set():
        raise KeyboardInterrupt
