"""Processes started through envd's `process.Process` service, backed by `docker exec`."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.process import process_pb
from protobuf import Oneof

from .docker_sandbox import (
    MARKER,
    STDERR,
    STDOUT,
    ContainerGone,
    ExecStream,
    SandboxContainer,
    UserInfo,
)

SIGNALS = {"KILL": 9, "TERM": 15}


class SandboxGone(Exception):
    """Put on a process's event queues when its sandbox vanished mid-stream."""


Item = process_pb.ProcessEvent | SandboxGone


@dataclass
class _Subscriber:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Item] = field(default_factory=asyncio.Queue)


# Oneof field names typed as literals, so type checkers match them to the message fields.
_START: Literal["start"] = "start"
_DATA: Literal["data"] = "data"
_END: Literal["end"] = "end"
_KEEPALIVE: Literal["keepalive"] = "keepalive"
_STDOUT: Literal["stdout"] = "stdout"
_STDERR: Literal["stderr"] = "stderr"


def data_event(stream: int, data: bytes) -> process_pb.ProcessEvent:
    """A stdout or stderr data event."""
    output = Oneof(_STDOUT, data) if stream == STDOUT else Oneof(_STDERR, data)
    return process_pb.ProcessEvent(
        event=Oneof(_DATA, process_pb.ProcessEvent.DataEvent(output=output))
    )


def start_event(pid: int) -> process_pb.ProcessEvent:
    return process_pb.ProcessEvent(event=Oneof(_START, process_pb.ProcessEvent.StartEvent(pid=pid)))


def keepalive_event() -> process_pb.ProcessEvent:
    return process_pb.ProcessEvent(event=Oneof(_KEEPALIVE, process_pb.ProcessEvent.KeepAlive()))


def end_event(exit_code: int, signal: str | None) -> process_pb.ProcessEvent:
    """An end event shaped like envd's (Go's ProcessState): -1 and "signal: ..." if signalled."""
    if signal is not None and exit_code == 128 + SIGNALS[signal]:
        status = "signal: killed" if signal == "KILL" else "signal: terminated"
        end = process_pb.ProcessEvent.EndEvent(
            exit_code=-1, exited=False, status=status, error=status
        )
    else:
        status = f"exit status {exit_code}"
        end = process_pb.ProcessEvent.EndEvent(
            exit_code=exit_code,
            exited=True,
            status=status,
            error=status if exit_code != 0 else None,
        )
    return process_pb.ProcessEvent(event=Oneof(_END, end))


def launch(
    container: SandboxContainer,
    argv: Sequence[str],
    *,
    user: UserInfo,
    cwd: str,
    env: Mapping[str, str],
    stdin: bool,
) -> tuple[ExecStream, Iterator[tuple[int, bytes]], int, list[tuple[int, bytes]]]:
    """Start a process and read up to its pid marker.

    Returns the stream, its frame iterator (positioned after the marker), the pid and any
    output that arrived before the marker. Raises ConnectError if it could not start.
    """
    stream = container.start_exec(argv, user=user, cwd=cwd, env=env, stdin=stdin)
    frames = stream.frames()
    early: list[tuple[int, bytes]] = []
    stderr = b""
    for kind, data in frames:
        if kind != STDERR:
            early.append((kind, data))
            continue
        stderr += data
        if b"\n" not in stderr:
            continue
        line, rest = stderr.split(b"\n", 1)
        text = line.decode(errors="replace")
        if text == f"{MARKER}nocwd":
            stream.close()
            raise ConnectError(Code.INVALID_ARGUMENT, f"cwd '{cwd}' does not exist")
        if text.startswith(f"{MARKER}pid "):
            if rest:
                early.append((STDERR, rest))
            return stream, frames, int(text.split()[-1]), early
        break
    stream.close()
    output = b"".join(d for _, d in early) + stderr
    message = output.decode(errors="replace").strip() or "process exited before starting"
    raise ConnectError(Code.INVALID_ARGUMENT, f"error starting process '{argv[0]}': {message}")


class ManagedProcess:
    """A running process: fans its output out to every subscribed RPC stream."""

    def __init__(
        self,
        *,
        container: SandboxContainer,
        stream: ExecStream,
        frames: Iterator[tuple[int, bytes]],
        pid: int,
        config: process_pb.ProcessConfig,
        tag: str | None,
        early: list[tuple[int, bytes]],
        sandbox_alive: Callable[[], bool],
        on_exit: Callable[[ManagedProcess], None],
    ) -> None:
        self.pid = pid
        self.config = config
        self.tag = tag
        self._container = container
        self._stream = stream
        self._frames = frames
        self._early = early
        self._sandbox_alive = sandbox_alive
        self._on_exit = on_exit
        self._lock = threading.Lock()
        self._subscribers: list[_Subscriber] = []
        self._final: Item | None = None
        self._signal: str | None = None
        self._timer: threading.Timer | None = None

    # -- subscriptions (called from the event loop) ----------------------------------

    def subscribe(self) -> asyncio.Queue[Item]:
        """A queue receiving this process's events from now on."""
        subscriber = _Subscriber(asyncio.get_running_loop())
        with self._lock:
            if self._final is not None:
                subscriber.queue.put_nowait(self._final)
            else:
                self._subscribers.append(subscriber)
        return subscriber.queue

    def unsubscribe(self, queue: asyncio.Queue[Item]) -> None:
        with self._lock:
            self._subscribers = [s for s in self._subscribers if s.queue is not queue]

    def _publish(self, item: Item, final: bool = False) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
            if final:
                self._final = item
                self._subscribers.clear()
        for subscriber in subscribers:
            try:
                subscriber.loop.call_soon_threadsafe(subscriber.queue.put_nowait, item)
            except RuntimeError:  # the loop is closed: the server is stopping
                pass

    # -- lifecycle (blocking) ----------------------------------------------------------

    def start_pump(self, timeout: float | None) -> None:
        """Start forwarding output; kill the process after `timeout` seconds, like envd."""
        if timeout:
            self._timer = threading.Timer(timeout, self.signal, args=("KILL",))
            self._timer.daemon = True
            self._timer.start()
        threading.Thread(target=self._pump, name=f"e2b-proc-{self.pid}", daemon=True).start()

    def _pump(self) -> None:
        final: Item | None = None
        try:
            for kind, data in self._early:
                self._publish(data_event(kind, data))
            for kind, data in self._frames:
                if kind in (STDOUT, STDERR) and data:
                    self._publish(data_event(kind, data))
            try:
                code = self._stream.exit_code()
            except ContainerGone:
                code = None
            if code is None or not self._sandbox_alive():
                final = SandboxGone()
            else:
                final = end_event(code, self._signal)
        finally:
            if self._timer is not None:
                self._timer.cancel()
            self._stream.close()
            # Off the process list before its end is told, as envd does: a client that has
            # seen the end and lists the processes must not find it still there.
            self._on_exit(self)
            if final is not None:
                self._publish(final, final=True)

    def signal(self, name: str) -> None:
        """Send SIGKILL or SIGTERM to the process (and its process group)."""
        if self._final is not None:
            return
        self._signal = name
        try:
            self._container.signal_group(self.pid, name)
        except ContainerGone:
            pass

    def write_stdin(self, data: bytes) -> None:
        self._stream.write_stdin(data)

    def close_stdin(self) -> None:
        self._stream.close_stdin()

    def info(self) -> process_pb.ProcessInfo:
        return process_pb.ProcessInfo(config=self.config, pid=self.pid, tag=self.tag)
