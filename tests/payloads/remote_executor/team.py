"""Test payload: agents that ask for remote executors (never started inside the sandbox)."""

from smolagents import CodeAgent


def build_manager(model) -> CodeAgent:
    helper = CodeAgent(
        tools=[],
        model=model,
        name="helper",
        description="Answers small arithmetic questions.",
        executor_type="e2b",
    )
    return CodeAgent(tools=[], model=model, managed_agents=[helper], executor_type="docker")
