"""Option defaults a user sets once, so that every command need not repeat them.

Precedence, highest first: a command-line flag > an environment variable > the config file
> the payload's manifest > the built-in default. This module holds the middle two; the CLI
passes a flag's value when one was given, the runner applies the manifest and built-ins to
what is still unset.

Which options, their rules and their variables are declared with the options
(`options.USER_DEFAULTS`: those that apply to `defaults`, each read from
`$ORCHESTRATOR_NAME`); the config file is `$ORCHESTRATOR_CONFIG`, else `config.toml` in the
state directory (`$ORCHESTRATOR_HOME`, else `~/.orchestrator`), with one table:

    [defaults]
    model = "openai:gpt-4o-mini"
    concurrency = 4
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from .errors import ConfigError, Problem
from .options import USER_DEFAULTS
from .paths import home_dir
from .schema import Field, Table, TomlLines, check_table, check_value, toml_named

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

CONFIG_ENV = "ORCHESTRATOR_CONFIG"
#: Option name -> the environment variable that sets it.
OPTIONS: dict[str, str] = {o.name: str(o.variable) for o in USER_DEFAULTS}
#: What each option may be, in the config file's `[defaults]` and in its variable: the
#: option's own rule (the backends are the registry's, asked when a value is checked).
DEFAULTS = Table({o.name: o.rule for o in USER_DEFAULTS}, noun="option")
#: The config file: one `[defaults]` table.
CONFIG = Table({"defaults": Field(dict, table=DEFAULTS)}, noun="table", brackets=True)


def config_path() -> Path:
    return Path(os.environ.get(CONFIG_ENV) or home_dir() / "config.toml")


def load_config(path: Path | None = None) -> dict[str, Any]:
    """The `[defaults]` table of the config file ({} when there is no file), checked against
    `CONFIG`; raises ConfigError naming every problem (field path, line, fix)."""
    path = path or config_path()
    if not path.is_file():
        if os.environ.get(CONFIG_ENV):  # named on purpose: a typo should not pass silently
            raise ConfigError(f"Config file {path} (${CONFIG_ENV}) does not exist.", "")
        return {}
    try:
        text = path.read_text(encoding="utf-8")
        data = tomllib.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"Config file {path} is not valid TOML: {exc}.", "Fix the file.") from exc
    values, problems = check_table(CONFIG, data)
    if problems:
        lines = TomlLines(text)
        raise ConfigError.of_problems(
            f"Config file {path}",
            [
                p.replace(message=f"{toml_named(p.field)} {p.message}", line=lines.line(p.field))
                for p in problems
            ],
            f"Fix the file: only [defaults] with {', '.join(OPTIONS)}.",
        )
    return values.get("defaults", {})


def check(name: str, value: Any, where: str) -> Any:
    """`value` for option `name` (from `where`: an environment variable), checked against
    `DEFAULTS`; raises ConfigError."""
    spec = DEFAULTS.fields.get(name)
    if spec is None:
        raise ConfigError(f"{where} is not a known option.", f"Known: {', '.join(OPTIONS)}.")
    if spec.kind is int and isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    problems: list[Problem] = []
    checked = check_value(spec, value, name, problems)
    if problems:
        raise ConfigError(f"{where} {problems[0].message}.", problems[0].fix)
    return checked


def choose_sandbox_runtime(requested: str | None, payload_choice: str | None) -> str:
    """A run's sandbox runtime: its own, else the machine's ($ORCHESTRATOR_SANDBOX_RUNTIME,
    the config file: it holds for every run, API and schedules too), else the payload's,
    else auto. Raises ConfigError for a bad value in the environment or the config file."""
    if requested:
        return requested
    machine = user_default("sandbox_runtime")
    return str(machine[0]) if machine else payload_choice or "auto"


def user_default(name: str) -> tuple[Any, str] | None:
    """The environment's or the config file's value for option `name`, and where it came
    from (`$VAR` or the file's path); None when neither sets it."""
    env_name = OPTIONS[name]
    raw = os.environ.get(env_name)
    if raw:
        return check(name, raw, f"${env_name}"), f"${env_name}"
    config = load_config()
    if name in config:
        return config[name], str(config_path())
    return None


def fill(values: dict[str, Any]) -> dict[str, Any]:
    """`values` (option -> flag value or None) with the unset ones taken from the
    environment or the config file; still None where neither sets them."""
    filled = dict(values)
    for name, value in values.items():
        if value is None and name in OPTIONS:
            found = user_default(name)
            if found is not None:
                filled[name] = found[0]
    return filled
