"""What a run leaves behind: its record as it happens (`record.py`: masked events and logs,
`result.json`), the store of records (`store.py`: SQLite index and run folders), what a user
types to name one (`handles.py`), its trace (`spans.py` checks the sandbox's spans,
`traces.py` keeps the trace, `otlp.py` exports it) and removing old ones (`housekeeping.py`).

Imports the core modules directly in `orchestrator/` only: never a backend, never the life
of a run (`lifecycle`), which writes into it.
"""
