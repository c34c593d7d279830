"""The event relay: the payload never holds the host's event channel.

The runtime forks before the request is looked at. The child runs everything else (secrets,
smolagents, the payload, the agents) and writes its events to a pipe; the parent holds the
only copy of the host's channel, marks itself not dumpable (no process of the same user can
ptrace it or read its memory) and relays the child's frames after checking them:

- frames numbered 0, 1, 2, ..., each one JSON object of at most MAX_FRAME_BYTES;
- exactly one `run_end`, last; the parent holds it back until the child has exited, and
  relays it only if it agrees with the child's real exit status (success <=> exit 0).

Anything else (a frame out of sequence or after the end, a line that is not a frame, a
`run_end` that contradicts the exit status, no `run_end` at all) ends the run with the
parent's own `run_end`: state `error`, error type `protocol_violation` (or `no_result`),
after a `protocol_violation` event per problem. The host checks the stream again; this makes
forging it from payload code impossible rather than just visible.

What the child can still do is claim its own answer: it is the agent's process.
Standard library only.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import sys
import time
from typing import Any

from .events import write_result
from .protocol import MAX_FRAME_BYTES, FrameCheck

#: Exit status when the parent ended the run itself (as the runtime's EXIT_AGENT_FAILED).
EXIT_VIOLATION = 1
PR_SET_DUMPABLE = 4
#: What the relay still reads once the child has exited: its last frames, not a stream that a
#: process it forked keeps writing.
MAX_DRAIN_BYTES = 4 * MAX_FRAME_BYTES
#: How often the relay looks at the child while its pipe is quiet.
POLL_SECONDS = 0.05


def make_undumpable() -> None:
    """Best effort: without it the host's own checks still catch forged frames."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0:
            return
        reason = os.strerror(ctypes.get_errno())
    except OSError as exc:
        reason = str(exc)
    print(f"orchestrator_runtime: cannot protect the event relay: {reason}", file=sys.stderr)


class Relay:
    """Reads the child's frames from `source`, writes the good ones to `sink`."""

    def __init__(self, source: int, sink: int, run_id: str | None, result_path: str | None):
        self.source = source
        self.sink = sink
        self.run_id = run_id
        self.result_path = result_path
        #: The child's frames are checked as they come; the host gets its own numbering (the
        #: parent's events come in between, so relayed frames are renumbered).
        self.frames = FrameCheck()
        self.seq = 0
        self.end: dict[str, Any] | None = None
        self.problems: list[str] = []

    def run(self, child: int) -> int:
        """Relay until the child has exited (and its frames are read), then settle the run's
        end; the exit code. Not until EOF: a process the payload forked may hold the pipe's
        write end open forever (the container's end kills it)."""
        pending = bytearray()
        too_long = False
        os.set_blocking(self.source, False)
        status: int | None = None
        after_exit = 0  # bytes read after the child exited (a forked process may go on)
        while True:
            if status is None:
                pid, waited = os.waitpid(child, os.WNOHANG)
                status = waited if pid == child else None
            elif after_exit > MAX_DRAIN_BYTES:
                break
            chunk = _read(self.source, wait=status is None)
            if chunk is None:  # nothing more for now
                if status is not None:
                    break
                continue
            if not chunk:  # EOF: every writer is gone
                if status is None:
                    _, status = os.waitpid(child, 0)
                break
            pending += chunk
            if status is not None:
                after_exit += len(chunk)
            while (newline := pending.find(b"\n")) >= 0:
                if too_long:
                    too_long = False
                else:
                    self.frame(bytes(pending[:newline]))
                del pending[: newline + 1]
            if len(pending) > MAX_FRAME_BYTES:
                if not too_long:
                    self.problem(f"a frame over {MAX_FRAME_BYTES} bytes")
                too_long = True
                pending.clear()
        if pending.strip() and not too_long:
            self.frame(bytes(pending))
        code = os.waitstatus_to_exitcode(status)
        code = 128 - code if code < 0 else code  # killed by a signal: as a shell reports it
        return self.settle(code)

    def frame(self, line: bytes) -> None:
        if not line.strip():
            return
        event, problem = self.frames.check(line)
        if problem is not None:
            self.problem(problem)
            return
        if event["type"] == "run_end":
            self.end = event  # held back until the exit is known
            return
        self.relay(event)

    def settle(self, code: int) -> int:
        end = self.end
        succeeded = end is not None and end.get("state") == "success"
        if end is not None and not self.problems and succeeded == (code == 0):
            self.relay(end)
            if self.result_path:
                write_result(self.result_path, end)
            return code
        if end is not None and succeeded and code != 0:
            self.problem(f"the agent process reported success but exited with code {code}")
        if end is not None and not succeeded and code == 0:
            self.problem("the agent process reported no success but exited with code 0")
        if self.problems:
            message = "; ".join(dict.fromkeys(self.problems))
            error = {"type": "protocol_violation", "message": message, "kind": "internal"}
        else:
            message = f"the agent process exited with code {code} without a result"
            error = {"type": "no_result", "message": message, "kind": "internal"}
        event = self.emit("run_end", state="error", answer=None, error=error)
        if self.result_path:
            write_result(self.result_path, event)
        return code if code not in (0, None) else EXIT_VIOLATION

    def problem(self, reason: str) -> None:
        self.problems.append(reason)
        self.emit("protocol_violation", reason=reason)

    def relay(self, event: dict[str, Any]) -> None:
        event["seq"] = self.seq
        self.seq += 1
        self.write(json.dumps(event).encode())

    def emit(self, type_: str, **fields: Any) -> dict[str, Any]:
        event = {"type": type_, "seq": self.seq, "ts": time.time(), "run_id": self.run_id}
        event.update(fields)
        self.seq += 1
        self.write(json.dumps(event).encode())
        return event

    def write(self, line: bytes) -> None:
        data = line + b"\n"
        try:
            while data:
                data = data[os.write(self.sink, data) :]
        except OSError as exc:  # the host went away: the run goes on; result_path remains
            print(f"orchestrator_runtime: event stream lost: {exc}", file=sys.stderr)
            self.sink = os.open(os.devnull, os.O_WRONLY)


def _read(fd: int, *, wait: bool) -> bytes | None:
    """Up to 64 KiB from `fd` (b"" at EOF), or None when nothing is there (after waiting a
    little for it when `wait`)."""
    if wait:
        select.select([fd], [], [], POLL_SECONDS)
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return None
