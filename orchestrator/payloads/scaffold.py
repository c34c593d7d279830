"""`orchestrator new NAME`: a payload that runs as generated, to start from.

It has the parts every payload has: a manager `CodeAgent`, one managed `ToolCallingAgent`,
one tool, and a mock script for each agent in its own format (a code block for the
CodeAgent, `Action: {json}` tool calls for the ToolCallingAgent), so `orchestrator run NAME`
succeeds offline before the user changes anything.
"""

from __future__ import annotations

import re
from pathlib import Path
from textwrap import indent

from ..errors import ConfigError

#: What `payload.name` accepts (manifest.py), so the folder name can be the payload name.
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")

MANIFEST = '''\
[payload]
name = "{name}"
description = "A manager CodeAgent that asks a researcher (a ToolCallingAgent) for facts."
entrypoint = "agents:build_manager"
example_task = "At how many degrees Celsius does water boil at sea level?"
example_answer = "100"

[python]
requirements = []                     # extra pip requirements: a derived, cached image
authorized_imports = []               # modules the manager's code may import

[secrets]
required = []                         # names only; values come from the environment or .env

[network]
hosts = []                            # hosts reachable under --network allowlist

[limits]
max_steps = 6
timeout_seconds = 120
memory_mb = 512

# What `--model mock` (the default) answers, per agent, in order. A CodeAgent answers a
# thought and a <code> block; a ToolCallingAgent answers one tool call as JSON after
# "Action:". The last output of each calls final_answer.
[mock.scripts]
manager = [
"""Thought: The researcher can look facts up. I will ask it.
<code>
note = researcher(task="Look up the boiling point of water at sea level.")
print(note)
</code>""",
"""Thought: The researcher's note gives the figure in Celsius.
<code>
final_answer("100")
</code>""",
]
researcher = [
"""Action: {{"name": "lookup_fact", "arguments": {{"topic": "water"}}}}""",
"""Action: {{"name": "final_answer", "arguments": {{"answer": "Water boils at 100 °C."}}}}""",
]
'''

#: The researcher's one tool, in both templates (`{tool}`).
TOOL = '''\
FACTS = {
    "water": "Water boils at 100 degrees Celsius at sea level and freezes at 0.",
    "light": "Light travels about 299,792 km per second in a vacuum.",
}


@tool
def lookup_fact(topic: str) -> str:
    """Looks a topic up in a small table of facts.

    Args:
        topic: One word naming the topic, e.g. "water" or "light".
    """
    return FACTS.get(topic.strip().lower(), f"no fact about {topic!r}; topics: {sorted(FACTS)}")
'''

#: The researcher agent, in both templates (`{researcher}`, indented to its place).
RESEARCHER = """\
researcher = ToolCallingAgent(
    tools=[lookup_fact],
    model=model,
    name="researcher",
    description="Looks facts up. Give it a question; it answers from its table of facts.",
    max_steps=4,
)
"""

AGENTS = '''\
"""{name}: a manager CodeAgent and a researcher ToolCallingAgent with one tool.

The runtime imports this module inside the sandbox and calls `build_manager(model)`; the
model is the one the run asked for (`--model`), or the scripted mock of manifest.toml.
"""

from __future__ import annotations

from smolagents import CodeAgent, ToolCallingAgent, tool

{tool}

def build_manager(model) -> CodeAgent:
    """The entrypoint: build the agents with the given model and return the manager."""
{researcher}    return CodeAgent(tools=[], model=model, managed_agents=[researcher], max_steps=6)
'''


PROGRAM = '''\
# /// script
# requires-python = ">=3.10"
# dependencies = ["smolagents"]
#
# [tool.orchestrator.payload]
# description = "A manager CodeAgent that asks a researcher (a ToolCallingAgent) for facts."
# model = "mock"  # plays the scripts below; --model program runs the models built here
#
# [tool.orchestrator.limits]
# timeout_seconds = 120
#
# # What the mock model answers, per agent, in order. A CodeAgent answers a thought and a
# # <code> block; a ToolCallingAgent one tool call as JSON after "Action:".
# [tool.orchestrator.mock.scripts]
# manager = [
#   """Thought: The researcher can look facts up. I will ask it.
# <code>
# note = researcher(task="Look up the boiling point of water at sea level.")
# print(note)
# </code>""",
#   """Thought: The researcher's note gives the figure in Celsius.
# <code>
# final_answer("100")
# </code>""",
# ]
# researcher = [
#   'Action: {{"name": "lookup_fact", "arguments": {{"topic": "water"}}}}',
#   'Action: {{"name": "final_answer", "arguments": {{"answer": "Water boils at 100 °C."}}}}',
# ]
# ///
"""{name}: a smolagents program, run as written by `orchestrator run {name}.py`.

Its models keep their class and model id, and reach their endpoint only through the run's
model gateway: the key (HF_TOKEN here) stays on the host, the sandbox holds a run token.
"""

import os

from smolagents import CodeAgent, InferenceClientModel, ToolCallingAgent, tool

{tool}

model = InferenceClientModel(token=os.getenv("HF_TOKEN"))
{researcher}manager = CodeAgent(tools=[], model=model, managed_agents=[researcher], max_steps=6)
print(manager.run("At how many degrees Celsius does water boil at sea level?"))
'''


def scaffold_program(name: str, parent: str | Path = ".") -> Path:
    """Write the program `parent/name.py`; refuses a bad name or an existing path."""
    if not NAME_RE.match(name):
        raise ConfigError(
            f"{name!r} is not a program name.",
            "Use lowercase letters, digits, _ and - (starting with a letter or digit).",
        )
    path = Path(parent) / f"{name}.py"
    if path.exists():
        raise ConfigError(f"{path} already exists.", "Choose another name or folder.")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(PROGRAM.format(name=name, tool=TOOL, researcher=RESEARCHER), encoding="utf-8")
    return path


def scaffold(name: str, parent: str | Path = ".") -> Path:
    """Write the payload folder `parent/name`; refuses a bad name or an existing path."""
    if not NAME_RE.match(name):
        raise ConfigError(
            f"{name!r} is not a payload name.",
            "Use lowercase letters, digits, _ and - (starting with a letter or digit).",
        )
    folder = Path(parent) / name
    if folder.exists():
        raise ConfigError(f"{folder} already exists.", "Choose another name or folder.")
    folder.mkdir(parents=True)
    (folder / "manifest.toml").write_text(MANIFEST.format(name=name), encoding="utf-8")
    (folder / "agents.py").write_text(
        AGENTS.format(name=name, tool=TOOL, researcher=indent(RESEARCHER, "    ")), encoding="utf-8"
    )
    return folder
