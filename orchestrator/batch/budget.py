"""A batch's spend cap (`--max-total-tokens`): the tokens every attempt of the batch spent, in
all its sessions, and whether the cap is reached.

Tokens are counted as the model gateway measured them on the host (`gateway`); a run without a
gateway counts what its sandbox reported (`sandbox`), and the summary says which. While a run
goes on, each of its gateway `model_call` events adds its tokens at once, so the batch stops
at the call that reaches the cap, not after the run; when the run ends, its final figures
replace the live ones. The calls already in flight when the cap is reached are measured and
counted too: the spend may pass the cap by those. Default: no cap.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..spec import RunResult
from .output import BatchDir

#: The stop reason, and the status of an attempt the cap stopped (it runs again on resume).
BUDGET_EXCEEDED = "budget_exceeded"


def tokens_of(usage: dict[str, Any] | None) -> int:
    """Input plus output tokens of a run's `token_usage` (0 when it reported none)."""
    usage = usage or {}
    return int(usage.get("input_tokens") or 0) + int(usage.get("output_tokens") or 0)


def ended_attempts(entries: Iterable[dict[str, Any]], task_ids: set[str]) -> list[dict[str, Any]]:
    """The `end` lines of `attempts.jsonl` that belong to the batch's tasks."""
    return [e for e in entries if e.get("event") == "end" and e.get("id") in task_ids]


def tokens_spent(ended: Iterable[dict[str, Any]]) -> int:
    """The tokens of ended attempts (`ended_attempts`), all sessions together."""
    return sum(tokens_of(e.get("tokens")) for e in ended)


def spend_summary(
    entries: Iterable[dict[str, Any]], task_ids: set[str], cap: int | None, stop_reason: str | None
) -> dict[str, Any]:
    """`summary.json`'s `spend`: the cap (None: none), the tokens all attempts spent, where the
    figures come from (`gateway`, `sandbox` or `mixed`), whether the cap was reached, and how
    many running attempts it stopped (they run again on resume)."""
    ended = ended_attempts(entries, task_ids)
    spent = tokens_spent(ended)
    sources = {str(e.get("tokens_source") or "sandbox") for e in ended}
    return {
        "max_total_tokens": cap,
        "tokens": spent,
        "source": sources.pop() if len(sources) == 1 else ("mixed" if sources else "sandbox"),
        "cap_reached": stop_reason == BUDGET_EXCEEDED or (cap is not None and spent >= cap),
        "attempts_stopped": sum(e.get("status") == BUDGET_EXCEEDED for e in ended),
    }


def cap_reached_before(cap: int | None, output: str | Path, task_ids: set[str]) -> bool:
    """True when earlier sessions already spent the cap: this one starts nothing."""
    if cap is None:
        return False
    entries = BatchDir(Path(output)).load_attempts()
    return tokens_spent(ended_attempts(entries, task_ids)) >= cap


class Spend:
    """The batch's spend as it grows (thread-safe); says so and calls `on_reached(
    BUDGET_EXCEEDED)` once, from the thread whose tokens reached the cap."""

    def __init__(
        self,
        cap: int | None,
        earlier: Iterable[dict[str, Any]],
        task_ids: set[str],
        on_reached: Callable[[str], None],
        message: Callable[[str], None],
    ) -> None:
        self.cap = cap
        self.on_reached = on_reached
        self.message = message
        self._done = tokens_spent(ended_attempts(earlier, task_ids))
        self._live: dict[str, int] = {}
        self._lock = threading.Lock()
        self._told = False

    @property
    def spent(self) -> int:
        with self._lock:
            return self._done + sum(self._live.values())

    @property
    def reached(self) -> bool:
        return self.cap is not None and self.spent >= self.cap

    def watch(self, run_id: str) -> Callable[[dict[str, Any]], None]:
        """The run's `on_event`: adds each gateway-measured model call as it is recorded."""

        def on_event(event: dict[str, Any]) -> None:
            if event.get("type") != "model_call" or event.get("source") != "gateway":
                return
            with self._lock:
                self._live[run_id] = self._live.get(run_id, 0) + tokens_of(event)
            self.check()

        return on_event

    def ended(self, run_id: str, result: RunResult) -> None:
        """The run's final figures (measured, or as reported without a gateway) replace its
        live ones."""
        with self._lock:
            self._live.pop(run_id, None)
            self._done += tokens_of(result.token_usage)
        self.check()

    def check(self) -> bool:
        """True when the cap is reached (the first time: stop the batch)."""
        if not self.reached:
            return False
        with self._lock:
            told, self._told = self._told, True
        if not told:
            self.message(f"stopping: {self.describe()}; cancelling the running tasks")
            self.on_reached(BUDGET_EXCEEDED)
        return True

    def stopped(self) -> dict[str, Any]:
        """What an attempt the cap stopped records in `attempts.jsonl` instead of `cancelled`."""
        return {
            "status": BUDGET_EXCEEDED,
            "error": {
                "type": BUDGET_EXCEEDED,
                "message": f"the batch's cap --max-total-tokens {self.cap} was reached "
                f"({self.spent} tokens spent); the run was stopped and runs again on resume",
            },
        }

    def describe(self) -> str:
        spent = self.spent
        return f"the batch's cap --max-total-tokens {self.cap} is reached ({spent} tokens spent)"
