"""Test payload: a lone CodeAgent whose scripted code tries forbidden imports."""

from smolagents import CodeAgent


def build_manager(model) -> CodeAgent:
    # Its code imports os and subprocess anyway: the inner executor refuses them. (An agent
    # that declared `os` itself would be refused before its first step, as `validate` says.)
    return CodeAgent(tools=[], model=model, additional_authorized_imports=["json"])
