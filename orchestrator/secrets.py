"""Secrets: resolve only what a run needs from the environment / `.env`, and mask them."""

from __future__ import annotations

import base64
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dotenv import dotenv_values

from .errors import ConfigError

MASK = "***"
#: Values shorter than this are not masked: masking "a" or "1" would shred every log line.
MIN_MASKED_LENGTH = 4


def resolve_secrets(
    names: Iterable[str],
    *,
    env_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Look each name up in the process environment, then in `.env`; fail on any missing.

    The environment wins over `.env`. Nothing else from either source is read into the run.
    """
    environ = os.environ if environ is None else environ
    dotenv_path = Path(env_file) if env_file else Path.cwd() / ".env"
    from_file = dotenv_values(dotenv_path) if dotenv_path.is_file() else {}
    found: dict[str, str] = {}
    missing: list[str] = []
    for name in dict.fromkeys(names):
        value = environ.get(name) or from_file.get(name)
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


def _base64_forms(value: bytes) -> set[str]:
    """Base64 encodings of `value` as it can appear inside a larger encoded blob.

    Base64 works on 3-byte groups, so the same secret encodes differently depending on its
    offset in the blob: encode it at offsets 0, 1 and 2 and keep only the stable middle part.
    """
    forms: set[str] = set()
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        for offset in range(3):
            encoded = encode(b"\0" * offset + value).decode()
            start = (offset * 4 + 2) // 3 if offset else 0  # drop chars mixed with padding
            tail = len(value) + offset
            stable_end = (tail // 3) * 4  # chars fully determined by the secret's bytes
            form = encoded[start:stable_end] if offset or tail % 3 else encoded.rstrip("=")
            if len(form) >= MIN_MASKED_LENGTH:
                forms.add(form)
        full = encode(value).decode()
        forms.update({full, full.rstrip("=")})
    return {f for f in forms if len(f) >= MIN_MASKED_LENGTH}


class Redactor:
    """Replaces every secret, its base64 forms and each line of a multi-line secret."""

    def __init__(self, secrets: Iterable[str]) -> None:
        needles: set[str] = set()
        for secret in secrets:
            if not secret:
                continue
            for candidate in [secret, *secret.splitlines()]:
                candidate = candidate.strip()
                if len(candidate) >= MIN_MASKED_LENGTH:
                    needles.add(candidate)
                    needles.update(_base64_forms(candidate.encode()))
            needles.update(_base64_forms(secret.encode()))
        # Longest first so a secret is masked whole before any of its lines.
        self._needles = sorted(needles, key=len, reverse=True)

    def __bool__(self) -> bool:
        return bool(self._needles)

    def text(self, value: str) -> str:
        for needle in self._needles:
            if needle in value:
                value = value.replace(needle, MASK)
        return value

    def data(self, value: Any) -> Any:
        """Mask strings anywhere inside JSON-like data (dict keys included)."""
        if not self._needles:
            return value
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.data(k): self.data(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.data(v) for v in value]
        return value
