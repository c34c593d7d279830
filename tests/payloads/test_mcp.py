"""MCP tools in a program: `smolagents[mcp]` in its PEP 723 block, its tools from a FastMCP
server beside it (tests/programs/mcp_tools/server.py) started over stdio with the sandbox's
own Python, their calls in the run record; and a server the sandbox cannot start (`npx`,
`uvx`: orchestrator/payloads/servers.py) refused on the host before anything exists."""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path
from typing import Any

import pytest

from orchestrator.payloads.servers import server_starts
from tests.conftest import REPO, cli
from tests.model_server import ScriptedModelServer
from tests.payloads.test_program import events_in

MCP_TOOLS = REPO / "tests" / "programs" / "mcp_tools"
#: What the almanac server's tool answers for Dune (its pid: the process that answered).
FACTS = re.compile(r"Dune was written by Frank Herbert in 1965 \(almanac pid (\d+)\)")


def almanac_answer(body: dict[str, Any]) -> str:
    """A model that calls the MCP tool, then answers with what the tool said (so the answer
    can only come from the server's process, never from this script)."""
    said = FACTS.search(json.dumps(body["messages"]))
    if said is None:
        return 'Action: {"name": "book_facts", "arguments": {"title": "Dune"}}'
    return "Action: " + json.dumps({"name": "final_answer", "arguments": {"answer": said[0]}})


@pytest.mark.docker
def test_a_programs_mcp_server_beside_it_serves_its_tools_in_the_sandbox() -> None:
    token = f"hf_{secrets.token_hex(16)}"
    with ScriptedModelServer([], answer=almanac_answer) as server:
        result = cli(
            "run",
            "--api-base",
            server.api_base(),
            "--json",
            str(MCP_TOOLS),
            env={"HF_TOKEN": token},
            timeout=900,  # the first run builds the derived image (mcp, mcpadapt)
        )
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout)
    assert outcome["status"] == "succeeded", outcome
    assert FACTS.fullmatch(outcome["answer"]), outcome["answer"]
    # The model was offered the server's tool (listed over stdio) and called it.
    assert len(server.requests) == 2
    assert "book_facts" in json.dumps(server.requests[0]["body"]["messages"])
    steps = [e for e in events_in(outcome["record_dir"]) if e["type"] == "step"]
    assert [s["agent"] for s in steps] == ["librarian", "librarian"]
    (call,) = steps[0]["tool_calls"]
    assert (call["name"], call["arguments"]) == ("book_facts", {"title": "Dune"})
    assert FACTS.search(steps[0]["observations"]), steps[0]
    assert steps[1]["tool_calls"][0]["name"] == "final_answer" and steps[1]["is_final_answer"]


def test_a_server_started_with_npx_or_uvx_is_refused_with_what_works(tmp_path: Path) -> None:
    folder = tmp_path / "weather"
    folder.mkdir()
    (folder / "main.py").write_text(
        "import sys\n"
        "from mcp import StdioServerParameters\n"
        "from smolagents import ToolCollection\n\n"
        'node = StdioServerParameters(command="npx", args=["-y", "@acme/weather-mcp"])\n'
        'ours = StdioServerParameters(command=sys.executable, args=["server.py"])\n'
    )
    (folder / "tools.py").write_text(
        "import mcp\n"
        'time = mcp.StdioServerParameters(args=["mcp-server-time"], command="/usr/bin/uvx")\n'
    )
    result = cli("run", str(folder))
    assert result.returncode == 2, result.stderr
    error = result.stderr
    assert error.startswith("orchestrator: error: The program starts an MCP server"), error
    assert f"{folder}/main.py:5: `npx` (the image has no Node.js)" in error
    assert f"{folder}/tools.py:2: `/usr/bin/uvx` (the image has no uv)" in error
    assert 'StdioServerParameters(command=sys.executable, args=["server.py"])' in error
    assert 'args=["-m", "<its module>"]' in error and "`dependencies`" in error
    assert "run " not in error.split("error:")[0]  # no run was started
    listed = cli("validate", "--no-load", "--json", str(folder))
    assert listed.returncode == 2 and "`npx`" in json.loads(listed.stdout)["problems"][0]


def test_only_a_literal_command_the_sandbox_lacks_is_refused() -> None:
    """The program's own server (sys.executable) passes; a command the source does not spell
    out is the run's to find out."""
    files = {
        "main.py": "StdioServerParameters(command=sys.executable, args=['server.py'])\n"
        "StdioServerParameters(command=COMMAND)\n"
        "StdioServerParameters(command='python3', args=['-m', 'weather'])\n",
        "broken.py": "StdioServerParameters(command='npx'\n",
    }
    assert [(s.line, s.command) for s in server_starts(files)] == [(3, "python3")]
    ours = cli("validate", "--no-load", str(MCP_TOOLS), env={"HF_TOKEN": "hf_placeholder"})
    assert ours.returncode == 0, ours.stderr
