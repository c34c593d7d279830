"""Test payload: a tool that hands the secret to the agent (and prints it to the log)."""

import os

from smolagents import CodeAgent, tool


@tool
def read_secret() -> str:
    """Returns the value of the LEAKY_SECRET secret."""
    value = os.environ["LEAKY_SECRET"]
    print(f"read_secret: {value}")  # goes to stderr; the host masks logs too
    return value


def build_manager(model) -> CodeAgent:
    return CodeAgent(tools=[read_secret], model=model, additional_authorized_imports=["base64"])
