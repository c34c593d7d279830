"""What every backend's model gateway does with the gateway's output, wherever it runs
(Docker's container, E2B's sandbox): its reports (one JSON line each on its stdout,
`gateway.read_report`) read live by a thread and handed to the runner through `events()`,
its stderr kept for its last words, and the run's end said on its stdin (`close`). A
backend's gateway says only how a line goes in (`_send`) and where its output comes from
(the lines handed to `_start_reader`)."""

from __future__ import annotations

import contextlib
import threading
import time
from abc import abstractmethod
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import OrchestratorError
from ..gateway import read_report
from .base import GatewayHandle

#: How long the gateway may take to hand in its totals at the end.
CLOSE_TIMEOUT = 3.0
#: The longest report line kept (a line is a few hundred bytes; nothing is unbounded).
MAX_LINE = 64 * 1024
#: A line of output: whether it came on stdout (else stderr), and its text.
Line = tuple[bool, str]


class GatewayError(OrchestratorError):
    """The model gateway could not be started (the run never starts without it)."""

    exit_code = 5


class GatewayReports(GatewayHandle):
    """A run's model gateway as its output tells it: ready, its reports, closed, ended."""

    def __init__(self) -> None:
        self._events: deque[dict[str, Any]] = deque()
        self._stderr: deque[str] = deque(maxlen=20)
        self._ready = threading.Event()  # it listens
        self._closed = threading.Event()  # it said `gateway_closed`: its totals are in
        self._ended = threading.Event()  # its output ended (it exited, or was lost)

    @abstractmethod
    def _send(self, line: str) -> None:
        """Write `line` on the gateway's stdin; raises when it cannot."""

    def _start_reader(self, lines: Iterable[Line], name: str) -> None:
        """Read `lines` (lazily: a generator) on a daemon thread until they end."""
        reader = threading.Thread(target=self._read, args=(lines,), name=name, daemon=True)
        reader.start()

    def _read(self, lines: Iterable[Line]) -> None:
        try:
            for on_stdout, text in lines:
                self._line(on_stdout, text.strip())
        finally:
            self._ended.set()

    def _line(self, on_stdout: bool, text: str) -> None:
        if not on_stdout:
            if text:
                self._stderr.append(text)
            return
        event = read_report(text)
        if event is None:
            return
        if event["type"] == "gateway_ready":
            self._ready.set()
            return
        self._events.append(event)
        if event["type"] == "gateway_closed":
            self._closed.set()

    def _wait_ready(self, timeout: float, gone: Callable[[], bool], where: str, fix: str) -> None:
        """Until the gateway listens; raises GatewayError with its last words when `gone()`
        says it will not, or after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not self._ready.wait(timeout=0.02):
            if gone() or time.monotonic() > deadline:
                raise GatewayError(
                    f"The model gateway did not start{where}. Its last output:\n"
                    + ("\n".join(self._stderr) or "(none)"),
                    fix,
                )

    def events(self) -> list[dict[str, Any]]:
        taken = []
        while self._events:
            taken.append(self._events.popleft())
        return taken

    def close(self) -> None:
        """Tell the gateway the run has ended and wait (briefly) for its totals; nothing to
        do when it never listened or its output has ended (no one would answer)."""
        if not self._ready.is_set() or self._ended.is_set():
            return
        with contextlib.suppress(Exception):  # gone already: its totals are what came
            self._send("stop\n")
        deadline = time.monotonic() + CLOSE_TIMEOUT
        while not self._closed.wait(timeout=0.02):
            if self._ended.is_set() or time.monotonic() > deadline:
                return
