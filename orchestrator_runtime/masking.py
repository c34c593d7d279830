"""Secret masking, shared by the host's run record and the runtime's event stream.

Like GitHub Actions: every secret value, each line of a multi-line secret and their base64
forms (standard and URL-safe, at every alignment inside a longer blob) become `***`; so do
the hex (lower and upper case) and percent-encoded (URL) forms of the value and of each line.
Standard library only: the host imports this module, the runtime never imports the host.

Masking catches a value printed as it is or in one of these encodings. It cannot catch a
value split across outputs, reversed, encrypted or otherwise transformed by code that means
to leak it: the only real protection for a key is not to give it to the sandbox.
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote, quote_plus

MASK = "***"
#: Values and derived forms (lines of a multi-line secret, base64 fragments) shorter than this
#: are not masked: they would match ordinary text and shred every log line. Nor are the hex and
#: percent forms of a value or line shorter than this (the hex of `}}` is `7d7d`).
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


def _hex_forms(value: bytes) -> set[str]:
    """The hex text of `value`, lower and upper case.

    Hex needs no alignment work: each byte is two characters, so inside the hex of a longer
    byte string the secret's hex starts at an even offset and is exactly `value.hex()`; plain
    substring search finds it (a match at an odd offset is masked too, which only over-masks).
    """
    text = value.hex()
    return {text, text.upper()}


_ESCAPE_RE = re.compile(r"%[0-9A-F]{2}")


def _percent_forms(value: str) -> set[str]:
    """The percent-encoded (URL) forms of `value`: `urllib.parse.quote` (keeping `/` or not)
    and `quote_plus` (space as `+`), each with upper and lower case hex digits in the escapes.
    """
    forms = {quote(value, safe=safe) for safe in ("/", "")}
    forms |= {quote_plus(value, safe=safe) for safe in ("", "/")}
    return forms | {_ESCAPE_RE.sub(lambda m: m.group().lower(), form) for form in forms}


class Masker:
    """Replaces every secret value, each line of it and their encoded forms (base64 of the
    value; hex and percent-encoding of the value and of each line) by `***`."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        needles: set[str] = set()
        for value in secrets:
            if not value:
                continue
            sources = {value, *(line.strip() for line in value.splitlines())} - {""}
            derived = set(sources) | _base64_forms(value.encode())
            for source in sources:
                if len(source) >= MIN_MASKED_LENGTH:
                    derived |= _hex_forms(source.encode()) | _percent_forms(source)
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
