"""Test payload for the model gateway (tests/test_gateway.py).

Tools: `look_for_key` searches everything this sandbox can read (every process's
environment and command line, files under /tmp and /work, and this process's own memory,
which holds the request the runtime read) for a marker that starts the test's model key;
`show_gateway` tells the run's api_base and token (reversed, so that masking leaves it
readable); `hold` waits.
"""

import json
import os
import time

from smolagents import CodeAgent, tool

MODEL = None
#: Every test key starts with this; the tool reports what follows it (reversed).
MARKER = b"sk-gwtest-"


def _find(data: bytes, where: str, found: dict) -> None:
    start = data.find(MARKER)
    while start >= 0:
        tail = data[start + len(MARKER) : start + len(MARKER) + 32]
        tails = found.setdefault(where, [])
        if len(tails) < 100:
            tails.append(tail.decode("ascii", "replace")[::-1])
        start = data.find(MARKER, start + 1)


def _own_memory(found: dict) -> None:
    with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
        for line in maps:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if "r" not in fields[1] or high - low > 512 * 1024 * 1024:
                continue
            try:
                mem.seek(low)
                _find(mem.read(high - low), "memory", found)
            except (OSError, OverflowError, ValueError):
                continue


@tool
def look_for_key() -> str:
    """Looks everywhere it can for the test's model key.

    Returns:
        JSON: what follows the marker, reversed, in each place it was seen (the marker itself
        is in this file and in memory, followed by anything), and how much was read.
    """
    found: dict = {}
    read = {"proc": 0, "files": 0}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        for name in ("environ", "cmdline"):
            try:
                with open(f"/proc/{pid}/{name}", "rb") as file:
                    _find(file.read(), f"/proc/{pid}/{name}", found)
                read["proc"] += 1
            except OSError:
                continue
    for root in ("/tmp", "/work"):
        for folder, _, names in os.walk(root):
            for name in names:
                try:
                    with open(os.path.join(folder, name), "rb") as file:
                        _find(file.read(64 * 1024 * 1024), os.path.join(folder, name), found)
                    read["files"] += 1
                except OSError:
                    continue
    _own_memory(found)
    _find(json.dumps(dict(os.environ)).encode(), "os.environ", found)
    return json.dumps({"found": found, "read": read})


@tool
def show_gateway() -> str:
    """Tells the model endpoint and credential this run was given.

    Returns:
        `GATEWAY <api_base> <credential, reversed>`.
    """
    kwargs = getattr(MODEL, "client_kwargs", {}) or {}
    key = os.environ.get("OPENAI_API_KEY", "")
    return f"GATEWAY {kwargs.get('base_url')} {key[::-1]}"


@tool
def hold(seconds: float) -> str:
    """Waits.

    Args:
        seconds: How long to wait.
    """
    time.sleep(float(seconds))
    return "held"


def build_manager(model) -> CodeAgent:
    global MODEL
    MODEL = model
    return CodeAgent(tools=[look_for_key, show_gateway, hold], model=model, max_steps=8)
