"""The config file (`defaults.py`): checked from one schema, every problem at once, each with
its field path, line and fix; environment variables checked by the same fields. No Docker:
a bad config file is refused before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.defaults import check, load_config
from orchestrator.errors import ConfigError
from orchestrator.options import USER_DEFAULTS
from orchestrator.registry import backend_names
from tests.conftest import cli

#: The backends' names as messages list them: docker, e2b, then any installed plugin's.
NAMES = ", ".join(backend_names())
#: The options the config file takes (those declared with a user default), as listed.
KNOWN = ", ".join(f"`{name}`" for name in sorted(o.name for o in USER_DEFAULTS))

BAD = """\
[defaults]
modle = "openai:gpt-4o-mini"
network = "sideways"
concurrency = 0
backend = 3

[defualts]
model = "mock"
"""


def test_every_problem_of_the_config_file_is_named_with_its_line(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(BAD)
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert info.value.cause.startswith(f"Config file {config}: 5 problems:\n")
    for expected in (
        "line 2: field `defaults.modle` is not a known option; did you mean `model`? "
        f"Known options: {KNOWN}.",
        "line 3: field `defaults.network` is 'sideways', not one of none, allowlist, open. "
        "Use one of none, allowlist, open.",
        "line 4: field `defaults.concurrency` is 0, out of range. "
        "Use a whole number of sandboxes, at least 1.",
        "line 5: field `defaults.backend` must be a string, got 3.",
        "line 7: `[defualts]` is not a known table; did you mean `[defaults]`?",
    ):
        assert f"\n  - {expected}" in info.value.cause, (expected, info.value.cause)
    assert [p.field for p in info.value.problems] == [
        "defaults.modle",
        "defaults.network",
        "defaults.concurrency",
        "defaults.backend",
        "defualts",
    ]


def test_a_good_config_file_loads_and_one_problem_is_one_sentence(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[defaults]\nmodel = "mock"\nnetwork = "open"\nconcurrency = 3\n')
    assert load_config(config) == {"model": "mock", "network": "open", "concurrency": 3}
    config.write_text('[defaults]\nbackend = "k8s"\n')
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert info.value.cause == (
        f"Config file {config}:2: field `defaults.backend` is 'k8s', not one of {NAMES}."
    )
    assert info.value.fix == f"Use one of {NAMES}."


def test_environment_variables_are_checked_by_the_same_fields() -> None:
    assert check("concurrency", "4", "$ORCHESTRATOR_CONCURRENCY") == 4
    with pytest.raises(ConfigError) as info:
        check("network", "sideways", "$ORCHESTRATOR_NETWORK")
    assert info.value.cause == (
        "$ORCHESTRATOR_NETWORK is 'sideways', not one of none, allowlist, open."
    )
    with pytest.raises(ConfigError, match=r"\$ORCHESTRATOR_CONCURRENCY is 0, out of range"):
        check("concurrency", "0", "$ORCHESTRATOR_CONCURRENCY")


def test_a_bad_config_file_stops_run_with_every_problem(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(BAD)
    out = cli("run", "research_team", "--json", env={"ORCHESTRATOR_CONFIG": str(config)})
    assert out.returncode == 2
    error = json.loads(out.stdout)["error"]
    assert [(p["line"], p["field"]) for p in error["problems"]] == [
        (2, "defaults.modle"),
        (3, "defaults.network"),
        (4, "defaults.concurrency"),
        (5, "defaults.backend"),
        (7, "defualts"),
    ]
    assert "did you mean `model`?" in out.stderr and "sideways" in out.stderr
