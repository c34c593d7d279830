"""In-sandbox runtime: `python -m orchestrator_runtime` runs one whole smolagents program.

It reads one JSON request on stdin and writes JSON events on stdout, as docs/PROTOCOL.md says.
It imports nothing from the host package `orchestrator`: only the standard library and
smolagents, so the same files run in a Docker container, an E2B sandbox or a local process.
This module stays import-free so that a bad request is refused before smolagents is imported.
`protocol.py` and `masking.py` hold what the host shares with it (the host imports them).
"""
