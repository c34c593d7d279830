"""Test payload: agents built with `stream_outputs=True`, so every model call is a streamed
(server-sent events) response (tests/test_gateway.py)."""

from smolagents import CodeAgent


def build_manager(model) -> CodeAgent:
    helper = CodeAgent(
        tools=[],
        model=model,
        name="helper",
        description="Answers a question.",
        stream_outputs=True,
        max_steps=2,
    )
    return CodeAgent(
        tools=[], model=model, managed_agents=[helper], stream_outputs=True, max_steps=3
    )
