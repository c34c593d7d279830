"""A CodeAgent with a tool that misbehaves as asked (tools are trusted payload code, so
only the container's limits stand in their way)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import resource
import signal
import sys
import time

from smolagents import CodeAgent, tool


@tool
def misbehave(mode: str) -> str:
    """Misbehave on purpose.

    Args:
        mode: "sleep" (sleep for a minute), "memory" (allocate until killed), "forkbomb"
            (lift the process limit where it can, then fork until the limit stops it),
            "outlive" (attack the container's deadline keeper, then try to outlive it),
            "flood" (print 64 KiB lines to stderr for a minute), "longline-N" (print one
            line of N MiB, then a newline), "block-K" (one write of a K KiB line to
            stderr), "hog" (keep four processes busy for 2.5 CPU-seconds each, then fill
            /tmp until refused), or "ok" (do nothing).
    """
    if mode == "hog":
        # Measured in CPU the processes got, not wall time: on a busy host they get little
        # of it, and a hog that stopped by the clock could end before its quota was ever
        # reached (the test then saw no throttling). 10 CPU-seconds take at least 20 s
        # under cpus=0.5: time for a test to find the sandbox and read its throttling.
        spin(processes=4, cpu_seconds=2.5, at_most=120.0)
        return fill("/tmp")
    if mode.startswith("block-"):
        sys.stderr.write("z" * (int(mode.split("-", 1)[1]) * 1024) + "\n")
        return "written"
    if mode.startswith("longline-"):
        block = "y" * 2**20
        for _ in range(int(mode.split("-", 1)[1])):
            sys.stderr.write(block)
        sys.stderr.write("\n")
        sys.stderr.flush()
        return "printed"
    if mode == "flood":
        line = "x" * 65536
        until = time.monotonic() + 60
        while time.monotonic() < until:
            print(line, file=sys.stderr, flush=True)
        return "flooded"
    if mode == "outlive":
        print(f"deadline attack: {attack_pid1()}", file=sys.stderr, flush=True)
        daemonize()
        while True:
            time.sleep(1)
    if mode == "sleep":
        time.sleep(60)
        return "slept"
    if mode == "memory":
        hoard = []
        while True:
            hoard.append(b"\x01" * (16 * 2**20))  # filled, so the pages are really used
    if mode == "forkbomb":
        # First lift every process limit the sandbox's own process could lift.
        for both in ((resource.RLIM_INFINITY,) * 2, (resource.getrlimit(NPROC)[1],) * 2):
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(NPROC, both)
        children = 0
        while True:
            try:
                pid = os.fork()
            except OSError:
                return f"fork refused after {children} children"
            if pid == 0:  # a child keeps forking forever and never returns to the agent
                while True:
                    try:
                        os.fork()
                    except OSError:
                        time.sleep(0.2)
            children += 1
    return "ok"


def spin(processes: int, cpu_seconds: float, at_most: float) -> None:
    """Keep `processes` processes on the CPU until each has used `cpu_seconds` of it (or
    `at_most` seconds have passed on the clock), then reap them."""
    children = []
    for _ in range(processes):
        pid = os.fork()
        if pid == 0:
            until = time.monotonic() + at_most
            while time.process_time() < cpu_seconds and time.monotonic() < until:
                pass
            os._exit(0)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)


def fill(folder: str) -> str:
    """Write 1 MiB blocks into `folder` until a write is refused; say how far it got."""
    written = 0
    try:
        with open(os.path.join(folder, "fill"), "wb") as out:
            while written < 2**20:  # MiB: a bound, never reached under any tmpfs_mb
                out.write(b"\x01" * 2**20)
                out.flush()
                written += 1
    except OSError as exc:
        return f"{folder} refused after {written} MiB: {errno.errorcode.get(exc.errno)}"
    return f"{folder} took {written} MiB"


PTRACE_ATTACH = 16
NPROC = resource.RLIMIT_NPROC


def attack_pid1() -> str:
    """Try to stop, kill, ptrace and read PID 1 (the deadline keeper); report each outcome."""
    outcomes = []
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        try:
            os.kill(1, sig)
            outcomes.append(f"{sig.name}=sent")
        except OSError as exc:
            outcomes.append(f"{sig.name}={exc.errno}")
    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.ptrace(PTRACE_ATTACH, 1, None, None)
    outcomes.append(f"ptrace={'attached' if result == 0 else os.strerror(ctypes.get_errno())}")
    try:
        with open("/proc/1/mem", "rb") as mem:
            mem.read(1)
        outcomes.append("mem=read")
    except OSError as exc:
        outcomes.append(f"mem={exc.strerror}")
    return " ".join(outcomes)


def daemonize() -> None:
    """Leave a double-forked, session-leading child that ignores every signal it can."""
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)
            while True:
                time.sleep(1)
        os._exit(0)


def build(model):
    return CodeAgent(tools=[misbehave], model=model, max_steps=3)
