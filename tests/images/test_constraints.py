"""The derived images' constraints (images/agent/constraints.txt): which are in force for a
payload's requirements, and what the build says. The real resolution and build with them:
tests/backends/docker/test_images.py."""

from __future__ import annotations

from pathlib import Path

from orchestrator.images.constraints import (
    Constraint,
    applicable,
    constraints_text,
    read_constraints,
    report_applied,
)

MCP = Constraint("mcp<2", "mcp", "why")


def test_the_shipped_file_bounds_mcp_and_says_why() -> None:
    (mcp,) = [c for c in read_constraints() if c.project == "mcp"]
    assert mcp.line == "mcp<2"
    assert "mcpadapt" in mcp.why and "streamablehttp_client" in mcp.why


def test_each_constraint_has_the_comment_above_it(tmp_path: Path) -> None:
    path = tmp_path / "constraints.txt"
    path.write_text("# A header.\n\n# Why a.\n# Still a.\nA_Pkg<2\nb>=1\n")
    assert read_constraints(path) == (
        Constraint("A_Pkg<2", "a-pkg", "Why a. Still a."),
        Constraint("b>=1", "b", "no reason"),
    )
    assert read_constraints(tmp_path / "absent.txt") == ()


def test_a_payloads_own_version_wins_over_the_constraint() -> None:
    """A constraint stays for a project named without a version (`mcp`, or pulled in by an
    extra: `smolagents[mcp]==...` pins smolagents, not mcp) and goes for one with a version
    or a direct reference of its own."""
    assert applicable(["smolagents[mcp]==1.26.0", "mcp", "tabulate"], [MCP]) == (MCP,)
    assert applicable(["smolagents[mcp]==1.26.0", "MCP==1.25.0"], [MCP]) == ()
    assert applicable(["mcp>=2"], [MCP]) == ()
    assert applicable(["mcp @ https://example.com/mcp-2.0-py3-none-any.whl"], [MCP]) == ()
    assert constraints_text("smolagents==1.26.0\n", [MCP]) == "smolagents==1.26.0\nmcp<2\n"
    assert constraints_text("smolagents==1.26.0\n", []) == "smolagents==1.26.0\n"


def test_the_build_names_the_constraints_that_bore_on_it() -> None:
    said: list[str] = []
    wheels = ["mcp-1.26.0-py3-none-any.whl", "mcpadapt-0.1.19-py3-none-any.whl"]
    assert report_applied([MCP], wheels, said.append) == said
    assert said == ["constraint mcp<2 applied (images/agent/constraints.txt: why)"]
    assert report_applied([MCP], ["tabulate-0.9.0-py3-none-any.whl"], said.append) == []
