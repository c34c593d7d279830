"""Test payload: a tool that sleeps, for timeout, kill and concurrency tests."""

import time

from smolagents import CodeAgent, tool


@tool
def sleep_for(seconds: float) -> str:
    """Sleeps for a while.

    Args:
        seconds: How long to sleep, in seconds.
    """
    time.sleep(float(seconds))
    return f"slept {seconds} s"


def build_manager(model) -> CodeAgent:
    return CodeAgent(tools=[sleep_for], model=model)
