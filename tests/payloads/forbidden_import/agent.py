"""Test payload: a lone CodeAgent whose scripted code tries forbidden imports."""

from smolagents import CodeAgent


def build_manager(model) -> CodeAgent:
    # It even asks for `os`: the runtime replaces the imports with the request's list.
    return CodeAgent(tools=[], model=model, additional_authorized_imports=["os", "json"])
