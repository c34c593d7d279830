"""The run record: masked events and logs as they arrive, then result.json and the index row."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from orchestrator_runtime.masking import Masker
from orchestrator_runtime.protocol import MAX_FRAME_BYTES, FrameCheck
from orchestrator_runtime.request import MAX_STEPS_FROM

from ..spec import RunResult
from .spans import SpanCollector
from .store import Store

#: Collected logs are capped; the rest is dropped with a note (nothing is unbounded).
MAX_LOG_BYTES = 20 * 1024 * 1024
#: How much of an offending frame a protocol_violation event keeps.
MAX_VIOLATION_FRAME = 2000
#: The longest line kept from a sandbox's output; the rest of a longer one is dropped (and
#: the cut recorded), so one endless line costs bounded host memory and linear time.
MAX_LINE_BYTES = MAX_FRAME_BYTES
#: Cuts recorded one by one as `output_cut` events; further ones are only counted.
MAX_CUT_EVENTS = 20
#: How much of a program's log its result carries (`RunResult.output`).
OUTPUT_TAIL_BYTES = 64 * 1024
#: The agents whose `max_steps` a result keeps (the sandbox may name any number).
MAX_AGENTS_SHOWN = 100


EventHandler = Callable[[dict[str, Any]], None]


#: A file in a run's record folder that asks the run's orchestrator process to stop that run
#: (`orchestrator runs stop`): the process may be running a whole batch or schedule, so a
#: signal to it would stop more than the one run.
STOP_REQUEST = "stop-requested"


def describe_isolation(isolation: dict[str, Any] | None) -> str | None:
    """A run's sandbox runtime as `runs show` says it (`RunResult.sandbox`): `runsc: gVisor's
    kernel, seccomp orchestrator-..., processes limited by RLIMIT_NPROC 64 in gVisor's
    kernel; asked for auto`, `runc: the host's kernel, seccomp orchestrator-..., processes
    limited by the pids cgroup; asked for runc`, `gVisor's kernel through runsc-direct` for a
    sandbox runsc ran itself, and `; restored from snapshot ID` for a sandbox that started
    from one; None when the backend did not say."""
    if not isolation or not isolation.get("runtime"):
        return None
    runtime = str(isolation["runtime"])
    kernel = "gVisor's kernel" if runtime == "runsc" else "the host's kernel"
    if isolation.get("engine_runtime") == "runsc-direct":
        kernel = f"{kernel} through runsc-direct"
    kernel = f"{kernel}, seccomp {isolation.get('seccomp') or 'none'}"
    if isolation.get("pids"):
        kernel = f"{kernel}, processes limited by {isolation['pids']}"
    asked = f"; asked for {isolation['requested']}" if isolation.get("requested") else ""
    snapshot = isolation.get("snapshot")
    restored = f"; restored from snapshot {snapshot}" if snapshot else ""
    return f"{runtime}: {kernel}{asked}{restored}"


def agent_max_steps(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each agent's effective `max_steps` and who set it (`program`, `manifest` or `run`), from
    the sandbox's `run_start` (its word, kept to its shape): what the run really had, where
    the host's default is no limit of a program whose agents keep their own."""
    start = next(
        (e for e in events if e.get("type") == "run_start" and e.get("source") != "host"), {}
    )
    agents = start.get("agents")
    found = []
    for agent in agents if isinstance(agents, list) else []:
        steps = agent.get("max_steps") if isinstance(agent, dict) else None
        if isinstance(steps, int) and not isinstance(steps, bool):
            source = agent.get("max_steps_from")
            found.append(
                {
                    "agent": str(agent.get("name"))[:100],
                    "max_steps": steps,
                    "from": source if source in MAX_STEPS_FROM else None,
                }
            )
    return found[:MAX_AGENTS_SHOWN]


def describe_max_steps(agents: Any) -> str | None:
    """`manager 6 (program) · librarian 5 (program)`: `RunResult.agent_max_steps` as `runs
    show` and the viewer say it; None when the record has none."""
    if not isinstance(agents, list) or not agents:
        return None
    return " · ".join(
        f"{a.get('agent')} {a.get('max_steps')}" + (f" ({a['from']})" if a.get("from") else "")
        for a in agents
        if isinstance(a, dict)
    )


class RunRecorder:
    """Writes a run's events and logs to its record directory as they arrive, masked.

    The event channel is checked, never trusted: frames must come numbered 0, 1, 2... with
    one `run_end` last. A frame out of sequence, after the end, a second end or a line that is
    not a frame is a protocol violation: recorded as a host event, kept in `violations`, and
    never applied (the runner then never records success). Host events bypass the checks.
    """

    def __init__(self, directory: Path, masker: Masker, on_event: EventHandler | None):
        self.directory = directory
        self.masker = masker
        self.on_event = on_event
        self.events: list[dict[str, Any]] = []
        self.run_end: dict[str, Any] | None = None
        self._lock = threading.Lock()
        #: The line being received on each stream, at most MAX_LINE_BYTES of it, and how
        #: many bytes of it were dropped beyond that.
        self._partial = {"stdout": bytearray(), "stderr": bytearray()}
        self._dropped = {"stdout": 0, "stderr": 0}
        #: How many lines were cut to MAX_LINE_BYTES.
        self.cuts = 0
        self._files: dict[str, TextIO] = {
            name: open(directory / filename, "a", encoding="utf-8")
            for name, filename in (
                ("events", "events.jsonl"),
                ("stdout", "stdout.log"),
                ("stderr", "stderr.log"),
            )
        }
        self._written = {"stdout": 0, "stderr": 0}
        self._closed = False
        #: Set when the record could not be written (disk full, read-only...): the runner
        #: then stops the run, which ends `infra_error` saying so.
        self.write_error: str | None = None
        #: What the sandbox's event channel did wrong, in order (see the class docstring).
        self.violations: list[str] = []
        #: How many of the egress proxy's failed attempts are recorded already.
        self.egress_seen = 0
        self._frames = FrameCheck()
        #: The sandbox's `span` events: checked, masked and bounded apart from the others
        #: (orchestrator/records/spans.py); they never reach `events` or the run's status.
        self.spans = SpanCollector(masker)

    def stop_requested(self) -> bool:
        """`orchestrator runs stop` asked for this run to stop (see STOP_REQUEST)."""
        return (self.directory / STOP_REQUEST).exists()

    def feed(self, stream: str, chunk: bytes) -> None:
        """Take a chunk of a stream. Each byte is looked at once (linear time whatever the
        line length), and a line keeps at most MAX_LINE_BYTES (bounded memory): the rest is
        dropped and the cut recorded."""
        line, start = self._partial[stream], 0
        while True:
            end = chunk.find(b"\n", start)
            piece = memoryview(chunk)[start : len(chunk) if end < 0 else end]
            room = max(0, MAX_LINE_BYTES - len(line))
            line += piece[:room]
            self._dropped[stream] += max(0, len(piece) - room)
            if end < 0:
                return
            self._complete(stream)
            start = end + 1

    def flush(self) -> None:
        for stream, rest in self._partial.items():
            if rest or self._dropped[stream]:
                self._complete(stream)

    def _complete(self, stream: str) -> None:
        line, dropped = self._partial[stream], self._dropped[stream]
        text = line.decode("utf-8", errors="replace")
        line.clear()
        self._dropped[stream] = 0
        if dropped:
            self._cut(stream, len(text), dropped)
            if stream == "stdout":  # not a frame the runtime could have written
                self._violation(f"a frame over {MAX_LINE_BYTES} bytes", text[:200])
                return
        self._line(stream, text)
        if dropped:
            note = f"[orchestrator: the line above was cut at {MAX_LINE_BYTES} bytes; "
            self._log(stream, note + f"{dropped} more bytes were dropped]")

    def _cut(self, stream: str, kept: int, dropped: int) -> None:
        """Say in the record what was cut (the first few cuts one by one, then a count)."""
        self.cuts += 1
        if self.cuts <= MAX_CUT_EVENTS:
            self.host_event("output_cut", stream=stream, kept_bytes=kept, dropped_bytes=dropped)

    def _line(self, stream: str, line: str) -> None:
        if stream == "stdout" and line.strip():
            event, problem = self._frames.check(line)
            if problem is None and event["type"] == "span":
                self.spans.add(event)
                return
            if problem is None:
                self.observed(event)
                return
            self._violation(problem, event if event is not None else line)
            if event is not None:
                return
        self._log(stream, line)

    def _log(self, stream: str, line: str) -> None:
        line = self.masker(line) + "\n"
        with self._lock:
            if self._closed or self._written[stream] > MAX_LOG_BYTES:
                return
            self._written[stream] += len(line)
            if self._written[stream] > MAX_LOG_BYTES:
                line = f"[orchestrator: {stream} log capped at {MAX_LOG_BYTES} bytes]\n"
            self._write(stream, line)

    def step_at(self, ts: float) -> dict[str, Any]:
        """The agent and step that were running at time `ts` (an attempt the egress proxy
        saw), from the events so far: `{"agent", "step_number"}`, or {} before the run
        started. The innermost managed agent called and not yet returned is the one running;
        its step is the one after its last finished step (step events come at a step's end).
        Same clock: the proxy runs on the sandbox's host."""
        with self._lock:
            events = [e for e in self.events if isinstance(e.get("ts"), (int, float))]
        running: list[list[Any]] = []  # [agent, last finished step]
        for event in events:
            if event["ts"] > ts:
                break
            kind = event.get("type")
            if kind == "run_start":
                agents = event.get("agents") or [{}]
                running = [[str((agents[0] or {}).get("name") or "manager"), 0]]
            elif kind == "managed_agent_call":
                running.append([str(event.get("agent")), 0])
            elif kind == "managed_agent_result" and len(running) > 1:
                running.pop()
            elif kind == "step" and running and event.get("agent") == running[-1][0]:
                number = event.get("step_number")
                running[-1][1] = number if isinstance(number, int) else running[-1][1] + 1
        if not running:
            return {}
        agent, finished = running[-1]
        return {"agent": agent, "step_number": finished + 1}

    def observed(self, event: dict[str, Any]) -> None:
        """Record an event the host observed itself (egress refusals, its own notes): not a
        frame of the sandbox's channel, so not subject to its checks."""
        event = self.masker.clean(event)
        with self._lock:
            if self._closed:
                return
            if event.get("type") == "run_end":
                self.run_end = event
            self.events.append(event)
            self._write("events", json.dumps(event, default=str) + "\n")
        if self.on_event:
            try:
                self.on_event(event)
            except Exception as exc:  # the record never depends on who watches it
                self.on_event = None
                self.host_event("observer_failed", error=f"{type(exc).__name__}: {exc}")

    def _violation(self, reason: str, frame: Any) -> None:
        text = frame if isinstance(frame, str) else json.dumps(frame, default=str)
        self.violations.append(reason)
        self.host_event("protocol_violation", reason=reason, frame=text[:MAX_VIOLATION_FRAME])

    def _write(self, name: str, text: str) -> None:
        """Append to one of the record's files (lock held); the first failure stops all
        writing and is kept in `write_error`."""
        if self.write_error is not None:
            return
        file = self._files[name]
        try:
            file.write(text)
            file.flush()
        except OSError as exc:
            self.write_error = f"{file.name}: {exc.strerror or exc}"

    def host_event(self, type_: str, **fields: Any) -> None:
        self.observed({"type": type_, "source": "host", "ts": time.time(), **fields})

    def recover(self, stdout: bytes) -> None:
        """Find the run_end in the engine's copy of stdout after a broken live stream."""
        for line in reversed(stdout.decode("utf-8", errors="replace").splitlines()):
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("type") == "run_end":
                self.host_event("stream_recovered")
                self.observed(event)  # the live stream broke: its numbering cannot be checked
                return

    def log_tail(self, limit: int = OUTPUT_TAIL_BYTES) -> str:
        """The last `limit` bytes of the sandbox's log (stderr: where a program's prints go),
        as recorded (masked), cut at a line start."""
        with self._lock:
            with contextlib.suppress(OSError, ValueError):
                self._files["stderr"].flush()
        try:
            with open(self.directory / "stderr.log", "rb") as file:
                file.seek(0, os.SEEK_END)
                size = file.tell()
                file.seek(max(0, size - limit))
                data = file.read()
        except OSError:
            return ""
        if size > limit:
            data = data[data.find(b"\n") + 1 :]
        return data.decode("utf-8", errors="replace")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for file in self._files.values():
                with contextlib.suppress(OSError):  # a full disk fails the last flush too
                    file.close()


def write_result(result: RunResult, record: RunRecorder) -> str | None:
    """Close the record with the result it is given (decided by lifecycle/outcome.py): the
    `run_finished` event, then result.json. Returns what failed when result.json could not
    be written (the file and why), else None; the index row is `index_end`'s."""
    if record.cuts > MAX_CUT_EVENTS:
        record.host_event("output_cut", lines_cut=record.cuts, recorded_one_by_one=MAX_CUT_EVENTS)
    record.host_event("run_finished", status=result.status)
    record.close()
    path = Path(result.record_dir) / "result.json"
    try:
        path.write_text(json.dumps(result.to_dict(), indent=2, default=str) + "\n")
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    return None


def index_end(result: RunResult, store: Store) -> None:
    """The run's end in the index row; a failure is left alone (the index may be on the
    same full disk as the record, whose result.json says the end)."""
    with contextlib.suppress(sqlite3.Error):
        _index_end(result, store)


def _index_end(result: RunResult, store: Store) -> None:
    store.update_run(
        result.run_id,
        status=result.status,
        ended_at=result.timings.get("ended"),
        duration=result.timings.get("duration"),
        answer=None if result.answer is None else json.dumps(result.answer, default=str),
        error=None if result.error is None else result.error.message or result.error.type,
        exit_code=result.exit_code,
        input_tokens=result.token_usage.get("input_tokens"),
        output_tokens=result.token_usage.get("output_tokens"),
    )


def close_orphan(store: Store, row: dict[str, Any], result: RunResult) -> RunResult | None:
    """Close a run whose orchestrator process died before recording its end, with the
    result it is given (`infra_error` of type `orphaned`, decided by lifecycle/outcome.py):
    result.json, exit code and duration like any other end.

    Returns None when another process closed it first (it is written once), or when the run
    had in fact ended and written result.json but could not update the index (a full disk):
    then the index is brought in line with result.json, which is never overwritten."""
    written = _written_result(row["record_dir"])
    if written is not None:
        if store.claim_end(row["run_id"], written.timings["ended"]):
            _index_end(written, store)
        return None
    if not store.claim_end(row["run_id"], result.timings["ended"]):
        return None
    directory = Path(row["record_dir"])
    with contextlib.suppress(OSError):  # the record folder may be gone; the index is not
        with open(directory / "events.jsonl", "a", encoding="utf-8") as events:
            end = {"type": "run_finished", "source": "host", "ts": time.time()}
            events.write(json.dumps({**end, "status": result.status, "orphaned": True}) + "\n")
        (directory / "result.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    error = result.error
    store.update_run(
        result.run_id,
        status=result.status,
        duration=result.timings["duration"],
        error=None if error is None else f"{error.type}: {error.message}",
        exit_code=result.exit_code,
    )
    return result


def _written_result(record_dir: str) -> RunResult | None:
    """The run's own result.json, if it was written whole (a torn one counts as absent)."""
    try:
        result = RunResult.from_dict(json.loads((Path(record_dir) / "result.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return result if result.timings.get("ended") else None
