"""One sandbox run by runsc itself, as the runner holds it: the runsc process (started inside
the sandbox's cgroup, in a session of its own), its stdin (the restore line, then the
request, once), its stdout and stderr read live, its exit, its kill and its removal.

runsc runs in the foreground (`run` for a snapshot's maker, `restore` for a run): the
sandbox's stdin, stdout and stderr are runsc's own, which are our pipes, and runsc exits
with the sandbox's exit status (128 + the signal when it was killed), then deletes its
container. If the orchestrator dies, the pipes close (EOF on the runtime's stdin) and the
keeper inside (PID 1) stops the sandbox at its deadline in any case; the cgroup, the record
and runsc's state are what `cleanup` removes (`remove_left`).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from orchestrator_runtime.protocol import READY_LINE, RESTORE_DONE_LINE
from orchestrator_runtime.request import Request

from ...base import ExitInfo, Sandbox, SandboxSpec, StreamName
from .binary import runsc, spawn, state_root
from .cgroup import Cgroup
from .records import SandboxRecord, bundle_dir

#: How long a runsc call of the host's own (kill, delete, checkpoint) may take.
CALL_TIMEOUT = 30.0
#: How much of a stream is read at once.
CHUNK = 65536
#: runsc's exit status when it failed itself (its error on stderr), not the sandbox's.
RUNSC_FAILED = 128
#: The start of runsc's error when a restore failed (`restoring container "ID": ...`).
RESTORE_FAILED = b"restoring container"
#: How much of the end of stderr is kept to tell runsc's own failure.
STDERR_TAIL = 4096
#: How long a run waits for its restored runtime's RESTORE_DONE_LINE before it holds the
#: sandbox to its CPU limit anyway (the request is written then; a restore that failed
#: ends the run with runsc's error).
RESTORE_WAIT = 30.0


class RunscSandbox(Sandbox):
    """A sandbox of `record.id`, in `cgroup`; `launch` starts its runsc process."""

    def __init__(
        self,
        record: SandboxRecord,
        cgroup: Cgroup,
        spec: SandboxSpec | None = None,
        network: str = "none",
    ) -> None:
        self.id = record.id
        self.network = network
        self.record = record
        self.cgroup = cgroup
        self.spec = spec
        self.proc: subprocess.Popen[bytes] | None = None
        self.isolation = {}
        #: What was read while waiting for the runtime to be ready (`wait_idle`).
        self._early: list[tuple[StreamName, bytes]] = []
        self._stdin_lock = threading.Lock()
        #: The end of what stderr said (runsc's own error is there when it failed).
        self._stderr_tail = b""
        #: Called when runsc says the restore failed (direct.py: the snapshot goes).
        self.on_restore_failed: Callable[[], None] | None = None
        #: Whether the runtime will say RESTORE_DONE_LINE (direct.restore asked it to).
        self.restoring = False

    def launch(self, args: list[str]) -> None:
        """Start `runsc ARGS` inside the cgroup (`binary.spawn`). Raises OSError when it
        cannot start."""
        self.proc = spawn(self.cgroup.joined(runsc(*args, network=self.network)))
        self.record.started(self.proc.pid)

    def write(self, data: bytes, *, close: bool = False) -> None:
        """`data` on the runtime's stdin (`close`: then EOF). Raises OSError when the sandbox
        is gone."""
        assert self.proc is not None and self.proc.stdin is not None
        with self._stdin_lock:
            if data:
                self.proc.stdin.write(data)
                self.proc.stdin.flush()
            if close:
                self.proc.stdin.close()

    def start(self, request: Request, secrets: dict[str, str]) -> None:
        """The sandbox held to its run's CPU limit (its restore or boot had the host's
        cores: `cgroup.boot_cpus`), then the request and its secrets as one JSON object on
        the runtime's stdin, then EOF: as the Docker path's, never in the spec, the record
        or runsc's state. The payload's code runs only once it has read them. A restore that
        never says it is over gets nothing (it is killed; `wait` says how it ended). Raises
        OSError when the limit cannot be set (nothing is written then) or the sandbox is
        gone, ValueError for a sandbox without a run (a snapshot's maker)."""
        if self.spec is None:
            raise ValueError(f"sandbox {self.id} has no run to start")
        if self.restoring:  # the restore on the host's cores to its end, at most RESTORE_WAIT
            self.restoring = False
            if not self._read_stderr_until(RESTORE_DONE_LINE.encode(), RESTORE_WAIT):
                self.kill()  # failed (runsc ended: `wait` tells its error) or hung: no request
                return
        self.cgroup.limit_cpus(self.spec.limits.cpus)
        self.write(replace(request, secrets=secrets).to_json().encode(), close=True)

    def wait_idle(self, timeout: float) -> None:
        """Until the runtime has imported everything (READY_LINE on stderr); what it wrote
        before is kept for `stream`. Raises RuntimeError when it ends first or is not ready
        within `timeout` (it is killed then)."""
        if self._read_stderr_until(READY_LINE.encode(), timeout):
            return
        self.kill()
        raise RuntimeError(
            f"the sandbox ended before it was ready (within {timeout:g} s); its last words: "
            f"{self._stderr_tail[-500:].decode(errors='replace')!r}"
        )

    def _read_stderr_until(self, marker: bytes, timeout: float) -> bool:
        """Read stderr until `marker` (dropped; what came before it and after it is kept for
        `stream`), its end, or `timeout` seconds; True when the marker came."""
        assert self.proc is not None and self.proc.stderr is not None
        fd, seen = self.proc.stderr.fileno(), b""
        give_up = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while marker not in seen:
                left = give_up - time.monotonic()
                if left <= 0 or not selector.select(left):
                    break
                chunk = os.read(fd, CHUNK)
                if not chunk:
                    break
                seen += chunk
        found = marker in seen
        kept = [p for p in seen.split(marker, 1) if p]
        self._early += [("stderr", p) for p in kept]
        self._stderr_tail = (self._stderr_tail + b"".join(kept))[-STDERR_TAIL:]  # runsc's error
        return found

    def take(self, spec: SandboxSpec) -> None:
        """Hand a pooled sandbox to the run of `spec` (its run id was the sandbox's from the
        start). Raises ValueError for another run's."""
        if self.spec is None or spec.run_id != self.spec.run_id:
            raise ValueError(f"pooled sandbox {self.id} is not for run {spec.run_id}")
        self.spec = spec

    def stream(self) -> Iterator[tuple[StreamName, bytes]]:
        yield from self._early
        self._early = []
        if self.proc is None:
            return
        selector = selectors.DefaultSelector()
        for name, pipe in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr)):
            if pipe is not None:
                selector.register(pipe.fileno(), selectors.EVENT_READ, name)
        try:
            while selector.get_map():
                for key, _ in selector.select():
                    try:
                        chunk = os.read(key.fd, CHUNK)
                    except OSError:
                        chunk = b""
                    if not chunk:
                        selector.unregister(key.fd)
                        continue
                    if key.data == "stderr":
                        self._stderr_tail = (self._stderr_tail + chunk)[-STDERR_TAIL:]
                    yield key.data, chunk
        finally:
            selector.close()

    def wait(self, timeout: float) -> ExitInfo:
        """runsc's exit: the sandbox's status (its keeper's 124 at the deadline, 137 when
        killed); an OOM kill is read from the cgroup, never from the sandbox."""
        if self.proc is None:
            return ExitInfo(None, infra_error="the sandbox was never started")
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return ExitInfo(None, infra_error=f"runsc did not end within {timeout:g} s")
        if code < 0:  # runsc itself was killed (`kill`'s fallback): the sandbox with it
            code = 128 - code
        if code == RUNSC_FAILED and RESTORE_FAILED in self._stderr_tail:
            if self.on_restore_failed is not None:
                self.on_restore_failed()
            said = self._stderr_tail.decode(errors="replace").strip().splitlines()[-1:]
            return ExitInfo(None, infra_error=f"runsc could not restore the sandbox: {said}")
        return ExitInfo(code, oom_killed=self.cgroup.oom_killed())

    def recover_stdout(self) -> bytes:
        """Nothing: no log of the sandbox's output is kept anywhere (as the Docker path's)."""
        return b""

    def kill(self) -> None:
        """SIGKILL to the sandbox's init through runsc, and every process of its cgroup
        (runsc, gVisor's sandbox and gofer) when runsc cannot: at once, whatever state it
        is in."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            done = subprocess.run(
                runsc("kill", self.id, "KILL", network=self.network),
                capture_output=True,
                timeout=CALL_TIMEOUT,
            )
            if done.returncode == 0:
                return
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.cgroup.kill()

    def remove(self) -> None:
        """Everything of the sandbox: its processes (killed), runsc's state of it, its
        cgroup, its record. Idempotent."""
        if self.proc is not None:
            for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                with contextlib.suppress(OSError):
                    if pipe is not None:
                        pipe.close()
        remove_left(self.id, self.cgroup, self.proc)
        self.record.forget()


def remove_left(
    container_id: str, cgroup: Cgroup, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """What a sandbox leaves: its processes killed, its cgroup removed, runsc's state of it
    deleted (runsc deletes it itself when its foreground process ends normally). Never
    raises.

    Once the cgroup is gone, every process of the sandbox is (runsc, gVisor's sandbox and
    gofer all run in it), and what is left of it is runsc's state and lock files, removed
    here; `runsc delete --force` is asked only while a process may be left, since it waits
    about 1.4 s for a sandbox that is dead already."""
    emptied = cgroup.remove()
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=CALL_TIMEOUT)
    root = state_root()
    if not emptied and any(root.glob(f"*{container_id}*.state")):
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(
                runsc("delete", "--force", container_id),
                capture_output=True,
                timeout=CALL_TIMEOUT,
            )
    for left in root.glob(f"*{container_id}*"):  # runsc leaves its lock file behind
        with contextlib.suppress(OSError):
            left.unlink()
    shutil.rmtree(bundle_dir(container_id), ignore_errors=True)
