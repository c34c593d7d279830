"""What an agent image is made of, backend-neutral: its definition and content hash
(`imagedef.py`) and the wheels for its interpreter, resolved on the host so that builds need
no index (`wheelhouse.py`). The backends build their images and templates from these.

Imports only the core modules directly in `orchestrator/`.
"""
