"""orchestrator/schema.py as such: `check_table` finds every problem of a table in one pass
(unknown keys with "did you mean", missing required keys, also inside a missing sub-table,
bad types, ranges and choices, list items, nested paths), keeps what passed, and `TomlLines`
names the line of a key, a table and an element of an array of tables. The file kinds built
on it (manifest, schedules, tasks, config) are tested with their loaders."""

from __future__ import annotations

import tomllib

from orchestrator.schema import Field, Table, TomlLines, check_table

LIMITS = Table(
    {
        "max_steps": Field(int, minimum=1, maximum=100),
        "timeout_seconds": Field(float, minimum=1),
    },
    noun="limit",
)
MANIFEST = Table(
    {
        "name": Field(str, required=True),
        "network": Field(str, choices=("none", "allowlist", "open")),
        "hosts": Field(list, items=Field(str), max_items=3),
        "limits": Field(dict, table=LIMITS),
        "python": Field(dict, table=Table({"entrypoint": Field(str, required=True)})),
    },
    brackets=False,
)


def problems_of(data: dict) -> dict[str, tuple[str, str]]:
    """Each problem's field, with its message and fix."""
    _, found = check_table(MANIFEST, data)
    return {p.field: (p.message, p.fix) for p in found}


def test_a_good_table_passes_whole_and_a_float_field_takes_an_int() -> None:
    data = {
        "name": "x",
        "network": "open",
        "hosts": ["a.example"],
        "limits": {"max_steps": 5, "timeout_seconds": 30},
        "python": {"entrypoint": "main.py"},
    }
    values, found = check_table(MANIFEST, data)
    assert found == []
    assert values["limits"] == {"max_steps": 5, "timeout_seconds": 30.0}
    assert isinstance(values["limits"]["timeout_seconds"], float)


def test_every_problem_is_found_in_one_pass_with_its_path() -> None:
    found = problems_of(
        {
            "network": "closed",
            "hosts": ["a", 2],
            "limits": {"max_step": 5, "timeout_seconds": 0},
            "extra": True,
        }
    )
    assert set(found) == {
        "name",  # required, missing
        "network",  # not one of the choices
        "hosts",  # an item of the wrong type
        "limits.max_step",  # unknown, inside a sub-table
        "limits.timeout_seconds",  # under the minimum
        "extra",  # unknown at the top
        "python.entrypoint",  # required inside a sub-table that is missing altogether
    }, found
    assert found["name"][0] == "is missing"
    assert "none, allowlist, open" in " ".join(found["network"])
    message, fix = found["limits.max_step"]
    assert message == "is not a known limit; did you mean `max_steps`?", message
    assert fix.startswith("Known limits: `max_steps`, `timeout_seconds`."), fix
    assert "did you mean" not in found["extra"][0]  # nothing close to it
    message, fix = problems_of({"name": "x", "hosts": list("abcd")})["hosts"]
    assert message == "has 4 entries, more than the maximum of 3" and fix == "List at most 3."


def test_values_that_failed_are_left_out_and_the_rest_kept() -> None:
    values, found = check_table(MANIFEST, {"name": 3, "network": "none"})
    assert [p.field for p in found] == ["name", "python.entrypoint"]
    assert values == {"network": "none"}


def test_toml_lines_name_keys_tables_and_array_elements() -> None:
    text = (
        'name = "x"\n'  # 1
        "\n"  # 2
        "[limits]\n"  # 3
        "max_steps = 0\n"  # 4
        '"timeout_seconds" = 5\n'  # 5
        "[[schedule]]\n"  # 6
        'cron = "* * * * *"\n'  # 7
        "[[schedule]]\n"  # 8
        'note = """\n'  # 9
        "fake = 1\n"  # 10: inside a multi-line string, not a key
        '"""\n'  # 11
        'cron = "bad"\n'  # 12
    )
    tomllib.loads(text)  # the text is TOML
    lines = TomlLines(text)
    assert lines.line("name") == 1
    assert lines.line("limits") == 3 and lines.line("limits.max_steps") == 4
    assert lines.line("limits.timeout_seconds") == 5
    assert lines.line("limits.nothing_here") == 3  # the closest enclosing table
    assert lines.line("schedule[1].cron") == 7 and lines.line("schedule[2].cron") == 12
    assert lines.line("schedule[2].fake") == 8  # not the line inside the string
    assert lines.line("schedule[3].cron") is None  # an element not in the text
    assert lines.line("missing") is None
