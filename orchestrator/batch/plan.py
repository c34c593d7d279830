"""A batch as data (spec, progress, summary) and its planning: every input checked up front."""

from __future__ import annotations

import re
import threading
from dataclasses import asdict, dataclass, field, replace
from decimal import Decimal
from pathlib import Path
from typing import Any

from ..errors import ConfigError, ManifestError, OrchestratorError
from ..execution.executor import Attempt, AttemptExecutor
from ..execution.pool import MAX_SIZE
from ..lifecycle.runner import PreparedRun, RunObservers, prepare
from ..records.store import Store
from ..spec import PAYLOAD_ERROR, RunSpec
from .figures import Figures
from .judge import JudgeOptions
from .prices import Pricing, check_prices, model_key, plan_pricing, pricing_for
from .scoring import MODEL_SCORER, make_scorer, scorer_names
from .sources import read_tasks
from .tasks import (
    BadLine,
    OnBadLine,
    Task,
    TaskFile,
    TaskFileError,
    listing,
    merged_args,
)


@dataclass
class BatchSpec:
    """A batch: a tasks file run against one payload/model/policy (`run` is the template;
    each task's text, arguments and limit overrides are filled in per task)."""

    tasks: str | Path
    #: The batch directory; None: `default_output` (the same for the same payload and tasks
    #: file, so running the same command again resumes).
    output: str | Path | None
    run: RunSpec
    #: The most attempts at once; None: auto (`batch/pace.py`). The number run at once adapts
    #: under it to what the host carries, unless `adapt` is False (then exactly this many).
    concurrency: int | None = None
    adapt: bool = True
    #: The scorer, or several in order (the first is the batch's score; `grading.py`).
    scorer: str | tuple[str, ...] = "exact"
    tolerance: float = 1e-6
    #: Attempts per task for infrastructure faults (1 = no retry).
    max_attempts: int = 3
    backoff_seconds: float = 2.0
    backoff_max_seconds: float = 60.0
    rerun_failed: bool = False
    #: Stop when this share (< 1) or number (>= 1) of tasks ended in `infra_error`.
    fail_on_error: float | None = None
    on_bad_line: OnBadLine = "fail"
    #: Warm sandboxes kept ready (orchestrator/execution/pool.py): None = as many as the concurrency
    #: when there are more tasks than that, 0 = none (every run starts cold).
    warm: int | None = None
    #: The batch's token cap (input + output, all attempts, all sessions; `batch/budget.py`):
    #: once reached, no task starts and running ones are stopped. None: no cap.
    max_total_tokens: int | None = None
    #: The batch's cost cap in US dollars (a number or its text; `batch/budget.py`), counted
    #: from gateway-measured tokens at the model's price (`batch/prices.py`). None: no cap.
    max_cost: Decimal | float | str | None = None
    #: Prices the user gives, per model as `--model` spells it: US dollars per million
    #: (input, output) tokens, e.g. `{"openai:gpt-4o-mini": (0.15, 0.60)}`; used by `max_cost`.
    prices: dict[str, Any] = field(default_factory=dict)
    #: Which tasks of the dataset run (`batch/sources.py`): its columns mapped to task fields
    #: (field -> column, over `<tasks>.fields.toml`), then the tasks of these ids (all when
    #: empty), in the order a seed gives (None: the file's), the first `limit`.
    field_map: dict[str, str] = field(default_factory=dict)
    sample_ids: tuple[str, ...] = ()
    shuffle: int | None = None
    limit: int | None = None
    #: The judge of the `model` scorer (`judge.py`); None: no model scorer.
    judge: JudgeOptions | None = None
    #: Times each task runs, each attempt its own sandbox and result line (`batch/epochs.py`).
    epochs: int = 1


def default_output(payload: str | Path, tasks: str | Path) -> Path:
    """`./batches/<payload folder>-<tasks file stem>`: predictable, so a resume finds it."""
    stem = re.sub(r"[^\w.-]+", "-", Path(str(tasks).rstrip("/")).stem).strip("-")
    return Path("batches") / f"{Path(payload).name}-{stem}"


@dataclass
class BatchProgress:
    """A snapshot for live displays."""

    total: int
    done: int
    running: int
    counts: dict[str, int]
    ran: int
    retries: int
    elapsed: float
    stopping: str | None
    #: Tokens spent by the batch so far (all sessions), and its cap (None: no cap).
    spent_tokens: int = 0
    max_total_tokens: int | None = None
    #: Its cost so far in US dollars, and its cost cap (None: no --max-cost).
    spent_cost: float | None = None
    max_cost: float | None = None
    #: Attempts allowed at once now (`concurrency.AdaptiveLimit`) and how: `2 (auto, up to 32)`.
    concurrency: int = 0
    concurrency_text: str = ""

    @property
    def rate_per_minute(self) -> float:
        return self.ran / self.elapsed * 60 if self.elapsed > 0 else 0.0

    @property
    def eta_seconds(self) -> float | None:
        remaining = self.total - self.done
        if remaining <= 0:
            return 0.0
        rate = self.rate_per_minute
        return remaining / rate * 60 if rate > 0 else None


@dataclass(kw_only=True)
class BatchSummary(Figures):
    """What a batch session ends with (summary.json): its state, the figures (`Figures`), the
    attempts, spend and pace."""

    batch_id: str
    state: str  # complete | interrupted | stopped
    output_dir: str
    tasks_file: str
    payload: str
    model: str
    scorer: str
    total: int
    pending: int
    tokens: dict[str, int]
    tokens_all_attempts: dict[str, int]
    #: `gateway` (measured on the host), `sandbox` (as reported) or `mixed`.
    tokens_source: str
    attempts: int
    retries: int
    skipped_lines: list[dict[str, Any]]
    stop_reason: str | None
    session: dict[str, Any]
    #: Attempts cancelled (an interrupted session, `runs stop`): run again on resume, not
    #: retries.
    cancelled: int = 0
    #: The spend caps (`budget.spend_summary`): caps, tokens spent by all attempts, their
    #: source, their cost and price, whether a cap was reached, which stopped the batch,
    #: attempts it stopped.
    spend: dict[str, Any] = field(default_factory=dict)
    #: How many ran at once (`AdaptiveLimit.describe`): mode, ceiling, the limit's changes.
    concurrency: dict[str, Any] = field(default_factory=dict)
    #: With several scorers, each one's figures (`ledger.scorer_figures`); `scorer` and the
    #: accuracy above are the first one's. Left out of `to_dict` for one scorer.
    scorers: dict[str, Any] = field(default_factory=dict)
    #: Times each task runs; `total` counts tasks, `pending` their epochs still to run.
    epochs: int = 1
    #: With epochs: each reducer's figure and standard error (`epochs.epoch_metrics`).
    epoch_metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        """0 every task has an agent outcome; 5 infrastructure faults remain or the batch was
        stopped (--fail-on-error, --max-total-tokens, --max-cost, a write error); 130
        interrupted (resume with the same command)."""
        if self.state == "interrupted":
            return 130
        if self.state == "stopped" or self.counts.get("infra_error") or self.pending:
            return 5
        return 0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if not data["scorers"]:  # one scorer: no `scorers` key, as one-scorer readers expect
            del data["scorers"]
        return data


@dataclass
class BatchPlan:
    file: TaskFile
    prepared: dict[str, PreparedRun]
    fingerprint: dict[str, Any]
    #: The price --max-cost counts with (None: no cost cap).
    pricing: Pricing | None = None
    #: The price the judge's calls count at (None: no cost cap, or no model scorer).
    judge_pricing: Pricing | None = None


def check_batch_options(spec: BatchSpec) -> None:
    """The batch's own numbers, checked before any task is read. Raises ConfigError (exit 2)."""
    if spec.max_attempts < 1:
        raise ConfigError("--max-attempts must be at least 1.", "Use 1 for no retries.")
    if isinstance(spec.epochs, bool) or not isinstance(spec.epochs, int) or spec.epochs < 1:
        raise ConfigError(
            f"--epochs must be a whole number of at least 1, not {spec.epochs!r}.",
            "Give how many times each task runs (1: once, as by default).",
        )
    if spec.concurrency is not None and spec.concurrency < 1:
        raise ConfigError("--concurrency must be at least 1.", "Use 1 to run tasks one by one.")
    if not spec.adapt and spec.concurrency is None:
        raise ConfigError(
            "--fixed-concurrency needs a number of sandboxes.",
            "Give --concurrency N with it, or leave it out to let the batch adapt.",
        )
    if spec.warm is not None and not 0 <= spec.warm <= MAX_SIZE:
        raise ConfigError(
            f"--warm must be from 0 (--no-warm) to {MAX_SIZE}, not {spec.warm}.",
            "Each warm sandbox holds a loaded runtime; the default keeps as many as the "
            "concurrency.",
        )
    if spec.fail_on_error is not None and spec.fail_on_error < 0:
        raise ConfigError(
            "--fail-on-error must be a share from 0 to 1 or a count.", "e.g. 0.1 or 5"
        )
    if spec.max_total_tokens is not None and (
        isinstance(spec.max_total_tokens, bool)
        or not isinstance(spec.max_total_tokens, int)
        or spec.max_total_tokens < 1
    ):
        raise ConfigError(
            f"--max-total-tokens must be a positive whole number, not {spec.max_total_tokens!r}.",
            "Give the batch's token cap (input + output, all tasks), e.g. 2000000; leave it out "
            "for no cap.",
        )


def plan_batch(spec: BatchSpec) -> BatchPlan:
    """Read the tasks and prepare every one of them: every input problem surfaces here,
    before a lock is taken or a sandbox started."""
    check_batch_options(spec)
    names = check_scorers(spec)  # a bad scorer fails now, not per task
    file = read_tasks(
        spec.tasks,
        fields=spec.field_map,
        on_bad_line=spec.on_bad_line,
        limit=spec.limit,
        sample_ids=spec.sample_ids,
        shuffle=spec.shuffle,
    )
    # Batch-wide problems (payload, model, network, secrets) are raised once, not per line.
    template = prepare(replace(spec.run, task=file.tasks[0].task, run_id="template"))
    prepared: dict[str, PreparedRun] = {}
    kept: list[Task] = []
    bad = list(file.bad_lines)
    for task in file.tasks:
        run_spec = replace(
            spec.run,
            task=task.task,
            additional_args=merged_args(spec.run.additional_args, task.additional_args),
            run_id="pending",
            **task.overrides,
        )
        try:
            prepared[task.id] = prepare(run_spec)
        except OrchestratorError as exc:
            bad.append(BadLine(task.line, exc.cause))
            continue
        kept.append(task)
    if len(bad) > len(file.bad_lines):
        if spec.on_bad_line == "fail":
            raise TaskFileError(
                listing(
                    f"{file.path} has {len(bad)} unusable line(s):",
                    [b.describe(file.path) for b in bad],
                ),
                "Fix the lines, or pass --on-bad-line skip to run the others.",
            )
        if not kept:
            raise TaskFileError(f"{file.path} holds no usable tasks.", "Fix the lines.")
    file = replace(file, tasks=kept, bad_lines=sorted(bad, key=lambda b: b.line))
    run = spec.run
    fingerprint = {
        "payload": str(template.manifest.folder.resolve()),
        "model": template.model.describe(),
        "api_base": run.api_base,
        "backend": template.backend,
        "network": template.network.mode,
        "allow_hosts": list(run.allow_hosts),
        "limits": asdict(template.limits),
        "allow_dangerous_imports": run.allow_dangerous_imports,
        "scorer": names[0] if len(names) == 1 else names,
        "tolerance": spec.tolerance if "numeric" in names else None,
    }
    if file.fields:  # only when set: batches started before mappings existed resume as they were
        fingerprint["fields"] = file.fields
    judged = spec.judge if MODEL_SCORER in names else None
    if judged is not None:
        fingerprint.update(judged.fingerprint())
    judge_key = model_key(judged.spec()) if judged is not None else None
    judge_pricing = None
    if spec.max_cost is not None and judged is not None:
        judge_pricing = pricing_for(judged.spec(), check_prices(spec.prices))
    if spec.epochs != 1:  # absent for one epoch: batch.json as batches always wrote it
        fingerprint["epochs"] = spec.epochs
    pricing = plan_pricing(
        spec.max_cost,
        {k: v for k, v in spec.prices.items() if spec.max_cost is None or k != judge_key},
        {t: p.model for t, p in prepared.items()},
        {t: None if p.gateway else (p.gateway_off or "no gateway") for t, p in prepared.items()},
    )
    return BatchPlan(
        file=file,
        prepared=prepared,
        fingerprint=fingerprint,
        pricing=pricing,
        judge_pricing=judge_pricing,
    )


def check_scorers(spec: BatchSpec) -> list[str]:
    """The batch's scorer names, each loadable, and the judge usable when `model` is one
    (ConfigError, exit 2)."""
    names = scorer_names(spec.scorer)
    for name in names:
        if name != MODEL_SCORER:
            make_scorer(name, tolerance=spec.tolerance)
    if MODEL_SCORER in names:
        if spec.judge is None:
            raise ConfigError(
                "--scorer model needs a judge: the model that grades the answers.",
                "Give --judge provider:id (as --model; with --judge-api-base for a server of "
                "your own).",
            )
        spec.judge.check()
    elif spec.judge is not None:
        raise ConfigError(
            "--judge is used only by --scorer model, which is not among the scorers.",
            "Add --scorer model, or leave --judge out.",
        )
    return names


def check_payload_loads(
    plan: BatchPlan, executor: AttemptExecutor, store: Store, cancel: threading.Event | None
) -> None:
    """Before any task: one sandbox loads the payload's agent tree (no step runs). A payload
    that cannot load is bad input (ManifestError, exit 2), not a thousand failed tasks, and
    is never retried. Other outcomes are left to the tasks to meet."""
    if not plan.prepared:
        return
    first = next(iter(plan.prepared.values()))
    check = prepare(replace(first.spec, check_only=True, run_id=None, batch=None))
    observers = RunObservers(store=store, cancel=cancel or threading.Event())
    result = executor.run(Attempt(check), observers)
    if result.error is not None and result.error.type == PAYLOAD_ERROR:
        problems = [str(p) for p in result.error.problems or (result.error.message,)]
        raise ManifestError(
            f"The payload {first.manifest.name} cannot load: {'; '.join(problems)} "
            f"(check run {result.run_id}).",
            "Fix the payload (`orchestrator validate PAYLOAD` reports every problem at once); "
            "no task was started.",
        )
