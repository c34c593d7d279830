"""Hashes every environment value of every process it can read in its sandbox (its own and
every /proc/PID/environ) and prints the SHA-256 of each, never a value."""

import hashlib
import os
from pathlib import Path

from smolagents import CodeAgent, InferenceClientModel

values = set(os.environ.values())
for entry in Path("/proc").iterdir():
    if entry.name.isdigit():
        try:
            raw = (entry / "environ").read_bytes()
        except OSError:
            continue
        for item in raw.split(b"\0"):
            name, _, value = item.partition(b"=")
            if name:
                values.add(value.decode(errors="replace"))
for value in sorted(values):
    print("env-sha256", hashlib.sha256(value.encode()).hexdigest())
agent = CodeAgent(tools=[], model=InferenceClientModel(token=os.getenv("HF_TOKEN")))
agent.run("Say done.")
