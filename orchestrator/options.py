"""Run options, declared once: every option a run takes from outside its payload (a flag of
`run` and `batch`, a key of a `[[schedule]]` table, a field of a tasks row).

An `Option` says the `RunSpec` field it sets, its rule (a `schema.Field`: type, range,
allowed values, the same for a flag and a file), its flag and help, and where it applies.
The parser (`cli/common.add_run_options`), a RunSpec from flags (`cli/common.spec_from_args`),
the schedules file's schema and `Schedule.run_spec`, a tasks row's fields and overrides, and
the generated reference (docs/hooks/reference.py) all read `RUN_OPTIONS`, so a new option is
one `Option` below, the `RunSpec` field it fills, and its use; tests/test_options.py checks
that every declared option reaches each place it applies to. Its default is its `RunSpec`
field's (None: the payload's, else the built-in one), never a second copy.

An option that applies to `defaults` may also be set once by the user: the config file's
`[defaults]` table and its variable (`$ORCHESTRATOR_` and its name in capitals) read it
(`defaults.py`), below a flag and above the manifest.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from .models import PROVIDERS
from .policy import hosts_field
from .registry import backend_entry, backend_names, backends_help
from .schema import Field, Table
from .spec import LIMIT_RULES, NETWORK_MODES, SETTABLE_LIMITS_TABLE, Limits, RunSpec

#: Where an option may be given: a flag of `orchestrator run`, of `orchestrator batch`, a key
#: of a `[[schedule]]` table, a field of a batch's tasks row (that task's override), the
#: user's defaults (the config file's `[defaults]` and the option's `$ORCHESTRATOR_` variable).
Place = Literal["run", "batch", "schedule", "task", "defaults"]
#: Every place a run's own value may be given (a limit may be given in each).
PLACES: tuple[Place, ...] = ("run", "batch", "schedule", "task")
#: The run's own settings: every command that runs, and a schedule; a task takes the batch's.
RUN_WIDE: frozenset[Place] = frozenset({"run", "batch", "schedule"})
#: A flag only: a schedule file cannot set it (it would let a file widen what a run may do).
FLAGS: frozenset[Place] = frozenset({"run", "batch"})
#: The prefix of an option's variable (`ORCHESTRATOR_MODEL` for `model`).
VARIABLE_PREFIX = "ORCHESTRATOR_"

#: What `sandbox_runtime` may be in a file, a flag or a variable: `auto` or a runtime's name.
#: Which names exist is the run's backend's (`Capabilities.sandbox_runtimes`, checked by
#: `Backend.check_runtime` with the allowed names), so a plugin can offer its own.
SANDBOX_RUNTIME = Field(
    str,
    pattern=re.compile(r"^[a-z0-9]([a-z0-9._-]*[a-z0-9])?$"),
    fix="Use auto or a sandbox runtime the run's backend offers (lowercase letters, digits, "
    "., _ and -).",
)


class Option:
    """One run option. A plain class, not a dataclass: the table is built on the start path
    of every command (see `schema.Field`).

    `name`: the `RunSpec` field, a schedule's key and a tasks row's field (a limit's sits
    under `limits` in a schedule, as in a manifest); `rule`: what a value may be; `flag`: its
    command-line flag (default `--name-with-dashes`; a bool that defaults to true is turned
    off by it, one that defaults to false on); `aliases`: other names a tasks row may use;
    `path`: a file, relative to the file that names it (and there when a schedule is
    checked); `checked_by_run`: the runner checks the flag's value (with the payload's own,
    every problem at once), the parser only its type; `known`: a quick membership test for
    choices that are costly to list (a built-in backend, without reading entry points).
    """

    __slots__ = (
        "name",
        "rule",
        "help",
        "flag",
        "metavar",
        "applies",
        "limit",
        "aliases",
        "path",
        "checked_by_run",
        "known",
        "every_run",
    )

    def __init__(
        self,
        name: str,
        rule: Field | None = None,
        *,
        help: str | Callable[[], str],
        flag: str | None = None,
        metavar: str | None = None,
        applies: Iterable[Place] = RUN_WIDE,
        limit: bool = False,
        aliases: tuple[str, ...] = (),
        path: bool = False,
        checked_by_run: bool = False,
        known: Callable[[str], bool] | None = None,
        every_run: bool = False,
    ) -> None:
        self.name = name
        self.rule = rule or Field(str)
        self.help = help
        self.flag = flag or "--" + name.replace("_", "-")
        self.metavar = metavar
        self.applies = frozenset(applies)
        self.limit = limit
        self.aliases = aliases
        self.path = path
        self.checked_by_run = checked_by_run
        self.known = known
        self.every_run = every_run

    @property
    def kind(self) -> type:
        """The type of one value (`list` for a repeatable flag)."""
        return self.rule.kind if isinstance(self.rule.kind, type) else self.rule.kind[0]

    @property
    def default(self) -> Any:
        """The RunSpec field's default: what a run gets when nothing sets the option (None
        for a batch's own option, `CONCURRENCY`: the batch then chooses)."""
        spec_field = RunSpec.__dataclass_fields__.get(self.name)
        if spec_field is None:
            return None
        factory = spec_field.default_factory
        return factory() if callable(factory) else spec_field.default

    @property
    def variable(self) -> str | None:
        """The environment variable of its user default (None: it has none)."""
        return VARIABLE_PREFIX + self.name.upper() if "defaults" in self.applies else None

    @property
    def key(self) -> str:
        """Its path in a schedule table: `limits.max_steps` for a limit, else its name."""
        return f"limits.{self.name}" if self.limit else self.name

    def help_text(self) -> str:
        return self.help() if callable(self.help) else self.help

    def value(self, raw: Any) -> Any:
        """A checked value as RunSpec holds it (a list as a tuple)."""
        return tuple(raw) if isinstance(raw, list) else raw


def _limits() -> tuple[Option, ...]:
    """An option for each settable limit, in `Limits`' order, from its `LimitRule` (declared
    with the limit in spec.py): its type and range (one rule for a manifest, flags, a
    schedule and a tasks row, checked by the runner with the manifest's), its flag and help,
    which ends with `Limits`' default (unless the help says it)."""
    found = []
    for name, rule in LIMIT_RULES.items():
        if not rule.settable:
            continue
        help = rule.help
        if not rule.says_default:
            default = getattr(Limits, name)
            shown = int(default) if isinstance(default, float) and default.is_integer() else default
            help = f"{help} (default: manifest, else {shown})"
        found.append(
            Option(
                name,
                SETTABLE_LIMITS_TABLE.fields[name],
                help=help,
                flag=rule.flag,
                metavar=rule.metavar,
                aliases=rule.aliases,
                limit=True,
                checked_by_run=True,
                applies=PLACES,
            )
        )
    return tuple(found)


def _model_help() -> str:
    providers = "; ".join(f"{name}: {spec.summary}" for name, spec in PROVIDERS.items())
    return (
        f"provider[:model_id] ({providers}). Default: $ORCHESTRATOR_MODEL, the config "
        "file's model, else mock"
    )


def _backend_help() -> str:
    return (
        f"where sandboxes run: {backends_help()}. Default: $ORCHESTRATOR_BACKEND, the "
        "config file's backend, the payload's `payload.backend`, else docker"
    )


#: A run-wide option the user may also set once (`defaults`).
USER_SET: frozenset[Place] = RUN_WIDE | {"defaults"}

#: Every run option, in the order `--help` lists them.
RUN_OPTIONS: tuple[Option, ...] = (
    # which model, at which endpoint, with which key
    Option("model", help=_model_help, applies=USER_SET),
    Option("api_base", help="model endpoint URL (OpenAI-compatible servers, LiteLLM)"),
    Option("model_key_env", help="environment variable holding the model's API key"),
    # where the sandbox runs, on which kernel, and what it may reach or install
    Option(
        "backend",
        Field(str, choices=backend_names),  # None: the payload's, else the default
        help=_backend_help,
        applies=USER_SET,
        metavar="NAME",
        known=lambda name: backend_entry(name) is not None,
    ),
    Option(
        "network",
        Field(str, choices=NETWORK_MODES),
        applies=USER_SET,
        help="network policy: none (default for a mock model and no declared hosts), "
        "allowlist (default otherwise: the model's host, the payload's [network] hosts and "
        "--allow-host, through an egress proxy) or open (unrestricted; only when named); "
        "$ORCHESTRATOR_NETWORK or the config file's network come first when set",
    ),
    Option(
        "sandbox_runtime",
        SANDBOX_RUNTIME,  # None: the payload's, else auto
        metavar="RUNTIME",
        applies=USER_SET,
        every_run=True,
        checked_by_run=True,
        help="the sandbox's kernel: auto (default: the backend's best) or one the backend "
        "offers (refused otherwise, naming them); on docker: runsc (gVisor's; set it up with "
        "scripts/setup-gvisor.sh), runc (the host's, behind our seccomp profile), runsc-direct "
        "(gVisor run by runsc itself, each run without network restored from a snapshot, the "
        "restore begun at `run`'s start where the payload ran before unless "
        "$ORCHESTRATOR_HEAD_START=off; root: docs/guides/kernel.md), auto: runsc-direct where "
        "runsc is installed and the host lets us run it (root), else runsc when the engine has "
        "it, else runc; "
        "$ORCHESTRATOR_SANDBOX_RUNTIME, the config file's "
        "sandbox_runtime, then the payload's `payload.sandbox_runtime` come first when set "
        "(e2b: only auto)",
    ),
    Option(
        "allow_hosts",
        hosts_field(
            "List DNS names (api.example.com, *.example.com); for a model server on this "
            'machine set `api_base = "http://127.0.0.1:PORT/v1"` instead.'
        ),
        flag="--allow-host",
        metavar="HOST",
        checked_by_run=True,
        help="extra host the sandbox may reach under allowlist (api.example.com or "
        "*.example.com; ports 80 and 443)",
    ),
    Option(
        "allowed_requirements",
        Field(list, items=Field(str)),
        flag="--allow-requirement",
        metavar="REQ",
        applies=FLAGS,
        help="let the payload install exactly this requirement string although it is not a "
        "package specification, e.g. a `name @ file:///...` or `name @ https://...` reference "
        "(pip on this machine fetches or opens it); repeat for each",
    ),
    # the run's limits (each: the flag, else the manifest, else the default): spec.Limits
    *_limits(),
    Option(
        "gateway",
        Field(bool),
        flag="--no-gateway",
        help="put the model key into the sandbox instead of serving the model through the "
        "run's gateway (default: a gateway for openai, hf and litellm models; a backend "
        "without one refuses them unless this is given; no host-measured tokens or budgets "
        "without it)",
    ),
    Option(
        "traces_to",
        metavar="URL",
        applies=FLAGS,
        help="export each run's OpenTelemetry trace (the run, its agents' spans, its model "
        "calls) to this OTLP/HTTP collector, e.g. http://127.0.0.1:6006 (Phoenix); `off` for "
        "none. Default: OpenTelemetry's OTEL_EXPORTER_OTLP_ENDPOINT (and _HEADERS, "
        "_PROTOCOL) when set, else no traces",
    ),
    Option(
        "env_file",
        path=True,  # a schedule's: relative to the schedules file, default .env beside it
        help="dotenv file to read secrets from (default: ./.env)",
    ),
    Option(
        "allow_dangerous_imports",
        Field(bool),
        flag="--i-understand-dangerous-imports",
        applies=FLAGS,
        help="allow authorized_imports such as os or subprocess in the inner executor",
    ),
)


def options_for(place: Place) -> tuple[Option, ...]:
    """The options that may be given at `place`, in declaration order."""
    return tuple(o for o in RUN_OPTIONS if place in o.applies)


def schedule_fields() -> dict[str, Field]:
    """A `[[schedule]]` table's keys for the run options: each by name, the limits in one
    `limits` table (as a manifest's `[limits]`), where the first limit is declared."""
    chosen = options_for("schedule")
    limits = Table({o.name: o.rule for o in chosen if o.limit}, noun="limit")
    fields: dict[str, Field] = {}
    for option in chosen:
        if not option.limit:
            fields[option.name] = option.rule
        elif "limits" not in fields:
            fields["limits"] = Field(dict, table=limits)
    return fields


def from_schedule(values: Mapping[str, Any]) -> dict[str, Any]:
    """The RunSpec fields a checked `[[schedule]]` table sets (its limits flattened), as
    RunSpec holds them; an empty string sets nothing (`model = ""`: the payload's); a path
    as written (the schedules file resolves it)."""
    found: dict[str, Any] = {}
    for option in options_for("schedule"):
        source = values.get("limits", {}) if option.limit else values
        if source.get(option.name) not in (None, ""):
            found[option.name] = option.value(source[option.name])
    return found


#: A tasks row's other names for fields (`timeout` for `timeout_seconds`).
TASK_ALIASES: dict[str, str] = {a: o.name for o in options_for("task") for a in o.aliases}

#: A batch's own option (`BatchSpec.concurrency`, not a run's), declared here so that the
#: user's defaults can hold it too; `orchestrator batch` reads its flag from it (with `-j`
#: and `auto`, the batch's own choice, which is also its default).
CONCURRENCY = Option(
    "concurrency",
    Field(int, minimum=1, fix="Use a whole number of sandboxes, at least 1."),
    metavar="auto|N",
    applies=("batch", "defaults"),
    help="the most sandboxes at once: how many run adapts under it to what the host "
    "carries (starts at min(2 x CPUs, 75%% of free memory / memory limit); warm on runc, "
    "1 x CPUs: the pool starts sandboxes beside the runs; then more "
    "while throughput grows, fewer when it does not fall or memory runs short). Default: "
    "$ORCHESTRATOR_CONCURRENCY, the config file's concurrency, else auto (up to 32)",
)

#: The options a user may set once (`defaults.py`: the config file and the variables).
USER_DEFAULTS: tuple[Option, ...] = (*options_for("defaults"), CONCURRENCY)

_BY_NAME = {o.name: o for o in (*RUN_OPTIONS, CONCURRENCY)}


def option(name: str) -> Option:
    """The option declared as `name` (KeyError for none), for a command or a file that takes
    it under its own rule (`validate`'s flags, a manifest's `payload.backend`)."""
    return _BY_NAME[name]
