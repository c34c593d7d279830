# /// script
# dependencies = ["smolagents[mcp]"]
# ///
"""A program whose tools come from an MCP server shipped beside it (server.py), started over
stdio with this sandbox's own Python, as smolagents' MCP guide starts one."""

import sys

from mcp import StdioServerParameters
from smolagents import InferenceClientModel, ToolCallingAgent, ToolCollection

almanac = StdioServerParameters(command=sys.executable, args=["server.py"])

with ToolCollection.from_mcp(almanac, trust_remote_code=True) as tools:
    agent = ToolCallingAgent(tools=[*tools.tools], model=InferenceClientModel(), name="librarian")
    print(agent.run("Who wrote Dune, and when?"))
