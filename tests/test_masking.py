"""Secret masking (shared by host and runtime): plain, base64 at any alignment, line by line."""

from __future__ import annotations

import base64

import pytest

from orchestrator_runtime.masking import MASK, Masker

SECRET = "sk-live-9f8e7d6c5b4a3210"
MULTILINE = "-----BEGIN KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n-----END KEY-----"


@pytest.mark.parametrize("prefix", [b"", b"x", b"xy", b"token: "])
@pytest.mark.parametrize("encode", [base64.b64encode, base64.urlsafe_b64encode])
def test_base64_embedded_at_any_offset(prefix: bytes, encode) -> None:
    masker = Masker([SECRET])
    blob = encode(prefix + SECRET.encode() + b" and more").decode()
    masked = masker(blob)
    assert MASK in masked
    # The secret's middle bytes are no longer recoverable from what is left.
    clear = encode(SECRET.encode()[3:-3]).decode()[:8]
    assert clear not in masked


def test_plain_and_lines() -> None:
    masker = Masker([SECRET, MULTILINE])
    text = f"key={SECRET}\nline: MIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n"
    masked = masker(text)
    assert SECRET not in masked and "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC" not in masked
    assert masked.count(MASK) == 2


def test_data_is_masked_recursively() -> None:
    masker = Masker([SECRET])
    data = {"a": [SECRET, {"b": f"x{SECRET}y"}], SECRET: 1}
    assert SECRET not in str(masker.clean(data))


def test_short_values_are_not_masked() -> None:
    assert Masker(["ab"])("ab cab") == "ab cab"
