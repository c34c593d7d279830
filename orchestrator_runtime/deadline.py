"""The deadline keeper: PID 1 of every container the orchestrator starts for a run.

    python3 -I -S deadline.py --deadline-at EPOCH -- COMMAND [ARG...]
    python3 -I -S deadline.py --idle-until EPOCH --run-seconds S -- COMMAND [ARG...]
    python3 -I -S deadline.py --restorable-idle R --run-seconds S -- COMMAND [ARG...]

It starts COMMAND as its only child and is its init: it reaps every process, forwards
SIGTERM/SIGINT/SIGHUP/SIGQUIT to COMMAND, and exits with COMMAND's exit status. At EPOCH
(a wall-clock time, read once and turned into a monotonic deadline) it exits with
DEADLINE_EXIT_CODE whatever is still running, and the kernel then kills every process of the
container: the container stops on time even when every orchestrator process on the host is
gone.

A pooled (warm) sandbox is started before any run takes it, with `--idle-until`: the keeper
hands COMMAND the write end of a pipe (its number in `$ORCHESTRATOR_KEEPER_FD`) and stops the
container at EPOCH (the pool's time-to-live) unless a message comes first. A byte other than
RESTORED_BYTE turns the deadline into now + S, once, and ends the reading; the runtime sends
it when it has read its whole request and closes the pipe before any payload code exists, so
payload code can never extend anything. The pipe closed without a message leaves the idle
deadline.

A sandbox made to be snapshotted (`--restorable-idle`, gVisor only) is idle in the same way,
with three differences. Its idle deadline is R seconds from now, not an absolute time, because
the process is checkpointed and restored into new containers long after: a keeper that finds
itself woken much later than it asked (FROZEN_AFTER) was frozen in between, so it is a new
container restored from the snapshot, and its idle time starts again. It wakes every
IDLE_SLICE seconds while idle to notice that (and only while idle: the run's deadline is
never moved again). A restore soon after the checkpoint is no such late wake, so the runtime
also says it, once: RESTORED_BYTE on the pipe, sent when the host's restore line came,
starts the idle time again from then (once, and only while idle: a sandbox idles at most R
after its restore). And it tells COMMAND it may be restored (`$ORCHESTRATOR_RESTORABLE`), so
that the runtime waits for the host's word that it was, and reseeds what clones share.
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
from collections.abc import Callable

#: Exit status when the deadline ended the container (as coreutils' `timeout`).
DEADLINE_EXIT_CODE = 124
#: Exit status for a bad command line or an environment it refuses to run in.
USAGE_EXIT_CODE = 125
PR_SET_DUMPABLE = 4
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
WATCHED = {signal.SIGCHLD, *FORWARDED}
#: The environment variable naming the write end of the keeper's pipe (idle mode only).
KEEPER_FD_ENV = "ORCHESTRATOR_KEEPER_FD"
#: Set ("1") in COMMAND's environment by a keeper started with `--restorable-idle`.
RESTORABLE_ENV = "ORCHESTRATOR_RESTORABLE"
#: While a restorable keeper is idle it wakes this often (seconds), so that a restore is
#: noticed soon after it; a wake costs microseconds, and the idle phase of a restored
#: sandbox lasts until its request is read (well under a second).
IDLE_SLICE = 5.0
#: A wake this much later (seconds) than asked means the process was frozen in between: a
#: checkpoint restored (gVisor moves a restored sandbox's monotonic clock on by the real time
#: that passed). A loaded host delays a wake by milliseconds, not seconds.
FROZEN_AFTER = 5.0
#: The runtime's word on the pipe that the host restored it (restorable keepers only).
RESTORED_BYTE = b"r"


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
    "--idle-until EPOCH --run-seconds S -- COMMAND [ARG...] | "
    "--restorable-idle R --run-seconds S -- COMMAND [ARG...]"
)


def number(flag: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        fail(f"{flag} {text!r} is not a number")
        raise  # not reached: fail() exits


def parse(argv: list[str]) -> tuple[float, float | None, list[str], bool]:
    """(EPOCH, run seconds or None for a plain deadline, COMMAND, restorable); a restorable
    keeper's EPOCH is now + R."""
    if len(argv) >= 4 and argv[0] == "--deadline-at" and argv[2] == "--":
        return number(argv[0], argv[1]), None, argv[3:], False
    if (
        len(argv) >= 6
        and argv[0] in ("--idle-until", "--restorable-idle")
        and argv[2] == "--run-seconds"
        and argv[4] == "--"
    ):
        run_seconds = number(argv[2], argv[3])
        if not run_seconds > 0:
            fail(f"--run-seconds {argv[3]!r} must be positive")
        idle = number(argv[0], argv[1])
        if argv[0] == "--idle-until":
            return idle, run_seconds, argv[5:], False
        if not idle > 0:
            fail(f"--restorable-idle {argv[1]!r} must be positive")
        return time.time() + idle, run_seconds, argv[5:], True
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
    """The monotonic deadline, moved at most once by the first byte on the idle pipe; a
    restorable one's idle deadline also starts again after a restore (`wait_time`)."""

    def __init__(
        self,
        at: float,
        restorable_idle: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.at = at
        self.running = False  # set by the first byte on the idle pipe
        self.restorable_idle = restorable_idle
        self.clock = clock
        self.woken_by = clock()  # when the current wait was meant to end
        self.restarted = False  # the runtime's RESTORED_BYTE came (it counts once)
        self.lock = threading.Lock()  # the pipe's thread and the main thread both move `at`

    def wait_time(self) -> float:
        """How long to wait now (<= 0: the deadline passed). A restorable keeper still idle
        waits in IDLE_SLICE steps, and one woken more than FROZEN_AFTER past the end of its
        last wait was restored from a snapshot: its idle time starts again from now."""
        with self.lock:
            now = self.clock()
            remaining = self.at - now
            if self.restorable_idle is None or self.running:
                return remaining
            if now - self.woken_by > FROZEN_AFTER:
                self.at = now + self.restorable_idle
                remaining = self.restorable_idle
            wait = min(remaining, IDLE_SLICE)
            self.woken_by = now + wait
            return wait

    def restart_idle(self) -> None:
        """The runtime says it was restored: a restorable keeper still idle, told so for the
        first time, idles its whole time again from now. Anything else is ignored."""
        with self.lock:
            if self.restorable_idle is None or self.running or self.restarted:
                return
            self.restarted = True
            self.at = self.clock() + self.restorable_idle

    def begin_run(self, run_seconds: float) -> None:
        """The run has begun: the deadline is `run_seconds` from now, and never moves again."""
        with self.lock:
            self.at = self.clock() + run_seconds
            self.running = True

    def watch(self, wake: int, run_seconds: float) -> None:
        """Wait on `wake` in a thread of its own: RESTORED_BYTE restarts the idle time
        (`restart_idle`) and the reading goes on; any other byte sets the deadline to now +
        `run_seconds`, then the main thread is woken (a SIGCHLD it finds nothing to reap for)
        to wait for the new deadline, and nothing more is read. EOF leaves the deadline as
        it is."""
        main_thread = threading.get_ident()

        def wait() -> None:
            try:
                while byte := os.read(wake, 1):
                    if byte != RESTORED_BYTE:
                        self.begin_run(run_seconds)
                        signal.pthread_kill(main_thread, signal.SIGCHLD)
                        return
                    self.restart_idle()  # later than the wait in progress: no wake needed
            finally:
                os.close(wake)

        threading.Thread(target=wait, name="idle-pipe", daemon=True).start()


def main(argv: list[str]) -> None:
    deadline_at, run_seconds, command, restorable = parse(argv)
    if os.getpid() != 1:
        fail("must run as PID 1 of the container (without --init), or the deadline is not safe")
    make_undumpable()
    idle_seconds = deadline_at - time.time()
    deadline = Deadline(time.monotonic() + idle_seconds, idle_seconds if restorable else None)
    wake = -1  # idle mode: the read end of the pipe whose first byte starts the run
    if run_seconds is not None:
        wake, handed = os.pipe()
        os.set_inheritable(handed, True)
        os.environ[KEEPER_FD_ENV] = str(handed)
    if restorable:
        os.environ[RESTORABLE_ENV] = "1"
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
        os.environ.pop(RESTORABLE_ENV, None)
        deadline.watch(wake, run_seconds)  # the thread starts with WATCHED blocked, as here
    while True:
        remaining = deadline.wait_time()
        if remaining <= 0:
            say_without_blocking("the sandbox's deadline passed; stopping it")
            os._exit(DEADLINE_EXIT_CODE)
        info = signal.sigtimedwait(WATCHED, remaining)
        if info is None:
            continue
        if info.si_signo in FORWARDED:
            try:
                os.kill(child, info.si_signo)
            except ProcessLookupError:
                pass
            continue
        # SIGCHLD, or no signal we know: gVisor's sigtimedwait, when the wait it was in is
        # restored from a checkpoint, returns a number that is no signal. Reaping with
        # WNOHANG is harmless then, and a child's end is never missed.
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
