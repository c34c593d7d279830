"""One CodeAgent without tools: the scripted model's code does the arithmetic."""

from __future__ import annotations

from smolagents import CodeAgent


def build(model):
    return CodeAgent(tools=[], model=model, max_steps=3)
