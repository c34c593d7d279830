"""Test payload: stray output from Python, from fd 1 directly and from a child process."""

import os
import subprocess
import sys

from smolagents import CodeAgent, tool

print("NOISE import-time print")


@tool
def make_noise() -> str:
    """Writes noise to standard output in several ways and returns 'done'."""
    print("NOISE print from a tool")
    sys.stdout.write("NOISE sys.stdout.write\n")
    os.write(1, b"NOISE os.write to fd 1\n")
    subprocess.run([sys.executable, "-c", "print('NOISE child process')"], check=True)
    return "done"


def build_manager(model) -> CodeAgent:
    return CodeAgent(tools=[make_noise], model=model)
