"""What a user gives us, read and checked on the host before anything starts: a payload
folder (`shipped.py`), its `manifest.toml` (`manifest.py`), a program as written
(`program.py`), the secrets a run of it gets (`secrets.py`) and those bound to hosts
(`binding.py`), the shipped examples (`examples.py`) and new ones (`scaffold.py`). Read from
a payload's source: its agents' names (`agentnames.py`), the models a program makes
(`program_models.py`), the MCP servers it starts (`servers.py`); `pysource.py` parses it,
`upstreams.py` says where a LiteLLM model's own client sends its calls.

Nothing here runs a payload's code: programs are read with `ast`. Imports only the core
modules directly in `orchestrator/` (spec, schema, errors, paths, defaults, policy, registry)
and `orchestrator/models/`.
"""
