"""Ctrl-C in the Python API: a request to stop, honoured at safe points, then raised.

Python's own SIGINT handling raises KeyboardInterrupt at whatever line runs: between the
engine creating a container and the caller holding on to it, say, which leaves that
container behind (seen: a batch's payload-check sandbox outlived a Ctrl-C). The command line
turns signals into a stop request (`cli/signals.py`); `run`, `Pool.run` and `run_batch` do
the same while they run in the main thread under Python's default handler:

    with stop_on_interrupt(cancel):   # SIGINT sets `cancel`; the work stops, cleans up...
        result = work(cancel)
    # ...and KeyboardInterrupt is raised here, once everything it started is removed.

A second SIGINT raises KeyboardInterrupt at once (the old behaviour, for a user who will not
wait). A handler of the caller's own (a notebook's, a server's) is left alone, as is any
call from another thread (signals reach only the main one).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


@contextmanager
def stop_on_interrupt(cancel: threading.Event) -> Iterator[None]:
    """While the body runs, SIGINT sets `cancel` instead of raising; KeyboardInterrupt is
    raised after the body ends (normally or not: its own exception goes first). A no-op
    outside the main thread or under a SIGINT handler that is not Python's default."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    interrupted = threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        if interrupted.is_set():  # asked twice: stop waiting for the cleanup
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        interrupted.set()
        cancel.set()

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if interrupted.is_set():
        raise KeyboardInterrupt
