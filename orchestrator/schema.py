"""Declarative checks for the files a user writes: one schema per file kind (manifest,
schedules file, tasks rows, config file), every problem of a file found in one pass.

A `Table` maps the keys a table may hold to `Field`s (type, required, allowed values, range,
pattern, list items, a nested table, a further check). `check_table` walks parsed data
against it and returns the values that passed plus one `errors.Problem` per mistake, with
the field path relative to the table, "did you mean `max_steps`?" for an unknown key, and
allowed values listed as words ("one of none, allowlist, open"). The caller words each
problem as its file kind names fields and adds the line (`TomlLines` finds a key's line in
TOML source text, which `tomllib` does not give). Rules that need context (a path relative
to the file, the run's --allow-requirement, a cron line in its time zone) stay with the file
kind's loader and add to the same list.

Why our own and not pydantic v2 (the field's usual choice): pydantic is no host dependency
(pyproject.toml; only the openai client brings it, into the dev environment), and importing
it with one small model costs several times what an empty interpreter's start does. Cold
`orchestrator run` loads the manifest on its start path, where we count milliseconds; this
module is standard library only and adds well under a millisecond there (both measured:
benchmarks/results/code_figures.md#import-costs-on-the-start-path); `difflib` is imported
only when a key is unknown. The messages are the product (cause and fix in our words,
asserted by tests): pydantic's errors (`loc` tuples, its own `msg` texts) would be reworded
one by one anyway, and neither "did you mean" nor TOML line numbers come with it. What it
would give that we need, every error at once with its path, is the ~150 lines of checking
below.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .errors import Problem

Kind = type | tuple[type, ...]

#: What a value of each type is called in a message (TOML's words; JSON files pass theirs).
TOML_TYPES: Mapping[type, str] = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true or false",
    list: "a list",
    dict: "a table",
}
JSON_TYPES: Mapping[type, str] = {**TOML_TYPES, dict: "a JSON object", list: "a JSON array"}


class _Invalid:
    """The result of a value that did not pass (its problem is already recorded)."""


INVALID: Any = _Invalid()


class Field:
    """What one key of a table may hold. Every problem's fix is `fix` when given, else
    worded from the rule (allowed values, range).

    A plain class, not a dataclass: schemas are built at import time on the start path of
    `orchestrator run`, and a dataclass costs a millisecond or two to create.
    """

    __slots__ = (
        "kind",
        "required",
        "choices",
        "minimum",
        "maximum",
        "pattern",
        "items",
        "max_items",
        "table",
        "values",
        "check",
        "fix",
    )

    def __init__(
        self,
        kind: Kind = str,
        *,
        required: bool = False,
        choices: Sequence[str] | Callable[[], Sequence[str]] | None = None,
        minimum: float | None = None,
        maximum: float | None = None,
        pattern: re.Pattern[str] | None = None,
        items: Field | None = None,
        max_items: int | None = None,
        table: Table | None = None,
        values: Field | None = None,
        check: Callable[[Any], str | None] | None = None,
        fix: str = "",
    ) -> None:
        self.kind = kind
        self.required = required
        #: Allowed values, or a function giving them (asked at check time: plugins add
        #: backends).
        self.choices = choices
        self.minimum = minimum
        self.maximum = maximum
        #: For a string (or each string of a list): the pattern it must match in full.
        self.pattern = pattern
        #: For a list: what each item must be.
        self.items = items
        #: For a list: the most entries it may hold.
        self.max_items = max_items
        #: For a table with known keys.
        self.table = table
        #: For a table with free keys (`mock.scripts`): what each value must be.
        self.values = values
        #: A further rule: the problem as a phrase (`is not an IANA time zone`), or None.
        self.check = check
        #: What to do about a bad value (a sentence).
        self.fix = fix


class Table:
    """The keys a table may hold. `noun` names its keys in messages (`field`, `section`,
    `limit`); `brackets` shows them as TOML table headers (`[python]`); `unknown_fix` is
    added to the fix of an unknown key (e.g. where other data may go)."""

    __slots__ = ("fields", "noun", "brackets", "unknown_fix")

    def __init__(
        self,
        fields: Mapping[str, Field],
        *,
        noun: str = "field",
        brackets: bool = False,
        unknown_fix: str = "",
    ) -> None:
        self.fields = fields
        self.noun = noun
        self.brackets = brackets
        self.unknown_fix = unknown_fix

    def show(self, key: str) -> str:
        return f"`[{key}]`" if self.brackets else f"`{key}`"


def words(values: Sequence[str]) -> str:
    """`none, allowlist, open`: values listed as words, in their own order."""
    return ", ".join(str(v) for v in values)


def did_you_mean(key: str, known: Sequence[str], show: Callable[[str], str] = "`{}`".format) -> str:
    """`; did you mean `max_steps`?` for the closest known names, or "" (difflib's ratio)."""
    import difflib  # only when a key is unknown: not on the start path of a good file

    matches = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f"; did you mean {show(matches[0])}?" if matches else ""


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def check_table(
    table: Table, data: Mapping[str, Any], path: str = "", types: Mapping[type, str] = TOML_TYPES
) -> tuple[dict[str, Any], list[Problem]]:
    """The values of `data` that passed `table` (floats for float fields) and every problem:
    unknown keys, missing required keys (also inside a missing sub-table), bad values. Each
    problem's `field` is its path under `path` and `message` a phrase to put after it."""
    values: dict[str, Any] = {}
    problems: list[Problem] = []
    for key, value in data.items():
        spec = table.fields.get(key)
        where = join(path, str(key))
        if spec is None:
            known = sorted(table.fields)
            problems.append(
                Problem(
                    where,
                    f"is not a known {table.noun}" + did_you_mean(str(key), known, table.show),
                    f"Known {table.noun}s: {words([table.show(k) for k in known])}."
                    + (f" {table.unknown_fix}" if table.unknown_fix else ""),
                )
            )
            continue
        checked = check_value(spec, value, where, problems, types)
        if checked is not INVALID:
            values[key] = checked
    for key, spec in table.fields.items():
        if key in data:
            continue
        if spec.required:
            problems.append(Problem(join(path, key), "is missing", spec.fix or _fix(spec, types)))
        elif spec.table is not None:  # a missing table still misses its required keys
            problems.extend(check_table(spec.table, {}, join(path, key), types)[1])
    return values, problems


def check_value(
    spec: Field,
    value: Any,
    path: str,
    problems: list[Problem],
    types: Mapping[type, str] = TOML_TYPES,
    *,
    item: bool = False,
) -> Any:
    """`value` checked against `spec` (a float field's integer made a float), or INVALID
    after recording its problems under `path`. An `item` of a list is named as an entry."""
    kinds = spec.kind if isinstance(spec.kind, tuple) else (spec.kind,)
    shown = f"has an invalid entry {value!r}" if item else f"is {value!r}"
    given = value  # as written (a float field's integer is converted below)

    def bad(phrase: str, fix: str = "") -> Any:
        problems.append(Problem(path, phrase, spec.fix or fix))
        return INVALID

    if object not in kinds:
        expected = " or ".join(types.get(k, k.__name__) for k in kinds)
        if isinstance(value, bool) and bool not in kinds:
            return bad(
                f"has an entry {value!r} that is not {expected}"
                if item
                else f"must be {expected}, not true/false",
                _fix(spec, types),
            )
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        elif not isinstance(value, kinds):
            if int in kinds and isinstance(value, float):
                return bad(f"must be a whole number, got {value!r}", _fix(spec, types))
            got = _described(value, types)
            return bad(
                f"has an entry {got} that is not {expected}"
                if item
                else f"must be {expected}, got {got}",
                _fix(spec, types),
            )
    if spec.choices is not None:
        allowed = spec.choices() if callable(spec.choices) else spec.choices
        if value not in allowed:
            listed = words(allowed)
            return bad(f"{shown}, not one of {listed}", f"Use one of {listed}.")
    if (spec.minimum is not None and value < spec.minimum) or (
        spec.maximum is not None and value > spec.maximum
    ):
        return bad(f"is {given!r}, out of range", _fix(spec, types))
    if spec.pattern is not None and not spec.pattern.match(value):
        return bad(shown)
    if spec.check is not None:
        phrase = spec.check(value)
        if phrase:
            return bad(f"has an entry {value!r} that {phrase}" if item else f"{value!r} {phrase}")
    if spec.max_items is not None and len(value) > spec.max_items:
        return bad(
            f"has {len(value):,} entries, more than the maximum of {spec.max_items:,}",
            f"List at most {spec.max_items:,}.",
        )
    if spec.items is not None:
        kept = [check_value(spec.items, v, path, problems, types, item=True) for v in value]
        return INVALID if any(v is INVALID for v in kept) else kept
    if spec.table is not None:
        checked, found = check_table(spec.table, value, path, types)
        problems.extend(found)
        return INVALID if found else checked
    if spec.values is not None:
        free = {
            k: check_value(spec.values, v, join(path, str(k)), problems, types)
            for k, v in value.items()
        }
        return INVALID if any(v is INVALID for v in free.values()) else free
    return value


def _fix(spec: Field, types: Mapping[type, str]) -> str:
    if spec.choices is not None and not callable(spec.choices):
        return f"Use one of {words(spec.choices)}."
    kinds = spec.kind if isinstance(spec.kind, tuple) else (spec.kind,)
    if object in kinds:
        return ""
    expected = " or ".join(types.get(k, k.__name__) for k in kinds)
    if spec.minimum is not None and spec.maximum is not None:
        return f"Use {expected} from {spec.minimum:g} to {spec.maximum:g}."
    if spec.minimum is not None:
        return f"Use {expected} of at least {spec.minimum:g}."
    if spec.maximum is not None:
        return f"Use {expected} of at most {spec.maximum:g}."
    return f"Use {expected}."


def toml_named(path: str) -> str:
    """How a message names a TOML file's field: `[section]` for a top-level table, else
    field `section.key`."""
    return f"`[{path}]`" if "." not in path else f"field `{path}`"


def _described(value: Any, types: Mapping[type, str]) -> str:
    if isinstance(value, (dict, list)):
        return types.get(type(value), type(value).__name__)
    return repr(value)


# ---- where a key is in TOML source text ----------------------------------------------------

_HEADER_RE = re.compile(r"^\s*(\[\[?)([^\[\]]+)\]\]?\s*(#.*)?$")
_KEY_PART = r"""(?:[A-Za-z0-9_-]+|"[^"\n]*"|'[^'\n]*')"""
_KEY_RE = re.compile(rf"^\s*({_KEY_PART}(?:\s*\.\s*{_KEY_PART})*)\s*=")
_PART_RE = re.compile(_KEY_PART)


class TomlLines:
    """Line numbers of the tables and keys of a TOML text, by path (`limits.max_steps`;
    the elements of an array of tables numbered from 1: `schedule[2].cron`). A scan of the
    lines, not a parser: keys inside multi-line strings are skipped, keys of inline tables
    are found at their table's line (`line` falls back to the closest enclosing path)."""

    def __init__(self, text: str) -> None:
        self.lines: dict[str, int] = {}
        table = ""
        arrays: dict[str, int] = {}
        open_quote: str | None = None
        for number, line in enumerate(text.splitlines(), start=1):
            if open_quote is not None:
                if line.count(open_quote) % 2:
                    open_quote = None
                continue
            header = _HEADER_RE.match(line)
            key = None if header else _KEY_RE.match(line)
            if header:
                parts = _parts(header.group(2))
                table = _resolve(parts[:-1], arrays)
                table = join(table, parts[-1])
                if header.group(1) == "[[":
                    self.lines.setdefault(table, number)  # the array: its first element
                    arrays[table] = arrays.get(table, 0) + 1
                    table = f"{table}[{arrays[table]}]"
                elif table in arrays:
                    table = f"{table}[{arrays[table]}]"
                self.lines.setdefault(table, number)
            elif key:
                path = table
                for part in _parts(key.group(1)):
                    path = join(path, part)
                    self.lines.setdefault(path, number)
            for quote in ('"""', "'''"):
                if line.count(quote) % 2:
                    open_quote = quote
                    break

    def line(self, path: str) -> int | None:
        """The line of `path`, else of the closest table or key that holds it; None if none."""
        while path:
            if path in self.lines:
                return self.lines[path]
            cut = max(path.rfind("."), path.rfind("["))
            if cut > 0 and path[cut] == "[":
                return None  # an element not in the text: not its array's first line
            path = path[: max(cut, 0)]
        return None


def _parts(key: str) -> list[str]:
    return [p[1:-1] if p[:1] in "\"'" else p for p in _PART_RE.findall(key)]


def _resolve(parts: list[str], arrays: dict[str, int]) -> str:
    path = ""
    for part in parts:
        path = join(path, part)
        if path in arrays:
            path = f"{path}[{arrays[path]}]"
    return path


def decode_utf8(data: bytes) -> str:
    """A user's file as text (a leading byte-order mark dropped). Raises ValueError naming
    the line and column of the first byte that is not UTF-8, for an error message.

    Shared by every reader of a user's file (manifest, schedules, `.env`)."""
    data = data.removeprefix(b"\xef\xbb\xbf")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line_start = data.rfind(b"\n", 0, exc.start) + 1
        line = data.count(b"\n", 0, exc.start) + 1
        column = len(data[line_start : exc.start].decode()) + 1  # characters, as editors count
        raise ValueError(
            f"line {line}, column {column}: byte 0x{data[exc.start]:02x} is not valid UTF-8"
        ) from None
