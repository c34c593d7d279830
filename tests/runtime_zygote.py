"""`python -m tests.runtime_zygote`: a process that imports what `python -m
orchestrator_runtime` imports before it reads its request (the runtime's modules and smolagents,
its `preload`), once, then forks one child per request that runs the runtime's `main` from
there. Each run is still a process of its own, with its own stdin, stdout, stderr, exit code
and fork; the half second of imports is paid once per test module instead of once per run
(tests/test_runtime_local.py).

Control: one JSON line per run on stdin (`argv` and the paths of the run's stdin, stdout and
stderr files); the zygote answers with the child's pid, then its exit status (negative: the
signal that ended it), one line each on stdout.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback
from typing import Any

#: The runtime's exit code for a bug of its own (orchestrator_runtime.__main__).
EXIT_INTERNAL = 3


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
