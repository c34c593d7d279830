"""`--ray [ADDRESS]`: the option of `batch` and `schedule serve` that sends their attempts to
a Ray cluster's nodes (`orchestrator.cluster.RayExecutor`)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from ..batch.plan import BatchSpec
from ..execution.executor import AttemptExecutor
from ..images.imagedef import Progress

if TYPE_CHECKING:
    from ..cluster import RayExecutor


def add_ray_option(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help=f"run {what} on the nodes of the Ray cluster at ADDRESS (default: $RAY_ADDRESS, "
        "else the cluster started on this machine); nodes that run sandboxes declare `ray "
        "start ... --resources '{\"orchestrator_sandboxes\": N}'` (at most N at once there; "
        "of a batch, as many as that host carries), need Docker and orchestrator; results "
        "and records stay on this machine. Needs pip install 'orchestrator[ray]'",
    )


def ray_executor(args: argparse.Namespace, on_message: Progress) -> RayExecutor | None:
    """The executor `--ray` asks for (None without it: this host). Raises ConfigError (exit
    2) when Ray is not installed."""
    address: Any = getattr(args, "ray", None)
    if address is None:
        return None
    from ..cluster import RayExecutor

    return RayExecutor(
        address or None,
        pool_size=getattr(args, "warm", None),
        adapt=not getattr(args, "fixed_concurrency", False),
        on_message=on_message,
    )


def ray_batch(
    args: argparse.Namespace, spec: BatchSpec, on_message: Progress
) -> tuple[AttemptExecutor | None, BatchSpec]:
    """A batch's executor and spec under `--ray`: without --concurrency (or its setting), as
    many at once as the cluster's nodes declare, not this machine's default. This limit does
    not adapt: this machine's CPU, which the adaptive limit reads, is not where the runs are.
    Each node adapts its own instead, under what it declares (`--fixed-concurrency`: each
    runs what it declares)."""
    executor = ray_executor(args, on_message)
    if executor is not None:
        from dataclasses import replace

        spec = replace(spec, concurrency=spec.concurrency or executor.capacity(), adapt=False)
    return executor, spec


def leave_cluster(executor: AttemptExecutor | None) -> None:
    """After a command's work on the cluster: close its executor and leave the cluster while
    this process is whole (see `cluster.disconnect`). Nothing without --ray."""
    if executor is None:
        return
    from ..cluster import RayExecutor, disconnect

    if isinstance(executor, RayExecutor):
        executor.close()
        disconnect()
