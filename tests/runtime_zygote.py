"""`python -m tests.runtime_zygote`: a process that imports what `python -m
orchestrator_runtime` imports before it reads its request (the runtime's modules and smolagents,
its `preload`), once, then forks one child per request that runs the runtime's `main` from
there; one per test process (`shared_zygote`). Each run is still a process of its own, with
its own stdin, stdout, stderr, exit code and fork; the half second of imports is paid once
per test process instead of once per run (tests/runtime/test_runtime.py's `run_runtime`, also
used by payloads/test_program.py and records/test_traces.py).

Control: one JSON line per run on stdin (`argv`, the test's environment, and the paths of
the run's stdin, stdout and stderr files); the zygote answers with the child's pid, then its
exit status (negative: the signal that ended it), one line each on stdout.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
#: The runtime's exit code for a bug of its own (orchestrator_runtime.__main__).
EXIT_INTERNAL = 3


class Zygote:
    """The test side: one zygote process, each run a child forked from it."""

    def __init__(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="runtime-zygote-"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.runtime_zygote"],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,  # unbuffered: `select` then sees every answer line
        )

    def run(self, raw: bytes, args: tuple[str, ...], timeout: float) -> tuple[int, bytes, bytes]:
        """The exit status, stdout and stderr of one run of the runtime on `raw`."""
        files = {name: self.workdir / name for name in ("stdin", "stdout", "stderr")}
        files["stdin"].write_bytes(raw)
        order = {
            "argv": list(args),
            "env": dict(os.environ),  # the test's environment now, as a new process gets it
            **{name: str(path) for name, path in files.items()},
        }
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(order).encode() + b"\n")
        self.proc.stdin.flush()
        pid = int(self.answer(60))
        try:
            status = int(self.answer(timeout))
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self.answer(60)
            raise
        return status, files["stdout"].read_bytes(), files["stderr"].read_bytes()

    def answer(self, timeout: float) -> str:
        """The zygote's next line: a pid, or an exit status."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"the runtime did not end within {timeout} s")
        line = self.proc.stdout.readline()
        assert line, f"the zygote died (exit {self.proc.poll()})"
        return line.decode()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)


#: This test process's zygote, once a test asked for it.
STARTED: list[Zygote] = []


def shared_zygote() -> Zygote:
    """This test process's zygote, started on first use (a test process that runs no runtime
    starts none); `stop_shared_zygote` ends it with the session (tests/conftest.py)."""
    if not STARTED or STARTED[0].proc.poll() is not None:
        STARTED[:] = [Zygote()]
    return STARTED[0]


def stop_shared_zygote() -> None:
    while STARTED:
        STARTED.pop().close()


def child(runtime: Any, order: dict[str, Any]) -> None:
    """In the forked child: the run's files as fds 0, 1 and 2 (and fresh sys.std* over them,
    none of the zygote's buffers), then the runtime's `main` as `python -m` runs it."""
    for fd, (path, flags) in enumerate(
        [
            (order["stdin"], os.O_RDONLY),
            (order["stdout"], os.O_WRONLY | os.O_TRUNC | os.O_CREAT),
            (order["stderr"], os.O_WRONLY | os.O_TRUNC | os.O_CREAT),
        ]
    ):
        opened = os.open(path, flags, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r")))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w")))
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w")), line_buffering=True
    )
    os.environ.clear()
    os.environ.update(order["env"])
    sys.argv = ["orchestrator_runtime", *order["argv"]]
    code = 1
    try:
        code = runtime.main(order["argv"])
    except SystemExit as exc:  # as the interpreter would turn it into an exit status
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        runtime.exit_now(code)
    os._exit(EXIT_INTERNAL)  # exit_now does not return


def serve() -> None:
    """Import once, then one forked child per control line, answered in order."""
    import orchestrator_runtime.__main__ as runtime

    runtime.preload()
    control = os.fdopen(os.dup(0), "rb", buffering=0)
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    while line := control.readline():
        order = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            control.close()
            answers.close()
            child(runtime, order)
        answers.write(f"{pid}\n")
        _, status = os.waitpid(pid, 0)
        answers.write(f"{os.waitstatus_to_exitcode(status)}\n")
    with contextlib.suppress(OSError):
        answers.close()


if __name__ == "__main__":
    serve()
