"""The event stream: numbered JSON lines on a private file descriptor, secrets masked.

Standard library only: events must work before (and without) smolagents being importable.
"""

from __future__ import annotations

import base64
import json
import math
import os
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

MASK = "***"
#: Derived forms (lines of a multi-line secret, base64 fragments) shorter than this are not
#: masked: they would match ordinary text. The whole secret value is always masked.
MIN_DERIVED_LENGTH = 4


def _base64_forms(value: bytes) -> set[str]:
    """The base64 text that `value` produces on its own and inside a longer encoded blob.

    Like GitHub Actions: encode with 0, 1 and 2 leading bytes so every 3-byte alignment is
    covered, then drop the characters that depend on neighbouring bytes.
    """
    forms: set[str] = set()
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        forms.add(encode(value).decode())
        for offset in (0, 1, 2):
            text = encode(b"\0" * offset + value).decode().rstrip("=")
            text = text[(offset * 8 + 5) // 6 :]  # characters mixing prefix bits
            if (offset + len(value)) % 3:
                text = text[:-1]  # last character mixes in whatever follows
            forms.add(text)
    return forms


class Masker:
    """Replaces every secret value, each line of it and its base64 forms by `***`."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        needles: set[str] = set()
        for value in secrets:
            if not value:
                continue
            needles.add(value)
            derived = {line.strip() for line in value.splitlines()}
            derived |= _base64_forms(value.encode())
            needles |= {n for n in derived if len(n) >= MIN_DERIVED_LENGTH}
        self._needles = sorted(needles, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for needle in self._needles:
            if needle in text:
                text = text.replace(needle, MASK)
        return text

    def clean(self, value: Any) -> Any:
        """A JSON-safe copy of `value` with every string masked (str() for unknown objects)."""
        if value is None or isinstance(value, bool | int):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else str(value)
        if isinstance(value, str):
            return self(str(value))  # str(): drop str subclasses such as AgentText
        if isinstance(value, dict):
            return {self(str(k)): self.clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple | set | frozenset):
            return [self.clean(v) for v in value]
        return self(str(value))


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
