"""Plain data shared by every layer: what a run is asked to do, what it became, its limits."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field, fields
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

from orchestrator_runtime.protocol import MAX_STEPS_CEILING

from .errors import ManifestError
from .schema import Field, Table, check_table

#: How a run ended (`RunResult.status`; the index's `status` once the run is over).
RunStatus = Literal["succeeded", "failed", "timed_out", "oom_killed", "infra_error", "cancelled"]
#: The error types the host decides itself (`RunResult.error.type`). A run's error may
#: also carry the type the sandbox reported, or the class name of the exception that ended
#: the run on the host (`ImageBuildError`, ...): those are open-ended.
HostErrorType = Literal[
    "timed_out",
    "cancelled",
    "oom_killed",
    "budget_exceeded",
    "network_lost",
    "record_unwritable",
    "protocol_violation",
    "sandbox_lost",
    "no_result",
    "orphaned",
    "payload_error",
    "node_lost",
]

#: The error type of a run whose payload could not be loaded (bad input: exit 2).
PAYLOAD_ERROR: HostErrorType = "payload_error"

#: Exit codes the CLI returns per status, for cron jobs and shell scripts to branch on.
EXIT_CODES: dict[RunStatus, int] = {
    "succeeded": 0,
    "failed": 1,
    "timed_out": 3,
    "oom_killed": 4,
    "infra_error": 5,
    "cancelled": 130,
}


#: The keys of a run error's dict that `RunError` has fields for; any other key the sandbox
#: reported (a program's `exit_code`, ...) is kept in `RunError.extra`.
_ERROR_KEYS = ("type", "message", "kind", "problems", "field")


@dataclass(frozen=True)
class RunError:
    """A run's error (`RunResult.error`), built one way wherever the host writes one, so the
    dicts in records, result lines and attempt logs keep one shape and one key order.

    `type`: a `HostErrorType`, the type the sandbox reported, or the class name of the
    exception that ended the run on the host (open-ended); `kind`: a class of error readers
    branch on (`infra`: raised before the run record existed; the sandbox's `payload`,
    `model_unavailable`, ...); `problems`: bad input, each problem once (a payload error),
    always with `field`, the RunSpec field at fault (None when unknown); `extra`: what else
    the sandbox reported with it. A dict only at the edge: `to_dict` when written,
    `from_dict` when read back (any record ever written, any error a sandbox reported).
    """

    type: str
    message: str
    kind: str | None = None
    problems: tuple[Any, ...] | None = None
    field: str | None = None
    extra: dict[str, Any] = dataclass_field(default_factory=dict)
    #: The keys of the dict it was read from, in order (`from_dict`): written back as read.
    read_keys: tuple[str, ...] = dataclass_field(default=(), compare=False, repr=False)

    @classmethod
    def of(
        cls, exc: BaseException, message: str | None = None, *, kind: str | None = None
    ) -> RunError:
        """The error of a run an exception ended on the host: its class name, and `message`
        (the exception's text, masked by the caller) or its text."""
        return cls(type(exc).__name__, str(exc) if message is None else message, kind=kind)

    @classmethod
    def payload(cls, message: str, field: str | None) -> RunError:
        """A payload that asks for what cannot be had: bad input (exit 2), never retried."""
        return cls(PAYLOAD_ERROR, message, problems=(message,), field=field)

    @classmethod
    def from_dict(cls, data: Any, *, default_type: str = "error") -> RunError:
        """A run error from its dict (result.json, an attempt line, the sandbox's `run_end`);
        what the sandbox wrote is untrusted: a value that is not a dict becomes the message
        of an error of `default_type`, and `to_dict` gives back the keys it had."""
        if not isinstance(data, dict):
            return cls(default_type, "" if data is None else str(data))
        problems = data.get("problems")
        listed = tuple(problems) if isinstance(problems, (list, tuple)) else None
        kept = {k: v for k, v in data.items() if k not in _ERROR_KEYS}
        if "problems" in data and listed is None:
            kept["problems"] = problems  # not a list: kept as it came
        return cls(
            _text(data.get("type")),
            _text(data.get("message")),
            kind=_text_or_none(data.get("kind")),
            problems=listed,
            field=_text_or_none(data.get("field")),
            extra=kept,
            read_keys=tuple(str(k) for k in data),
        )

    def to_dict(self) -> dict[str, Any]:
        """The error as JSON holds it: the host's own in one key order; one read back
        (`from_dict`) with the keys it came with, in their order (old records unchanged)."""
        if self.read_keys:  # read from a dict: its keys, in its order, with their values now
            values = {**self.extra, **self._known()}
            order = self.read_keys + tuple(
                k for k in ("type", "message") if k not in self.read_keys
            )
            return {k: values[k] for k in order if k in values}
        error: dict[str, Any] = {"type": self.type, "message": self.message}
        if self.problems is not None:
            error.update(problems=list(self.problems), field=self.field)
        if self.kind is not None:
            error["kind"] = self.kind
        return {**error, **self.extra}

    def _known(self) -> dict[str, Any]:
        known: dict[str, Any] = {"type": self.type, "message": self.message, "kind": self.kind}
        if self.problems is not None:
            known["problems"] = list(self.problems)
        known["field"] = self.field
        return known

    def __str__(self) -> str:
        """`type: message`, as the CLI and logs say an error."""
        return f"{self.type}: {self.message}"


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def _text_or_none(value: Any) -> str | None:
    return None if value is None else str(value)


def host_error(type_: HostErrorType, message: str) -> RunError:
    """A run's error as the host decided it (`RunResult.error`)."""
    return RunError(type_, message)


class StopRequest(threading.Event):
    """A cancel event that says why it was set: a caller that stops runs for a reason of its
    own (a batch's spend cap) calls `stop(error)`, and every run it stops records that error
    (status `cancelled`, error type such as `budget_exceeded`) instead of "cancelled by the
    user". `set()` alone is a plain cancel. The first reason given stays."""

    def __init__(self) -> None:
        super().__init__()
        self.error: RunError | None = None

    def stop(self, error: RunError) -> None:
        if self.error is None:
            self.error = error  # before `set`: whoever sees the event set sees why
        self.set()


@dataclass
class RunSpec:
    """What to run: a payload (a folder with manifest.toml, or a program: a `.py` file or a
    folder with `__main__.py`/`main.py`), a task, a model and a policy. Unset limits come
    from the payload's manifest (a program's `[tool.orchestrator]`), then from the defaults
    in `Limits`. A program's task, when given, replaces the task of its first agent run."""

    payload: str | Path
    task: str | None = None
    #: `mock` or `provider:model_id`; None: a program's own models (a program's
    #: `payload.model` when it names one), the mock model for a payload.
    model: str | None = None
    api_base: str | None = None
    model_key_env: str | None = None
    model_options: dict[str, Any] = field(default_factory=dict)
    additional_args: dict[str, Any] | None = None
    #: A backend's name (`registry.backend_names`); None: the manifest's `payload.backend`,
    #: else the registry's default.
    backend: str | None = None
    network: str | None = None
    #: `auto` or one of the backend's `Capabilities.sandbox_runtimes`; None: the payload's
    #: `payload.sandbox_runtime`, else auto.
    sandbox_runtime: str | None = None
    allow_hosts: tuple[str, ...] = ()
    #: Requirement strings (`name @ URL` references) the payload may install although they are
    #: not package specifications: each exactly as the manifest spells it.
    allowed_requirements: tuple[str, ...] = ()
    max_steps: int | None = None
    timeout_seconds: float | None = None
    memory_mb: int | None = None
    cpus: float | None = None
    pids: int | None = None
    max_model_calls: int | None = None
    max_tokens: int | None = None
    #: Serve the model through a per-run gateway that holds its key (the sandbox gets only a
    #: run token). False (`--no-gateway`) sends the key into the sandbox, masked in the record.
    gateway: bool = True
    env_file: str | Path | None = None
    allow_dangerous_imports: bool = False
    schedule: str | None = None
    batch: str | None = None
    #: The batch task this run is an attempt of (its trace is tagged with it).
    task_id: str | None = None
    run_id: str | None = None
    #: Where the run's OpenTelemetry trace is exported (an OTLP/HTTP URL); None: as
    #: OpenTelemetry's environment variables say (off when they name no endpoint); "off".
    traces_to: str | None = None
    #: A program's arguments (its `sys.argv[1:]`); a payload takes none.
    program_args: tuple[str, ...] = ()
    #: Load the payload's agent tree in the sandbox and check it, but run no step
    #: (`orchestrator validate`, and batch before its first task). Secrets get placeholders.
    check_only: bool = False

    def max_steps_from(self, limits_set: tuple[str, ...]) -> str:
        """Who sets the run's `max_steps` (the request's `max_steps_from`): `run` (its
        options, a tasks row, a schedule), the `manifest` (`limits_set`: the limits its file
        sets), else `program`: each agent keeps its own, `Limits.max_steps` limits nothing."""
        if self.max_steps is not None:
            return "run"
        return "manifest" if "max_steps" in limits_set else "program"


@dataclass
class RunResult:
    run_id: str
    status: RunStatus
    answer: Any = None
    #: Why the run did not succeed (None when it did); a dict only in JSON (`to_dict`).
    error: RunError | None = None
    exit_code: int | None = None
    oom_killed: bool = False
    #: Measured by the model gateway when the run had one (`token_usage_source: gateway`),
    #: else as the sandbox reported it (`sandbox`: the sandbox can claim any figure).
    token_usage: dict[str, int] = field(default_factory=dict)
    token_usage_source: str = "sandbox"
    #: What the sandbox itself reported, kept beside a measured figure.
    token_usage_reported: dict[str, int] = field(default_factory=dict)
    #: True when the sandbox reported other figures than the gateway measured.
    token_usage_mismatch: bool = False
    #: The model gateway of the run: `enabled`, and `calls`, `refused`, `upstream`, or why not.
    gateway: dict[str, Any] = field(default_factory=dict)
    steps: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    #: The sandbox was pre-started (a pool's) rather than made for the run; `timings` then
    #: has `sandbox_wait`, the seconds the run waited for it.
    warm: bool = False
    record_dir: str = ""
    payload: str = ""
    model: str = ""
    backend: str = ""
    network: str = ""
    #: The effective allowlist of an `allowlist` run (hosts, host:port endpoints).
    allowlist: list[str] = field(default_factory=list)
    #: Connections refused by the egress proxy or seen blocked in the sandbox.
    egress_blocked: int = 0
    #: Where the run's bound secrets (`[secrets.bind]`) were put on the wire: one entry per
    #: secret, host and place (`{"secret", "host", "place", "count"}`), never a value.
    secrets_injected: list[dict[str, Any]] = field(default_factory=list)
    image: str = ""
    #: The limits the run had (manifest, then command line, tasks row or schedule);
    #: `max_steps` is None when neither set it (each agent then kept its own).
    limits: dict[str, Any] = field(default_factory=dict)
    #: Each agent's effective `max_steps` and who set it, as the sandbox's `run_start` said:
    #: `[{"agent": "manager", "max_steps": 6, "from": "program"}]` (`from`: program,
    #: manifest or run); empty when the run ended before its agents were built.
    agent_max_steps: list[dict[str, Any]] = field(default_factory=list)
    #: What isolated the sandbox (`Sandbox.isolation`): runtime, seccomp profile, `pids` (what
    #: held its processes; on gVisor RLIMIT_NPROC's figure, and why when memory set it), and
    #: `snapshot`: the id of the snapshot it was restored from (absent: started cold).
    sandbox: dict[str, str] = field(default_factory=dict)
    #: The cluster node the run ran on (a Ray node: node_id, address, hostname); empty on
    #: this host.
    node: dict[str, Any] = field(default_factory=dict)
    #: A program's output (what it printed, and smolagents' own log lines), as the record
    #: holds it (masked), its last OUTPUT_TAIL_BYTES; empty for a payload.
    output: str = ""
    #: The run's trace when tracing was on (orchestrator/records/traces.py): `trace_id`, `spans`,
    #: `sandbox_spans`, `flags`, and `exported`, `endpoint`, `error` of its export.
    traces: dict[str, Any] = field(default_factory=dict)

    @property
    def cli_exit_code(self) -> int:
        if self.error is not None and self.error.type == PAYLOAD_ERROR:
            return 2  # bad input: the payload cannot load
        return EXIT_CODES.get(self.status, 5)

    def to_dict(self) -> dict[str, Any]:
        """The result as result.json, result lines and `--json` write it."""
        data = asdict(self)
        data["error"] = None if self.error is None else self.error.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunResult:
        """A result read back (result.json, a node's record): keys it does not know are
        ignored (a newer or older writer), its error a `RunError`. Raises TypeError without
        `run_id` or `status`."""
        known = {k: v for k, v in data.items() if k in _RESULT_FIELDS}
        error = known.get("error")
        known["error"] = None if error is None else RunError.from_dict(error)
        return cls(**known)


_RESULT_FIELDS = frozenset(f.name for f in fields(RunResult))


_L = TypeVar("_L", int, float)


@dataclass(frozen=True)
class LimitRule:
    """How a limit may be set, declared with its `Limits` field: its range and the words for
    it (every file kind's schema, the flags and `Limits.validate` check it); for a limit a run
    may set (`settable`: a manifest's `[limits]`, a flag of `run` and `batch`, a schedule's
    `limits`, a tasks row), its flag's help (ending with the default, unless `says_default`),
    flag (default `--name-with-dashes`), metavar and the other names a tasks row may use
    (`options.RUN_OPTIONS` makes its `Option` from this)."""

    low: float
    high: float
    allowed: str
    help: str = ""
    flag: str | None = None
    metavar: str | None = None
    aliases: tuple[str, ...] = ()
    says_default: bool = False
    settable: bool = True


def limit(default: _L, rule: LimitRule) -> _L:
    """A `Limits` field: its default and its rule, declared once."""
    return dataclass_field(default=default, metadata={"limit": rule})


@dataclass(frozen=True)
class Limits:
    """Resource limits of one run. Every limit has a default; nothing is unbounded. A new
    limit is a field here (its `LimitRule`), its `RunSpec` field and its use."""

    max_steps: int = limit(
        10,
        LimitRule(
            1,
            MAX_STEPS_CEILING,
            f"an integer from 1 to {MAX_STEPS_CEILING}",
            says_default=True,
            help="steps of the top agent; its managed agents get at most as many (default: the "
            "manifest's [limits] max_steps, the same way; else each agent keeps the max_steps "
            "its program gave it, smolagents' default 20; `runs show` says what each had and "
            "why)",
        ),
    )
    timeout_seconds: float = limit(
        300.0,
        LimitRule(
            1,
            86400,
            "1 to 86400 seconds",
            help="wall-clock seconds",
            flag="--timeout",
            aliases=("timeout",),
        ),
    )
    memory_mb: int = limit(
        1024, LimitRule(64, 65536, "64 to 65536 MiB", help="memory limit in MiB", flag="--memory")
    )
    cpus: float = limit(1.0, LimitRule(0.1, 64, "0.1 to 64", help="CPU limit"))
    pids: int = limit(256, LimitRule(16, 32768, "16 to 32768", help="process limit"))
    #: The sandbox's /tmp: the image's business, not a run's.
    tmpfs_mb: int = limit(256, LimitRule(1, 16384, "1 to 16384 MiB", settable=False))
    #: Model calls the gateway forwards in one run (call N+1 is refused; the run ends).
    max_model_calls: int = limit(
        200,
        LimitRule(
            1,
            100_000,
            "1 to 100000 calls",
            metavar="N",
            help="model calls the run's gateway forwards; call N+1 ends the run with "
            "budget_exceeded",
        ),
    )
    #: Input plus output tokens the gateway lets one run spend (measured from responses; the
    #: call that crosses the line completes, the next is refused).
    max_tokens: int = limit(
        2_000_000,
        LimitRule(
            1,
            1_000_000_000,
            "1 to 1000000000 tokens",
            metavar="N",
            help="input + output tokens the run may spend, as the gateway measures them",
        ),
    )

    def recorded(self, max_steps_from: str) -> dict[str, Any]:
        """The limits as a run's record keeps them: `max_steps` None when nobody set it
        (`max_steps_from` is `program`: each agent kept its own)."""
        kept = asdict(self)
        if max_steps_from == "program":
            kept["max_steps"] = None
        return kept

    def validate(self, where: str) -> None:
        """Raise ManifestError naming every limit out of its range (its `LimitRule`); `where`
        says where the limits came from (a file, the
        command line)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        problems = check_table(LIMITS_TABLE, values)[1]
        if problems:
            raise ManifestError.of_problems(
                where,
                [p.replace(message=f"limit `{p.field}` {p.message}") for p in problems],
                "Fix the limits named above.",
            )


#: A network policy's mode: no network, an allowlist through an egress proxy, or open.
NetworkMode = Literal["none", "allowlist", "open"]
#: What `network` may be (`--network`, the config file, a schedule, a tasks row).
NETWORK_MODES: tuple[str, ...] = get_args(NetworkMode)


@dataclass(frozen=True)
class NetworkPolicy:
    """Where a sandbox may connect. `mode` is `none`, `allowlist` or `open`."""

    mode: NetworkMode = "none"
    #: Allowed host names (`api.example.com`, `*.example.com`) on ports 80 and 443.
    hosts: tuple[str, ...] = ()
    #: A model endpoint on the Docker host itself (`host:port`), reachable only if named.
    host_endpoints: tuple[tuple[str, int], ...] = ()
    #: Further exact `(host, port)` pairs, e.g. a model server on a port other than 80/443.
    endpoints: tuple[tuple[str, int], ...] = ()


#: Every limit's rule, from `Limits`.
LIMIT_RULES: dict[str, LimitRule] = {f.name: f.metadata["limit"] for f in fields(Limits)}

#: Every limit's type, from `Limits`.
LIMIT_TYPES_BY_NAME: dict[str, type] = {
    f.name: {"int": int, "float": float}[str(f.type)] for f in fields(Limits)
}

#: The limits a manifest, a command line, a tasks file or a schedule may set, with their
#: types (every field of `Limits` whose rule is `settable`).
SETTABLE_LIMITS: dict[str, type] = {
    name: kind for name, kind in LIMIT_TYPES_BY_NAME.items() if LIMIT_RULES[name].settable
}


def _limit_field(name: str) -> Field:
    rule = LIMIT_RULES[name]
    kind = LIMIT_TYPES_BY_NAME[name]
    return Field(kind, minimum=rule.low, maximum=rule.high, fix=f"Use {rule.allowed}.")


#: The `[limits]` table of a manifest, a schedule's `limits`, a tasks row's limit fields:
#: type (a whole number where the limit is one; never true/false) and range, per limit.
SETTABLE_LIMITS_TABLE = Table({name: _limit_field(name) for name in SETTABLE_LIMITS}, noun="limit")
LIMITS_TABLE = Table({name: _limit_field(name) for name in LIMIT_TYPES_BY_NAME}, noun="limit")
