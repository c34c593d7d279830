"""Warm E2B sandboxes: a pooled sandbox's runtime, started before any run takes it.

A pooled sandbox is created as a cold one is (same template, network options, labels, and a
slot under the process's cap), plus `LABEL_WARM`; then its lifetime is set to the pool's
time-to-live (E2B's own sandbox timeout: it ends the sandbox at that time whether or not any
orchestrator process is left), and the runtime is started with its stdin open, nothing in
its environment but `RUNTIME_ENV` and `POOLED_ENV`, no request file and no secret. It
imports smolagents (and the model's client library) and says `READY_LINE` on stderr. A run
that takes the sandbox first moves its lifetime to the run's (`Sandbox.take`), then writes
its request, secrets included, on that stdin and closes it (`IdleRuntime.send`): the request
is never a file in the sandbox and the secrets never a sandbox-level variable.
"""

from __future__ import annotations

import contextlib
import math
import shlex
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from orchestrator_runtime.protocol import POOLED_ENV, READY_LINE

from ..base import StreamName
from .settings import with_retries
from .templates import PYTHON, RUNTIME_ENV, SANDBOX_USER

if TYPE_CHECKING:
    import e2b

#: How long a pooled sandbox's runtime may take to import what every run needs.
IDLE_READY_TIMEOUT = 120.0
#: The request goes to the runtime's stdin in chunks of this size, in one input stream (a
#: payload may be megabytes; one envd message each chunk).
STDIN_CHUNK = 256 * 1024


def idle_lifetime(ttl: float) -> int:
    """A pooled sandbox's E2B timeout for a pool's time-to-live (whole seconds, as E2B
    takes it; never shorter than the pool believes, so the pool replaces it first)."""
    return int(math.ceil(ttl))


def idle_command(command: tuple[str, ...]) -> str:
    """The runtime's command line in the template (its interpreter), with the options of
    the run's command (`--preload MODULE`), and no request: it reads one on stdin."""
    module = "orchestrator_runtime"
    options = command[command.index(module) + 1 :] if module in command else ()
    return shlex.join(["exec", PYTHON, "-m", module, *options])


class IdleRuntime:
    """The runtime of a pooled sandbox: started idle, ready once it said so, then given one
    request on stdin. `attempts`: tries for each API call (transient faults)."""

    def __init__(self, sandbox: e2b.Sandbox, handle: Any, attempts: int) -> None:
        self.sandbox = sandbox
        self.handle = handle
        self.attempts = attempts
        #: What the runtime wrote before its READY_LINE (warnings, say), for the run's record.
        self.early: list[tuple[StreamName, bytes]] = []
        self.sent = False

    @classmethod
    def start(
        cls, sandbox: e2b.Sandbox, command: tuple[str, ...], ttl: float, attempts: int
    ) -> IdleRuntime:
        """Set the sandbox's lifetime to `ttl`, then start its runtime idle, waiting on its
        stdin. Raises the SDK's errors."""
        with_retries(
            attempts,
            lambda: sandbox.set_timeout(idle_lifetime(ttl)),
            what="sandbox set timeout",
            progress=lambda _m: None,
        )
        handle = with_retries(
            attempts,
            lambda: sandbox.commands.run(
                idle_command(command),
                background=True,
                stdin=True,
                envs={**RUNTIME_ENV, POOLED_ENV: "1"},
                user=SANDBOX_USER,
                cwd="/tmp",
                timeout=0,  # no limit on the connection: the sandbox's lifetime is the limit
            ),
            what="idle start",
            progress=lambda _m: None,
        )
        return cls(sandbox, handle, attempts)

    def wait_ready(self, timeout: float = IDLE_READY_TIMEOUT) -> None:
        """Until the runtime has written READY_LINE on stderr; what it wrote before is kept
        in `early`. Then the output stream is let go (the runtime goes on waiting): an idle
        sandbox holds no connection of this process, however long it idles, and its run
        connects afresh (`send`). Raises RuntimeError when its output ends first, or when it
        is not ready within `timeout` (the sandbox is killed then; the caller removes it)."""
        seen = ""
        watchdog = threading.Timer(timeout, self._kill)
        watchdog.daemon = True
        watchdog.start()
        try:
            for stdout, stderr, _pty in self.handle:
                if stdout:
                    self.early.append(("stdout", stdout.encode()))
                elif stderr:
                    seen += stderr
                    if READY_LINE in seen:
                        before, after = seen.split(READY_LINE, 1)
                        parts = (before, after)
                        self.early += [("stderr", part.encode()) for part in parts if part]
                        with contextlib.suppress(Exception):
                            self.handle.disconnect()
                        return
        except Exception:  # the stream broke (or the watchdog killed the sandbox)
            pass
        finally:
            watchdog.cancel()
        raise RuntimeError(
            f"the pooled E2B sandbox ended before it was ready (within {timeout:g} s); its "
            f"last words: {seen[-500:]!r}"
        )

    def output(self) -> Iterator[tuple[StreamName, bytes]]:
        """What the runtime wrote before it was ready, once (the run's stream, `send`'s
        handle, has what it writes after)."""
        early, self.early = self.early, []
        yield from early

    def send(self, body: str) -> Any:
        """Connect to the waiting runtime's output, then write the request (one JSON object,
        its secrets in it) on its stdin and close it; returns the command's new handle, for
        the run's stream (the runtime writes nothing between its READY_LINE and its request,
        so nothing is missed). Raises the SDK's errors."""
        data = body.encode()
        chunks = [data[i : i + STDIN_CHUNK] for i in range(0, len(data), STDIN_CHUNK)]
        pid = self.handle.pid
        self.sent = True
        self.handle = with_retries(
            self.attempts,
            lambda: self.sandbox.commands.connect(pid, timeout=0),  # no limit: the run's is
            what="connect",
            progress=lambda _m: None,
        )
        # Not retried: a stream broken halfway could leave half a request in the pipe; the
        # run ends infra_error and a batch retries it in a fresh sandbox.
        self.sandbox.commands.stream_input(pid, chunks)
        self.sandbox.commands.close_stdin(pid)
        return self.handle

    def _kill(self) -> None:
        with contextlib.suppress(Exception):
            self.sandbox.kill()
