"""A runtime started before its request (a pooled sandbox, or a snapshot's): it tells the
deadline keeper when its run begins, and, restored from a snapshot (the host's
`backends/docker/snapshots.py`), waits for the host's word that it was and reseeds."""

from __future__ import annotations

import contextlib
import os
import sys

from .deadline import KEEPER_FD_ENV, RESTORABLE_ENV, RESTORED_BYTE
from .protocol import RESTORE_DONE_LINE, RESTORED_ACK_LINE, RESTORED_LINE
from .request import RequestError

#: Any byte but RESTORED_BYTE starts the run's deadline; this one says so.
RUN_BEGUN_BYTE = b"1"


def await_restore() -> None:
    """For a restorable runtime (its keeper set RESTORABLE_ENV; nothing to do otherwise):
    block until the host's first line (RESTORED_LINE, written as soon as it restored this
    process from a snapshot) says so, reseed, and tell the keeper, whose idle time then
    starts again (`deadline.RESTORED_BYTE`); RESTORED_ACK_LINE asks for RESTORE_DONE_LINE
    on stderr then. Raises RequestError for anything else on stdin
    (a restorable sandbox is only ever started from its snapshot)."""
    if os.environ.pop(RESTORABLE_ENV, None) != "1":
        return
    line = sys.stdin.buffer.readline()  # the request that follows stays in this buffer
    if line not in (RESTORED_LINE.encode(), RESTORED_ACK_LINE.encode()):
        raise RequestError("a restorable sandbox's stdin did not start with the restore line")
    reseed()
    tell_keeper(RESTORED_BYTE, close=False)
    if line == RESTORED_ACK_LINE.encode():  # the host waits for this before the request
        sys.stderr.write(RESTORE_DONE_LINE)
        sys.stderr.flush()


def reseed() -> None:
    """Every clone of a snapshot starts with the same memory: give each its own random state
    before anything uses it. `random`'s global generator and tempfile's name sequence (both
    seeded at import, and tempfile reseeds only when the pid changes, which it does not) are
    seeded again from the restored sandbox's own entropy; OpenSSL's generator, when loaded,
    gets fresh entropy mixed in. What cannot be redone is said in the snapshot module's
    docstring (the hash seed, the memory layout)."""
    import random
    import tempfile

    random.seed()
    tempfile._name_sequence = None  # type: ignore[attr-defined]  # made again, seeded anew
    ssl = sys.modules.get("ssl")
    if ssl is not None:
        ssl.RAND_add(os.urandom(32), 32.0)
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


def start_deadline() -> None:
    """Tell the keeper (pooled sandboxes only) that the run has begun: its deadline becomes
    the run's. One byte, once; the pipe is closed before any payload code exists."""
    tell_keeper(RUN_BEGUN_BYTE, close=True)


def tell_keeper(byte: bytes, close: bool) -> None:
    """Write `byte` to the keeper's pipe, if this runtime has one; `close`: and close it, for
    good (the environment no longer names it). A keeper gone or a bad number leaves the
    keeper's own deadline, which is earlier: never an error."""
    fd_text = os.environ.pop(KEEPER_FD_ENV, None) if close else os.environ.get(KEEPER_FD_ENV)
    if fd_text is None:
        return
    try:
        fd = int(fd_text)
    except ValueError:
        return
    try:
        os.write(fd, byte)
    except OSError:
        pass
    finally:
        if close:
            with contextlib.suppress(OSError):
                os.close(fd)
