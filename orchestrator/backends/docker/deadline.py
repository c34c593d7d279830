"""Deadlines that hold without the host: every container of a run gets the deadline keeper
(`orchestrator_runtime/deadline.py`) as its PID 1, with an absolute stop time on its
command line.

The host stops a run at its time limit itself; the keeper is the backstop for when no
orchestrator process is left to do it (SIGKILL, a crash, a reboot of the host's shell). It
stops the container at `time limit + GRACE_SECONDS` after the run's containers were created;
the stopped container (and an `allowlist` run's network) is then removed by the next
orchestrator command that opens the store.
"""

from __future__ import annotations

import time

from ...spec import Limits

#: How long after its time limit a container stops by itself when nobody stopped it. Long
#: enough that a live host always acts first (it counts from the sandbox's start, a moment
#: after the containers were created), short enough to bound what a dead host leaves running.
GRACE_SECONDS = 10.0
#: Where each image has the keeper (the agent image: with the runtime; the egress image:
#: beside squid's entrypoint). Run by that image's own python3, isolated and without site.
AGENT_KEEPER = ("python", "/opt/orchestrator/orchestrator_runtime/deadline.py")
EGRESS_KEEPER = ("python3", "/etc/squid/orchestrator/deadline.py")


def deadline_at(limits: Limits, now: float | None = None) -> float:
    """The wall-clock time at which a run's containers stop by themselves."""
    return (time.time() if now is None else now) + limits.timeout_seconds + GRACE_SECONDS


def kept(keeper: tuple[str, str], stop_at: float, command: list[str]) -> list[str]:
    """`command` under the keeper: the container's whole argv (its entrypoint, no CMD)."""
    return _under(keeper, ["--deadline-at", f"{stop_at:.3f}"], command)


def idle_kept(
    keeper: tuple[str, str], idle_until: float, run_seconds: float, command: list[str]
) -> list[str]:
    """`command` under the keeper of a pooled sandbox: it stops at `idle_until` unless a run
    takes it first, and then `run_seconds` after the run read its request."""
    idle = ["--idle-until", f"{idle_until:.3f}", "--run-seconds", f"{run_seconds:.3f}"]
    return _under(keeper, idle, command)


def restorable_kept(
    keeper: tuple[str, str], idle_seconds: float, run_seconds: float, command: list[str]
) -> list[str]:
    """`command` under the keeper of a sandbox made to be snapshotted (snapshots.py): it
    stops `idle_seconds` after it starts, or after it is restored, unless a run takes it
    first, and then `run_seconds` after the run read its request. No time of day in it, so
    every run of the same shape has the same command line, and restores the same snapshot."""
    idle = ["--restorable-idle", f"{idle_seconds:.3f}", "--run-seconds", f"{run_seconds:.3f}"]
    return _under(keeper, idle, command)


def _under(keeper: tuple[str, str], options: list[str], command: list[str]) -> list[str]:
    """The keeper's argv: its image's python, isolated and without site, its `options`, then
    `command` after `--`."""
    python, script = keeper
    return [python, "-I", "-S", script, *options, "--", *command]


def run_seconds(limits: Limits) -> float:
    """How long a pooled sandbox may run once taken: the time limit and the grace period."""
    return limits.timeout_seconds + GRACE_SECONDS
