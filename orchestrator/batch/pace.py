"""A batch's pace: how many of its attempts run at once, and how that is said.

The limit is made where every such limit is (`executor.attempt_limit`), and the number is
`concurrency.AdaptiveLimit`'s (the rule is in that module's docstring): it starts from the
host (cores, memory against the runs' memory limit) and adapts while the batch runs.
`--concurrency N` is its ceiling (the backend's cap lowers it, and so does the number of
tasks to run); `--fixed-concurrency` holds it at exactly that.
"""

from __future__ import annotations

from ..execution.concurrency import AdaptiveLimit
from ..execution.executor import AttemptExecutor, attempt_limit
from ..images.imagedef import Progress
from ..lifecycle.runner import PreparedRun
from .plan import BatchSpec


def batch_limit(
    spec: BatchSpec,
    prepared: list[PreparedRun],
    executor: AttemptExecutor,
    *,
    todo: int,
    message: Progress,
) -> AdaptiveLimit:
    """The limit of a session with `todo` tasks to run (`executor.attempt_limit`): the
    spec's ceiling (None: auto), lowered to the executor's cap and to `todo`, starting from
    the executor's runs per core (fewer for warm sandboxes); each run's memory limit is the
    largest of `prepared`'s."""
    memory = max((p.limits.memory_mb for p in prepared), default=None)
    limit = attempt_limit(
        executor,
        prepared[0] if prepared else None,
        requested=spec.concurrency,
        most=todo,
        memory_mb=memory,
        adapt=spec.adapt,
        message=message,
    )
    limit.requested = spec.concurrency  # what the user asked for (None: auto), for the summary
    return limit


def describe(limit: AdaptiveLimit) -> str:
    """`2 (auto, up to 32)` or `8 (fixed)`: for the batch's messages and summary."""
    if not limit.adapt:
        return f"{limit.limit} (fixed)"
    return f"{limit.limit} (auto, up to {limit.ceiling})"
