"""Option defaults a user sets once, so that every command need not repeat them.

Precedence, highest first: a command-line flag > an environment variable > the config file
> the payload's manifest > the built-in default. This module holds the middle two; the CLI
passes a flag's value when one was given, the runner applies the manifest and built-ins to
what is still unset.

    ORCHESTRATOR_MODEL, ORCHESTRATOR_BACKEND, ORCHESTRATOR_NETWORK, ORCHESTRATOR_CONCURRENCY

The config file is `$ORCHESTRATOR_CONFIG`, else `config.toml` in the state directory
(`$ORCHESTRATOR_HOME`, else `~/.orchestrator`):

    [defaults]
    model = "openai:gpt-4o-mini"
    backend = "docker"
    network = "allowlist"
    concurrency = 4
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from .config import home_dir
from .errors import ConfigError
from .registry import backend_names

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

CONFIG_ENV = "ORCHESTRATOR_CONFIG"
#: What `network` may be (`spec.NetworkPolicy.mode`), in the config file and a schedule.
NETWORK_MODES = ("none", "allowlist", "open")
#: Option name -> (environment variable, type, allowed values or None). The backends are
#: the registry's, asked when a value is checked (a plugin registers more).
OPTIONS: dict[str, tuple[str, type, tuple[str, ...] | None]] = {
    "model": ("ORCHESTRATOR_MODEL", str, None),
    "backend": ("ORCHESTRATOR_BACKEND", str, None),
    "network": ("ORCHESTRATOR_NETWORK", str, NETWORK_MODES),
    "concurrency": ("ORCHESTRATOR_CONCURRENCY", int, None),
}


def config_path() -> Path:
    return Path(os.environ.get(CONFIG_ENV) or home_dir() / "config.toml")


def load_config(path: Path | None = None) -> dict[str, Any]:
    """The `[defaults]` table of the config file ({} when there is no file), checked."""
    path = path or config_path()
    if not path.is_file():
        if os.environ.get(CONFIG_ENV):  # named on purpose: a typo should not pass silently
            raise ConfigError(f"Config file {path} (${CONFIG_ENV}) does not exist.", "")
        return {}
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"Config file {path} is not valid TOML: {exc}.", "Fix the file.") from exc
    unknown = set(data) - {"defaults"}
    table = data.get("defaults", {})
    if unknown or not isinstance(table, dict):
        raise ConfigError(
            f"Config file {path} has {sorted(unknown) or ['defaults']} where only a "
            "[defaults] table is known.",
            f"Keep only [defaults] with {', '.join(OPTIONS)}.",
        )
    for key, value in table.items():
        check(key, value, f"{path}: defaults.{key}")
    return table


def check(name: str, value: Any, where: str) -> Any:
    """`value` for option `name`, checked against its type and allowed values."""
    if name not in OPTIONS:
        raise ConfigError(f"{where} is not a known option.", f"Known: {', '.join(OPTIONS)}.")
    _, kind, allowed = OPTIONS[name]
    if name == "backend":
        allowed = backend_names()
    if kind is int and isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ConfigError(f"{where} must be {kind.__name__}, got {value!r}.", "")
    if allowed and value not in allowed:
        raise ConfigError(f"{where} is {value!r}.", f"Use one of {', '.join(allowed)}.")
    if kind is int and value < 1:
        raise ConfigError(f"{where} must be at least 1, got {value}.", "")
    return value


def user_default(name: str) -> tuple[Any, str] | None:
    """The environment's or the config file's value for option `name`, and where it came
    from (`$VAR` or the file's path); None when neither sets it."""
    env_name = OPTIONS[name][0]
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
