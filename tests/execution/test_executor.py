"""The executor seam (orchestrator/execution/executor.py) as such: a decorator derived from
`DelegatingExecutor` (`schedule serve`'s `Paced`) forwards every member of the seam and of
its optional interfaces to the executor it wraps, and answers as that executor would when it
lacks them. (A `LocalExecutor`'s runs per core: tests/execution/test_pool_demand.py.)"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator.execution.concurrency import AdaptiveLimit, Slots
from orchestrator.execution.executor import (
    Attempt,
    AttemptExecutor,
    Capacity,
    PoolControl,
)
from orchestrator.lifecycle.runner import PreparedRun, RunObservers, prepare
from orchestrator.records.store import Store
from orchestrator.schedules.serve import Paced
from orchestrator.spec import RunResult, RunSpec
from tests.batch.test_session import MATH
from tests.execution.test_concurrency import Gated


class Answers(AttemptExecutor, Capacity, PoolControl):
    """An executor whose every member notes its call and answers something of its own, so
    that a decorator's answer can be told from a default."""

    def __init__(self, attempt: Attempt, result: RunResult) -> None:
        self.attempt, self.result = attempt, result
        self.calls: list[str] = []

    def open(self, template: PreparedRun, *, attempts: int, concurrency: int) -> None:
        self.calls.append("open")

    def reserve(
        self, prepared: PreparedRun, *, number: int = 1, cancel: threading.Event | None = None
    ) -> Attempt:
        self.calls.append("reserve")
        return self.attempt

    def run(self, attempt: Attempt, observers: RunObservers) -> RunResult:
        self.calls.append("run")
        return self.result

    def release(self, attempt: Attempt) -> None:
        self.calls.append("release")

    def reap_orphans(self, template: PreparedRun, store: Store) -> int:
        self.calls.append("reap_orphans")
        return 7

    def close(self) -> None:
        self.calls.append("close")

    def max_concurrency(self, template: PreparedRun) -> int | None:
        self.calls.append("max_concurrency")
        return 5

    def runs_per_core(self, template: PreparedRun) -> int | None:
        self.calls.append("runs_per_core")
        return 3

    @property
    def has_pool(self) -> bool:
        self.calls.append("has_pool")
        return True

    def keep_ready(self, prepared: PreparedRun, count: int) -> None:
        self.calls.append("keep_ready")

    def expect(self, prepared: PreparedRun, attempts: int = 1) -> None:
        self.calls.append("expect")


def seam_members() -> set[str]:
    """Every public member of the executor interfaces, read from the classes themselves (a
    member added later is in it)."""
    interfaces = (AttemptExecutor, Capacity, PoolControl)
    return {name for cls in interfaces for name in vars(cls) if not name.startswith("_")}


def test_serves_decorator_answers_every_member_of_the_seam_from_the_executor(
    tmp_path: Path,
) -> None:
    """`schedule serve` wraps its executor (`Paced`): each member of the seam and of its
    optional interfaces, called on the wrapper, reaches the wrapped executor and comes back
    with its answer (none falls back to a default of its own)."""
    prepared = prepare(RunSpec(payload=MATH, task="1+1"))
    attempt, result = Attempt(prepared), RunResult(prepared.run_id, "succeeded")
    store = Store(tmp_path / "store")
    calls: dict[str, Callable[[Any], object]] = {
        "open": lambda e: e.open(prepared, attempts=2, concurrency=1),
        "reserve": lambda e: e.reserve(prepared),
        "run": lambda e: e.run(attempt, RunObservers(store=store)),
        "release": lambda e: e.release(attempt),
        "reap_orphans": lambda e: e.reap_orphans(prepared, store),
        "close": lambda e: e.close(),
        "max_concurrency": lambda e: e.max_concurrency(prepared),
        "runs_per_core": lambda e: e.runs_per_core(prepared),
        "has_pool": lambda e: e.has_pool,
        "keep_ready": lambda e: e.keep_ready(prepared, 1),
        "expect": lambda e: e.expect(prepared, 1),
    }
    assert set(calls) == seam_members()  # a new member needs a line here
    answers = Answers(attempt, result)
    wrapped = Paced(answers, Slots(AdaptiveLimit(1, adapt=False)), log=lambda _line: None)
    assert isinstance(wrapped, Capacity) and isinstance(wrapped, PoolControl)
    for name, call in calls.items():
        inner = Answers(attempt, result)
        paced = Paced(inner, Slots(AdaptiveLimit(1, adapt=False)), log=lambda _line: None)
        inner.calls.clear()  # (wrapping asks isinstance, which reads `has_pool`)
        assert call(paced) == call(Answers(attempt, result)), name
        assert inner.calls == [name], name


def test_a_decorator_over_an_executor_without_the_optional_parts_answers_as_it_would() -> None:
    """Wrapped around an executor with only the seam (`Gated`), the decorator says no cap,
    the limit's own start and nothing warm, and keeping warm does nothing."""
    prepared = prepare(RunSpec(payload=MATH, task="1+1"))
    paced = Paced(Gated(), Slots(AdaptiveLimit(1, adapt=False)), log=lambda _line: None)
    assert not isinstance(Gated(), Capacity) and not isinstance(Gated(), PoolControl)
    assert paced.max_concurrency(prepared) is None and paced.runs_per_core(prepared) is None
    assert paced.has_pool is False
    paced.keep_ready(prepared, 1)
    paced.expect(prepared)
