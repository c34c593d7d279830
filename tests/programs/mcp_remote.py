# /// script
# dependencies = ["smolagents[mcp]"]
#
# [tool.orchestrator.network]
# hosts = ["almanac.example.com"]
# [tool.orchestrator.secrets]
# required = ["MCP_TOKEN"]
# [tool.orchestrator.secrets.bind]
# MCP_TOKEN = { hosts = ["almanac.example.com"] }
# ///
"""A program whose tools come from a remote MCP server, over streamable HTTP (or SSE: its
first argument), as smolagents' MCP guide connects to one; its bearer token is bound to the
server's host, so this sandbox holds only a placeholder, and the run's interceptor puts the
value on the wire to almanac.example.com alone."""

import hashlib
import os
import sys

from smolagents import InferenceClientModel, ToolCallingAgent, ToolCollection

transport = sys.argv[1] if len(sys.argv) > 1 else "streamable-http"
token = os.environ["MCP_TOKEN"]
# What this sandbox holds: the placeholder (a value would print masked, its hash as is).
print("MCP_TOKEN", token, "sha256", hashlib.sha256(token.encode()).hexdigest())

almanac = {
    "url": "https://almanac.example.com/" + ("sse" if transport == "sse" else "mcp"),
    "transport": transport,
    "headers": {"Authorization": f"Bearer {token}"},
}
with ToolCollection.from_mcp(almanac, trust_remote_code=True) as tools:
    agent = ToolCallingAgent(tools=[*tools.tools], model=InferenceClientModel(), name="librarian")
    print(agent.run("Who wrote Dune, and when?"))
