"""A CodeAgent with a tool that misbehaves as asked (tools are trusted payload code, so
only the container's limits stand in their way)."""

from __future__ import annotations

import os
import time

from smolagents import CodeAgent, tool


@tool
def misbehave(mode: str) -> str:
    """Misbehave on purpose.

    Args:
        mode: "sleep" (sleep for a minute), "memory" (allocate until killed), "forkbomb"
            (fork until the process limit stops it), or "ok" (do nothing).
    """
    if mode == "sleep":
        time.sleep(60)
        return "slept"
    if mode == "memory":
        hoard = []
        while True:
            hoard.append(b"\x01" * (16 * 2**20))  # filled, so the pages are really used
    if mode == "forkbomb":
        children = 0
        while True:
            try:
                pid = os.fork()
            except OSError:
                return f"fork refused after {children} children"
            if pid == 0:  # a child keeps forking forever and never returns to the agent
                while True:
                    try:
                        os.fork()
                    except OSError:
                        time.sleep(0.2)
            children += 1
    return "ok"


def build(model):
    return CodeAgent(tools=[misbehave], model=model, max_steps=3)
