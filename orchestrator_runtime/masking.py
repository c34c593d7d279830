"""Secret masking, shared by the host's run record and the runtime's event stream.

Like GitHub Actions: every secret value, each line of a multi-line secret and their base64
forms (standard and URL-safe, at every alignment inside a longer blob) become `***`.
Standard library only: the host imports this module, the runtime never imports the host.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Iterable
from typing import Any

MASK = "***"
#: Values and derived forms (lines of a multi-line secret, base64 fragments) shorter than this
#: are not masked: they would match ordinary text and shred every log line.
MIN_MASKED_LENGTH = 4


def _base64_forms(value: bytes) -> set[str]:
    """The base64 text that `value` produces on its own and inside a longer encoded blob.

    Like GitHub Actions: encode with 0, 1 and 2 leading bytes so every 3-byte alignment is
    covered, then drop the characters that depend on neighbouring bytes.
    """
    forms: set[str] = set()
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        forms.add(encode(value).decode())
        for offset in (0, 1, 2):
            text = encode(b"\0" * offset + value).decode().rstrip("=")
            text = text[(offset * 8 + 5) // 6 :]  # characters mixing prefix bits
            if (offset + len(value)) % 3:
                text = text[:-1]  # last character mixes in whatever follows
            forms.add(text)
    return forms


class Masker:
    """Replaces every secret value, each line of it and its base64 forms by `***`."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        needles: set[str] = set()
        for value in secrets:
            if not value:
                continue
            derived = {value, *(line.strip() for line in value.splitlines())}
            derived |= _base64_forms(value.encode())
            needles |= {n for n in derived if len(n) >= MIN_MASKED_LENGTH}
        self._needles = sorted(needles, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for needle in self._needles:
            if needle in text:
                text = text.replace(needle, MASK)
        return text

    def clean(self, value: Any) -> Any:
        """A JSON-safe copy of `value` with every string masked (str() for unknown objects)."""
        if value is None or isinstance(value, bool | int):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else str(value)
        if isinstance(value, str):
            return self(str(value))  # str(): drop str subclasses such as AgentText
        if isinstance(value, dict):
            return {self(str(k)): self.clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple | set | frozenset):
            return [self.clean(v) for v in value]
        return self(str(value))
