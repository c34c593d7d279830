"""Secrets: resolve only what a run needs from the environment / `.env`.

Masking is shared with the in-sandbox runtime (`orchestrator_runtime.masking`).
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..schema import decode_utf8

if TYPE_CHECKING:
    from ..models import ModelSpec
    from .manifest import Manifest


def needed_secrets(manifest: Manifest, model: ModelSpec) -> list[str]:
    """The secrets a run gets: exactly the payload's declared ones plus the model's credential
    (but a Bedrock model's: the host's AWS credentials come from botocore's chain, and only
    to its gateway, `models.aws.host_credentials`)."""
    key = [model.credential_env] if model.credential_env and not model.aws_signed else []
    return list(dict.fromkeys([*manifest.secrets, *key]))


#: What a program's key variables hold when its own models are not used (see `run_secrets`).
NO_KEY = "no-key:the-program's-models-are-not-used-in-this-run"


def run_secrets(
    needed: list[str],
    *,
    check_only: bool,
    values: bool,
    env_file: str | Path | None,
    placeholders: Iterable[str] = (),
) -> dict[str, str]:
    """The secrets a run ships: `needed` with their values (raises ConfigError for one that
    is not set); a check (`validate`) needs them set but ships placeholders, since no step
    runs; `values=False` (schedule validation) reads none. `placeholders`: the variables a
    program's models read their keys from when those models are replaced (--model, mock) or
    not called (a check): they hold NO_KEY, so that the models can still be made (OpenAI's
    client refuses to be made without a key)."""
    if check_only:
        resolve_secrets(needed, env_file=env_file)
        secrets = {name: "placeholder-for-validation" for name in needed}
    else:
        secrets = resolve_secrets(needed, env_file=env_file) if values else {}
    for name in placeholders:
        secrets.setdefault(name, NO_KEY)
    return secrets


def secret_owners(manifest: Manifest, model: ModelSpec) -> dict[str, str]:
    """Who asks for each secret a run gets (the names of `needed_secrets`, in order), for
    messages: `the payload NAME` (its `[secrets] required`) or `the model's key (PROVIDER)`;
    a model that needs no key (mock) is never named."""
    owners = {name: f"the payload {manifest.name}" for name in manifest.secrets}
    if model.credential_env:
        key = f"the key of the model {model.provider}:{model.model_id}"
        name = model.credential_env
        owners[name] = f"{owners[name]} and {key}" if name in owners else key
    return owners


def resolve_secrets(
    names: Iterable[str],
    *,
    env_file: str | Path | None = None,
) -> dict[str, str]:
    """Look each name up in the process environment, then in `.env`; fail on any missing.

    The environment wins over `.env`. Nothing else from either source is read into the run.
    A `.env` that is not UTF-8 is a ConfigError naming the file and line.
    """
    dotenv_path = Path(env_file) if env_file else Path.cwd() / ".env"
    from_file = read_dotenv(dotenv_path) if dotenv_path.is_file() else {}
    found: dict[str, str] = {}
    missing: list[str] = []
    for name in dict.fromkeys(names):
        value = os.environ.get(name) or from_file.get(name)
        if value:
            found[name] = value
        else:
            missing.append(name)
    if missing:
        where = f"the environment or {dotenv_path}"
        raise ConfigError(
            f"Missing secret{'s' if len(missing) > 1 else ''} {', '.join(missing)}: "
            f"required by this run but not set in {where}.",
            f"Export {missing[0]}=... (or add it to .env) and run again; nothing was started.",
        )
    return found


def read_dotenv(path: Path) -> dict[str, str | None]:
    """The variables of a dotenv file; one that is not UTF-8 is a ConfigError (exit 2)
    naming the file and line."""
    try:
        text = decode_utf8(path.read_bytes())
    except ValueError as exc:
        raise ConfigError(
            f"{path}: {exc}.", "Save the .env file as UTF-8 (or point --env-file elsewhere)."
        ) from exc
    from dotenv import dotenv_values  # here: a run with no .env file never imports it

    return dotenv_values(stream=io.StringIO(text))
