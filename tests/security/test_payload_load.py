"""A payload that cannot load is bad input: `validate` loads it for real (in a sandbox, no
step) and names every problem; `run` exits 2 with error type payload_error; a batch starts no
task."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.records.store import Store

from ..conftest import cli, write_payload

pytestmark = pytest.mark.docker

MANIFEST = """
[payload]
name = "broken"
entrypoint = "agent:{function}"
example_task = "Answer."

[mock.scripts]
{scripts}
"""
SCRIPT = '["Thought: done.\\n<code>\\nfinal_answer(1)\\n</code>"]'
#: The helper is a ToolCallingAgent: its outputs are tool calls as JSON.
HELPER_SCRIPT = """['Action: {"name": "final_answer", "arguments": {"answer": "1"}}']"""

AGENT = """
from smolagents import CodeAgent, ToolCallingAgent


def build(model):
    helper = ToolCallingAgent(tools=[], model=model, name="helper", description="helps")
    return CodeAgent(tools=[], model=model, managed_agents=[helper])
"""


def broken(tmp_path: Path, *, function: str = "build", scripts: str = "", code: str = AGENT):
    folder = tmp_path / "broken"
    folder.mkdir(parents=True)
    scripts = scripts or f"manager = {SCRIPT}\nhelper = {HELPER_SCRIPT}"
    return write_payload(folder, MANIFEST.format(function=function, scripts=scripts), code)


def test_a_missing_entrypoint_function_is_bad_input(tmp_path: Path, agent_image: str) -> None:
    folder = broken(tmp_path, function="no_such_function")
    checked = cli("validate", str(folder), "--json")
    assert checked.returncode == 2, checked.stderr
    report = json.loads(checked.stdout)
    assert not report["ok"] and "no_such_function" in report["problems"][0]
    ran = cli("run", str(folder), "--json", "--quiet")
    assert ran.returncode == 2, ran.stderr
    result = json.loads(ran.stdout)
    assert result["status"] == "failed" and result["error"]["type"] == "payload_error"


def test_an_import_error_is_named(tmp_path: Path, agent_image: str) -> None:
    folder = broken(tmp_path, code="import no_such_module_xyz\n" + AGENT)
    checked = cli("validate", str(folder))
    assert checked.returncode == 2
    assert "no_such_module_xyz" in checked.stderr, checked.stderr


def test_mock_scripts_for_unknown_and_missing_agents_are_all_reported(
    tmp_path: Path, agent_image: str
) -> None:
    folder = broken(tmp_path, scripts=f"manager = {SCRIPT}\nlibrarian = {SCRIPT}")
    checked = cli("validate", str(folder), "--json")
    assert checked.returncode == 2
    problems = json.loads(checked.stdout)["problems"]
    assert any("'librarian', which is not an agent" in p for p in problems), problems
    assert any("no mock script for agent 'helper'" in p for p in problems), problems
    good = broken(tmp_path / "good")
    before = {r["run_id"] for r in Store().list_runs(limit=0, kind=None)}
    assert cli("validate", str(good)).returncode == 0
    # The load is a check run: recorded, marked, and never listed as a real success.
    new = [r for r in Store().list_runs(limit=0, kind=None) if r["run_id"] not in before]
    assert [r["kind"] for r in new] == ["check"], new
    listed = json.loads(cli("runs", "list", "--limit", "0", "--json").stdout)
    assert new[0]["run_id"] not in {r["run_id"] for r in listed}


def test_a_batch_on_a_payload_that_cannot_load_starts_no_task(
    tmp_path: Path, agent_image: str
) -> None:
    folder = broken(tmp_path, function="no_such_function")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"task": f"t{i}"}) + "\n" for i in range(20)))
    before = {r["run_id"] for r in Store().list_runs(limit=0, kind=None)}
    out = cli("batch", str(folder), str(tasks), "-o", str(tmp_path / "out"), "-q")
    assert out.returncode == 2, out.stderr
    assert "cannot load" in out.stderr and "no_such_function" in out.stderr
    assert not (tmp_path / "out" / "results.jsonl").exists()
    new = [r for r in Store().list_runs(limit=0, kind=None) if r["run_id"] not in before]
    assert len(new) == 1 and new[0]["batch"] is None, new  # the one check, no task
    assert new[0]["kind"] == "check" and f"check run {new[0]['run_id']}" in out.stderr


def test_mock_scripts_their_agents_cannot_parse_are_named(tmp_path: Path, agent_image: str) -> None:
    """A run would fail at these outputs with "mock script ... is exhausted"; validate names
    the agent and the output instead."""
    no_code = '["Thought: I answer at once: 42."]'
    no_json = '["Action: {\\"name\\": \\"final_answer\\", \\"arguments\\": "]'
    folder = broken(tmp_path, scripts=f"manager = {no_code}\nhelper = {no_json}")
    checked = cli("validate", str(folder), "--json")
    assert checked.returncode == 2, checked.stderr
    problems = json.loads(checked.stdout)["problems"]
    assert any(
        "agent 'manager', output 1 of 1: no code block" in p and "<code>" in p for p in problems
    ), problems
    assert any(
        "agent 'helper', output 1 of 1: no tool call" in p and "Action:" in p for p in problems
    ), problems


def test_a_requirement_not_on_the_index_is_bad_input(tmp_path: Path, agent_image: str) -> None:
    """Not an infrastructure fault to retry: exit 2, naming the field, the requirement and
    what to do, in `validate` and `run` alike (pip finds no such package: nothing builds)."""
    folder = broken(tmp_path)
    manifest = folder / "manifest.toml"
    manifest.write_text(
        manifest.read_text().replace(
            "[mock.scripts]",
            '[python]\nrequirements = ["tabulatr-nonexistent==9.9"]\n\n[mock.scripts]',
        )
    )
    checked = cli("validate", str(folder))
    assert checked.returncode == 2, checked.stderr
    for words in ("python.requirements", "tabulatr-nonexistent==9.9", "pip index versions"):
        assert words in checked.stderr, checked.stderr
    ran = cli("run", str(folder), "--json", "--quiet")
    assert ran.returncode == 2, ran.stderr
    error = json.loads(ran.stdout)["error"]
    assert error["type"] == "payload_error" and error["field"] == "python.requirements", error


def test_every_problem_validate_reports_exits_2(tmp_path: Path, agent_image: str) -> None:
    """A manifest that grants `os` is reported by the manifest check, then
    the tree is loaded all the same (to report the rest); before, that load's exit 0 hid the
    problem (`orchestrator: problem: ... os ...`, exit 0) while `--no-load` and `run` exit 2.
    A problem is never exit 0, whichever check found it, text or JSON."""
    folder = broken(tmp_path)
    manifest = folder / "manifest.toml"
    manifest.write_text(manifest.read_text() + '\n[python]\nauthorized_imports = ["os"]\n')
    for extra in ((), ("--no-load",), ("--json",)):
        checked = cli("validate", str(folder), *extra)
        assert checked.returncode == 2, (extra, checked.returncode, checked.stderr)
        said = checked.stdout if extra == ("--json",) else checked.stderr
        assert "os" in said and "--i-understand-dangerous-imports" in said, said
    report = json.loads(cli("validate", str(folder), "--json").stdout)
    assert not report["ok"] and report.get("check_run"), report  # the tree was loaded too
    ran = cli("run", str(folder), "--quiet")
    assert ran.returncode == 2, ran.stderr
