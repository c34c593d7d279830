"""Secret masking (shared by host and runtime): plain, base64 at any alignment, hex, percent
encoding, line by line."""

from __future__ import annotations

import base64
from urllib.parse import quote, quote_plus

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


@pytest.mark.parametrize("case", [str.lower, str.upper])
def test_hex_of_the_whole_secret(case) -> None:
    masker = Masker([SECRET])
    hex_text = case(SECRET.encode().hex())
    assert masker(f"dump: {hex_text}\n") == f"dump: {MASK}\n"


@pytest.mark.parametrize("prefix", [b"", b"x", b"xy", b"token: "])
@pytest.mark.parametrize("case", [str.lower, str.upper])
def test_hex_inside_a_longer_hex_dump(prefix: bytes, case) -> None:
    """The secret's hex sits at an even offset of the dump's hex, whatever precedes it."""
    masker = Masker([SECRET])
    dump = case((prefix + SECRET.encode() + b" and more").hex())
    masked = masker(dump)
    assert masked == case(prefix.hex()) + MASK + case(b" and more".hex())
    assert case(SECRET.encode()[2:-2].hex()) not in masked


def test_hex_of_each_line_of_a_multiline_secret() -> None:
    masker = Masker([MULTILINE])
    line = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC"
    masked = masker(f"{line.encode().hex()} {line.encode().hex().upper()}")
    assert masked == f"{MASK} {MASK}"


ESCAPED = "p@ss w/rd+é~!:"  # every character here but the letters and `~` gets escaped


@pytest.mark.parametrize(
    "encoded",
    [
        quote(ESCAPED),  # keeps `/`
        quote(ESCAPED, safe=""),
        quote_plus(ESCAPED),  # space as `+`
        quote_plus(ESCAPED, safe="/"),
        quote(ESCAPED).lower(),  # lower-case hex digits in the escapes
        quote_plus(ESCAPED).lower(),
    ],
)
def test_percent_encoded_forms(encoded: str) -> None:
    assert encoded != ESCAPED
    masker = Masker([ESCAPED])
    assert masker(f"GET /login?password={encoded}&next=1") == f"GET /login?password={MASK}&next=1"


def test_percent_encoded_line_of_a_multiline_secret() -> None:
    secret = "user: admin\npass: s3cr3t/p@ss"
    masked = Masker([secret])(f"url=https://x.example/?p={quote_plus('pass: s3cr3t/p@ss')}")
    assert masked == f"url=https://x.example/?p={MASK}"


def test_ordinary_text_is_untouched() -> None:
    masker = Masker([SECRET, MULTILINE, ESCAPED])
    text = (
        "sha256 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08\n"
        "GET /search?q=hello%20world&lang=en+US HTTP/1.1\n"
        "0123456789abcdef DEADBEEF %41%42 sk-live- 9f8e7d6c\n"
    )
    assert masker(text) == text


def test_short_values_give_no_encoded_forms() -> None:
    """A value shorter than MIN_MASKED_LENGTH is not masked, nor its hex or percent forms."""
    masker = Masker(["ab", "}}", "a b"])
    text = "6162 7d7d 7D7D a%20b a+b"
    assert masker(text) == text
