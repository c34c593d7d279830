"""The deadline keeper: PID 1 of every container the orchestrator starts for a run.

    python3 -I -S deadline.py --deadline-at EPOCH -- COMMAND [ARG...]
    python3 -I -S deadline.py --idle-until EPOCH --run-seconds S -- COMMAND [ARG...]

It starts COMMAND as its only child and is its init: it reaps every process, forwards
SIGTERM/SIGINT/SIGHUP/SIGQUIT to COMMAND, and exits with COMMAND's exit status. At EPOCH
(a wall-clock time, read once and turned into a monotonic deadline) it exits with
DEADLINE_EXIT_CODE whatever is still running, and the kernel then kills every process of the
container: the container stops on time even when every orchestrator process on the host is
gone.

A pooled (warm) sandbox is started before any run takes it, with `--idle-until`: the keeper
hands COMMAND the write end of a pipe (its number in `$ORCHESTRATOR_KEEPER_FD`) and stops the
container at EPOCH (the pool's time-to-live) unless a message comes first. The first byte
(the only one read) turns the deadline into now + S, once; the runtime sends it when it has
read its whole request and closes the pipe before any payload code exists, so payload code
can never extend anything. The pipe closed without a message leaves the idle deadline.
A thread blocks on the pipe while the main thread waits for signals until the deadline, so an
idle sandbox wakes for nothing (under gVisor every wake-up costs CPU the running tasks need).

Why code in the sandbox (same user) cannot remove or extend the deadline:

- it is PID 1 of the container's PID namespace, and the kernel drops SIGKILL and SIGSTOP
  sent to it from inside the namespace (other signals are forwarded to COMMAND, so sending
  them only ends the run early);
- it marks itself not dumpable (`PR_SET_DUMPABLE 0`) before COMMAND exists, so no process of
  the same user can ptrace-attach it (EPERM), nor read or write its memory through /proc;
- the deadline is on its command line, fixed when the host created the container, and kept
  on the monotonic clock (the sandbox cannot set clocks: no CAP_SYS_TIME);
- when PID 1 exits, every process of the namespace is killed, double-forked daemons included.

Standard library only and self-contained: the egress proxy's image runs the same file.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

#: Exit status when the deadline ended the container (as coreutils' `timeout`).
DEADLINE_EXIT_CODE = 124
#: Exit status for a bad command line or an environment it refuses to run in.
USAGE_EXIT_CODE = 125
PR_SET_DUMPABLE = 4
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
WATCHED = {signal.SIGCHLD, *FORWARDED}
#: The environment variable naming the write end of the keeper's pipe (idle mode only).
KEEPER_FD_ENV = "ORCHESTRATOR_KEEPER_FD"


def fail(message: str) -> None:
    sys.stderr.write(f"orchestrator deadline keeper: {message}\n")
    sys.stderr.flush()
    os._exit(USAGE_EXIT_CODE)


def say_without_blocking(message: str) -> None:
    """A last word on stderr that can never hold up the exit (a flooded pipe, no reader)."""
    try:
        os.set_blocking(2, False)
        os.write(2, f"orchestrator deadline keeper: {message}\n".encode())
    except OSError:
        pass


USAGE = (
    "usage: deadline.py --deadline-at EPOCH -- COMMAND [ARG...] | "
    "--idle-until EPOCH --run-seconds S -- COMMAND [ARG...]"
)


def number(flag: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        fail(f"{flag} {text!r} is not a number")
        raise  # not reached: fail() exits


def parse(argv: list[str]) -> tuple[float, float | None, list[str]]:
    """(EPOCH, run seconds or None for a plain deadline, COMMAND)."""
    if len(argv) >= 4 and argv[0] == "--deadline-at" and argv[2] == "--":
        return number(argv[0], argv[1]), None, argv[3:]
    if (
        len(argv) >= 6
        and argv[0] == "--idle-until"
        and argv[2] == "--run-seconds"
        and argv[4] == "--"
    ):
        run_seconds = number(argv[2], argv[3])
        if not run_seconds > 0:
            fail(f"--run-seconds {argv[3]!r} must be positive")
        return number(argv[0], argv[1]), run_seconds, argv[5:]
    fail(USAGE)
    raise SystemExit(USAGE_EXIT_CODE)  # not reached


def make_undumpable() -> None:
    """No ptrace attach, no /proc/1/mem, for processes of our own user."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        fail(f"prctl(PR_SET_DUMPABLE, 0) failed: {os.strerror(ctypes.get_errno())}")


def exit_status(status: int) -> int:
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


class Deadline:
    """The monotonic deadline, moved at most once by the first byte on the idle pipe."""

    def __init__(self, at: float) -> None:
        self.at = at

    def watch(self, wake: int, run_seconds: float) -> None:
        """Wait on `wake` in a thread of its own: its first byte sets the deadline to now +
        `run_seconds`, then the main thread is woken (a SIGCHLD it finds nothing to reap for)
        to wait for the new deadline. EOF leaves the deadline as it is."""
        main_thread = threading.get_ident()

        def wait() -> None:
            try:
                if os.read(wake, 1):
                    self.at = time.monotonic() + run_seconds
                    signal.pthread_kill(main_thread, signal.SIGCHLD)
            finally:
                os.close(wake)

        threading.Thread(target=wait, name="idle-pipe", daemon=True).start()


def main(argv: list[str]) -> None:
    deadline_at, run_seconds, command = parse(argv)
    if os.getpid() != 1:
        fail("must run as PID 1 of the container (without --init), or the deadline is not safe")
    make_undumpable()
    deadline = Deadline(time.monotonic() + (deadline_at - time.time()))
    wake = -1  # idle mode: the read end of the pipe whose first byte starts the run
    if run_seconds is not None:
        wake, handed = os.pipe()
        os.set_inheritable(handed, True)
        os.environ[KEEPER_FD_ENV] = str(handed)
    signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED)
    child = os.fork()
    if child == 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        try:
            if wake >= 0:
                os.close(wake)
            os.execvp(command[0], command)
        finally:
            os._exit(127)
    if wake >= 0 and run_seconds is not None:
        os.close(handed)
        os.environ.pop(KEEPER_FD_ENV, None)
        deadline.watch(wake, run_seconds)  # the thread starts with WATCHED blocked, as here
    while True:
        remaining = deadline.at - time.monotonic()
        if remaining <= 0:
            say_without_blocking("the sandbox's deadline passed; stopping it")
            os._exit(DEADLINE_EXIT_CODE)
        info = signal.sigtimedwait(WATCHED, remaining)
        if info is None:
            continue
        if info.si_signo != signal.SIGCHLD:
            try:
                os.kill(child, info.si_signo)
            except ProcessLookupError:
                pass
            continue
        while True:  # reap every child that has ended, ours last
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid == child:
                os._exit(exit_status(status))


if __name__ == "__main__":
    main(sys.argv[1:])
