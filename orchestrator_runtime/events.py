"""The event stream: numbered JSON lines on a private file descriptor, secrets masked.

Standard library only: events must work before (and without) smolagents being importable.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

from .masking import Masker


class EventStream:
    """Writes events to `fd`, one JSON object per line; `run_end` closes the stream."""

    def __init__(self, fd: int, masker: Masker | None = None) -> None:
        self.fd = fd
        self.masker = masker or Masker()
        self.run_id: str | None = None
        self.closed = False
        self._seq = 0
        self._lock = threading.Lock()
        self._broken = False

    def emit(self, type_: str, **fields: Any) -> dict[str, Any] | None:
        """Emit one event; the envelope (type, seq, ts, run_id) is never masked."""
        if {"type", "seq", "ts", "run_id"} & fields.keys():
            raise ValueError(f"event fields may not override the envelope: {sorted(fields)}")
        with self._lock:
            if self.closed:
                return None
            event = {"type": type_, "seq": self._seq, "ts": time.time(), "run_id": self.run_id}
            event.update(self.masker.clean(fields))
            self._seq += 1
            if type_ == "run_end":
                self.closed = True
            self._write((json.dumps(event, allow_nan=False) + "\n").encode())
            return event

    def _write(self, data: bytes) -> None:
        if self._broken:
            return
        try:
            while data:
                data = data[os.write(self.fd, data) :]
        except OSError as exc:  # the reader went away: keep running, result_path still works
            self._broken = True
            print(f"orchestrator_runtime: event stream lost: {exc}", file=sys.stderr)


def write_result(path: str, event: dict[str, Any]) -> None:
    """Write the run_end event to `path` atomically (best effort: the stream is the main copy)."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as file:
            json.dump(event, file)
        os.replace(tmp, path)
    except OSError as exc:
        print(f"orchestrator_runtime: cannot write result_path: {exc}", file=sys.stderr)
