"""A batch's spend caps: `--max-total-tokens N` and `--max-cost USD`, over every attempt of the
batch in all its sessions, and whether one is reached.

Tokens are counted as the model gateway measured them on the host (`gateway`); a run without a
gateway counts what its sandbox reported (`sandbox`) against the token cap, and the summary
says which. The cost cap counts measured tokens only (`prices.plan_pricing` refuses runs
without a gateway before anything starts; `mock` costs 0): each gateway `model_call` costs its
input and output tokens at the price of the model its request names (`prices.CallPrices`),
and a call whose cost cannot be counted (the gateway could not measure it: the server's answer
said no usage; or it named a model with no known price) stops the batch, since its spend is
then unknown (fail closed). While a run goes on, each call counts at once, so the batch stops at
the call that reaches a cap, not after the run; the calls already in flight then are measured
and counted too: the spend may pass the cap by those. Default: no cap.

A run the cap stops ends `cancelled` with the error `budget_exceeded` naming the cap in its
own record (`spec.StopRequest`), and `budget_exceeded` in `attempts.jsonl`; it runs again
on resume.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from decimal import Decimal
from pathlib import Path
from typing import Any

from ..images.imagedef import Progress
from ..spec import HostErrorType, RunError, RunResult, StopRequest, host_error
from .judge import JudgeReply, judge_spent
from .output import BatchDir
from .plan import BatchPlan, BatchSpec
from .prices import CallPrices, Pricing, check_prices, model_key, parse_max_cost

#: The stop reason, and the status of an attempt the cap stopped (it runs again on resume).
BUDGET_EXCEEDED: HostErrorType = "budget_exceeded"


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


def cost_spent(ended: Iterable[dict[str, Any]], pricing: Pricing) -> Decimal:
    """The cost of ended attempts: each one's `cost_usd` (summed call by call while it ran),
    else (a session without --max-cost) its tokens at today's price."""
    total = Decimal(0)
    for entry in ended:
        if entry.get("cost_usd") is not None:
            total += Decimal(str(entry["cost_usd"]))
        else:
            usage = entry.get("tokens") or {}
            inp, out = int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0)
            total += pricing.cost(inp, out) if inp or out else Decimal(0)
    return total


def usd(amount: Decimal | float) -> str:
    """`$5.00`, `$0.000123`: cents at least, six decimals at most."""
    text = f"{Decimal(str(amount)):.6f}".rstrip("0")
    whole, _, cents = text.partition(".")
    return f"${whole}.{cents.ljust(2, '0')}"


def spend_summary(
    entries: Iterable[dict[str, Any]],
    plan: BatchPlan,
    spec: BatchSpec,
    stop_reason: str | None,
    folder: Path | None = None,
) -> dict[str, Any]:
    """`summary.json`'s `spend`: the caps (None: none), the tokens all attempts spent, where
    the figures come from (`gateway`, `sandbox` or `mixed`), their cost and the price it was
    counted at (None without --max-cost), calls whose cost could not be counted, whether a
    cap was reached and which stopped the batch (`max_total_tokens`, `max_cost`, or
    `uncounted`: a call's cost was unknown), and how many running attempts it stopped (they
    run again on resume). With a judge (`--scorer model`), its calls (`judge.jsonl`) count in
    the tokens and cost, and `judge` says how much was theirs."""
    ended = ended_attempts(entries, {t.id for t in plan.file.tasks})
    judged = judge_spent(folder, plan.judge_pricing) if folder is not None else (0, Decimal(0), 0)
    spent = tokens_spent(ended) + judged[0]
    sources = {str(e.get("tokens_source") or "sandbox") for e in ended}
    max_cost = parse_max_cost(spec.max_cost) if spec.max_cost is not None else None
    cost = cost_spent(ended, plan.pricing) + judged[1] if plan.pricing is not None else None
    uncounted = sum(int(e.get("uncounted_calls") or 0) for e in ended)
    reached = [
        name
        for name, cap, value in (
            ("max_total_tokens", spec.max_total_tokens, spent),
            ("max_cost", max_cost, cost),
        )
        if cap is not None and value is not None and value >= cap
    ]
    stopped_by = None
    if stop_reason == BUDGET_EXCEEDED:
        stopped_by = reached[0] if reached else "uncounted" if uncounted else None
    judge = {"calls": judged[2], "tokens": judged[0], "cost_usd": float(judged[1])}
    return {
        **({"judge": judge} if judged[2] else {}),
        "max_total_tokens": spec.max_total_tokens,
        "tokens": spent,
        "source": sources.pop() if len(sources) == 1 else ("mixed" if sources else "sandbox"),
        "max_cost_usd": float(max_cost) if max_cost is not None else None,
        "cost_usd": float(cost) if cost is not None else None,
        "price": plan.pricing.to_dict() if plan.pricing is not None else None,
        "uncounted_calls": uncounted,
        "cap_reached": bool(reached) or stopped_by not in (None, "uncounted"),
        "stopped_by": stopped_by,
        "attempts_stopped": sum(e.get("status") == BUDGET_EXCEEDED for e in ended),
    }


def cap_reached_before(spec: BatchSpec, plan: BatchPlan) -> bool:
    """True when earlier sessions already spent a cap: this one starts nothing."""
    if spec.max_total_tokens is None and spec.max_cost is None:
        return False
    assert spec.output is not None
    ended = ended_attempts(BatchDir(Path(spec.output)).load_attempts(), set(plan.prepared))
    judged_tokens, judged_cost, _ = judge_spent(spec.output, plan.judge_pricing)
    if (
        spec.max_total_tokens is not None
        and tokens_spent(ended) + judged_tokens >= spec.max_total_tokens
    ):
        return True
    return (
        spec.max_cost is not None
        and plan.pricing is not None
        and cost_spent(ended, plan.pricing) + judged_cost >= parse_max_cost(spec.max_cost)
    )


class Spend:
    """The batch's spend as it grows (thread-safe). The first time a cap is reached it says
    so, stops the batch's runs with the cap's error (`stop.stop(error)`: each stopped run
    records it) and calls `on_reached(BUDGET_EXCEEDED)`, from the thread whose call reached
    it."""

    def __init__(
        self,
        spec: BatchSpec,
        plan: BatchPlan,
        earlier: Iterable[dict[str, Any]],
        *,
        stop: StopRequest,
        on_reached: Callable[[str], None],
        message: Progress,
    ) -> None:
        self.cap = spec.max_total_tokens
        self.max_cost = parse_max_cost(spec.max_cost) if spec.max_cost is not None else None
        self.pricing = plan.pricing
        model = next(iter(plan.prepared.values())).model
        self.prices = (
            CallPrices(plan.pricing, model, check_prices(spec.prices)) if plan.pricing else None
        )
        self.stop = stop
        self.on_reached = on_reached
        self.message = message
        before = ended_attempts(earlier, set(plan.prepared))
        #: The judge's price (`--scorer model` under --max-cost), and what it spent before.
        self.judge_pricing = plan.judge_pricing
        judged = judge_spent(spec.output, plan.judge_pricing) if spec.output else (0, Decimal(0))
        self._done = tokens_spent(before) + judged[0]
        self._done_cost = cost_spent(before, self.pricing) if self.pricing else Decimal(0)
        self._done_cost += judged[1] if self.pricing else Decimal(0)
        self._live: dict[str, int] = {}
        self._live_cost: dict[str, Decimal] = {}
        #: Calls whose cost could not be counted, per running run; why the first one could not.
        self._uncounted: dict[str, int] = {}
        self._uncounted_why: str | None = None
        self._lock = threading.Lock()
        #: The error the cap stopped the batch's runs with (None: not reached).
        self.error: RunError | None = None

    @property
    def spent(self) -> int:
        with self._lock:
            return self._done + sum(self._live.values())

    @property
    def cost(self) -> Decimal:
        with self._lock:
            return self._done_cost + sum(self._live_cost.values(), Decimal(0))

    def over(self) -> str | None:
        """Which cap is reached, as the stop message says it (None: none)."""
        if self.cap is not None and (spent := self.spent) >= self.cap:
            return (
                f"the batch's cap --max-total-tokens {self.cap} was reached ({spent} tokens spent)"
            )
        if self.max_cost is None or self.pricing is None:
            return None
        if (cost := self.cost) >= self.max_cost:
            return (
                f"the batch's cap --max-cost {usd(self.max_cost)} was reached ({usd(cost)} "
                f"spent; {self.pricing.describe()})"
            )
        with self._lock:
            why = self._uncounted_why
        if why:
            return f"{why}, so the batch's spend is unknown and --max-cost stops it (fail closed)"
        return None

    @property
    def reached(self) -> bool:
        return self.over() is not None

    def watch(self, run_id: str) -> Callable[[dict[str, Any]], None]:
        """The run's `on_event`: adds each gateway-measured model call as it is recorded."""

        def on_event(event: dict[str, Any]) -> None:
            if event.get("type") != "model_call" or event.get("source") != "gateway":
                return
            inp, out = int(event.get("input_tokens") or 0), int(event.get("output_tokens") or 0)
            cost, why = self.cost_of(event.get("model"), inp, out)
            if event.get("usage_unknown") and self.prices is not None:
                why = "a model call's tokens could not be measured (the model server's answer "
                why += "reported no usage)"
            with self._lock:
                self._live[run_id] = self._live.get(run_id, 0) + inp + out
                self._live_cost[run_id] = self._live_cost.get(run_id, Decimal(0)) + cost
                if why:
                    self._uncounted[run_id] = self._uncounted.get(run_id, 0) + 1
                    self._uncounted_why = self._uncounted_why or why
            self.check()

        return on_event

    def judged(self, reply: JudgeReply) -> Decimal | None:
        """A judge call (`--scorer model`, made on the host through the batch's gateway)
        counted: its measured tokens, and with --max-cost its cost at the judge's price
        (returned; None without --max-cost). A call whose tokens could not be measured
        stops the batch under --max-cost, as a run's would."""
        inp, out = reply.input_tokens, reply.output_tokens
        cost = self.judge_pricing.cost(inp, out) if self.judge_pricing else Decimal(0)
        why = None
        if reply.usage_unknown and self.prices is not None:
            why = "a judge call's tokens could not be measured (the judge's answer reported "
            why += "no usage)"
        with self._lock:
            self._done += inp + out
            self._done_cost += cost
            if why:
                self._uncounted_why = self._uncounted_why or why
        self.check()
        return cost if self.judge_pricing is not None else None

    def cost_of(self, named: Any, inp: int, out: int) -> tuple[Decimal, str | None]:
        """A call's cost at the price of the model it names, and why it cannot be counted
        (None: it can; always 0 without --max-cost)."""
        if self.prices is None:
            return Decimal(0), None
        pricing = self.prices(named if isinstance(named, str) else None)
        if pricing is None:
            key = model_key(self.prices.model)
            return Decimal(0), (
                f"a model call named the model {named!r}, whose price is not known (the "
                f"batch's model is {key}; give --price {self.prices.model.provider}:{named}"
                "=IN/OUT)"
            )
        try:
            return (pricing.cost(inp, out) if inp or out else Decimal(0)), None
        except Exception as exc:  # never break the run's recording; the batch stops instead
            return Decimal(0), f"a model call could not be priced ({type(exc).__name__}: {exc})"

    def ended(self, run_id: str, result: RunResult) -> dict[str, Any]:
        """The run's final figures (measured, or as reported without a gateway) replace its
        live tokens; returns what its `attempts.jsonl` end line adds: its cost and
        uncounted calls (with --max-cost), and, for a run the cap stopped, the status
        `budget_exceeded` (it runs again on resume)."""
        with self._lock:
            self._live.pop(run_id, None)
            self._done += tokens_of(result.token_usage)
            cost = self._live_cost.pop(run_id, Decimal(0))
            self._done_cost += cost
            uncounted = self._uncounted.pop(run_id, 0)
        self.check()
        line: dict[str, Any] = {}
        if self.pricing is not None:
            line.update(cost_usd=str(cost), uncounted_calls=uncounted)
        error = result.error
        if result.status == "cancelled" and error is not None and error.type == BUDGET_EXCEEDED:
            line.update(status=BUDGET_EXCEEDED, error=error.to_dict())
        return line

    def check(self) -> bool:
        """True when a cap is reached (the first time: stop the batch)."""
        why = self.over()
        if why is None:
            return False
        error = host_error(BUDGET_EXCEEDED, f"{why}; the run was stopped and runs again on resume")
        with self._lock:
            first, self.error = self.error is None, self.error or error
        if first:
            self.stop.stop(error)  # the runs it stops record this error
            self.message(f"stopping: {why}; cancelling the running tasks")
            self.on_reached(BUDGET_EXCEEDED)
        return True

    def progress(self) -> dict[str, Any]:
        """`BatchProgress`'s spend fields."""
        return {
            "spent_tokens": self.spent,
            "max_total_tokens": self.cap,
            "spent_cost": float(self.cost) if self.pricing is not None else None,
            "max_cost": float(self.max_cost) if self.max_cost is not None else None,
        }
