"""What a user gives us, read and checked on the host before anything starts: a payload
folder (`shipped.py`), its `manifest.toml` (`manifest.py`), a program as written
(`program.py`), the secrets a run of it gets (`secrets.py`), the shipped examples
(`examples.py`) and new ones (`scaffold.py`).

Nothing here runs a payload's code: programs are read with `ast`. Imports only the core
modules directly in `orchestrator/` (spec, schema, errors, paths, defaults, policy, registry)
and `orchestrator/models/`.
"""
