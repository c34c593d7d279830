"""The E2B backend: one E2B sandbox per run, from a template made of the agent image's
definition.

`settings.py` the environment, the SDK and retries, `templates.py` the template,
`sandbox.py` one run's sandbox and the backend (`E2BBackend`, what the registry names),
`idle.py` a pooled (warm) sandbox's runtime, `slots.py` the process's cap on live sandboxes.
Importing this package does not import the `e2b` SDK; making a backend does.
"""

from __future__ import annotations

from .sandbox import E2BBackend, E2BSandbox
from .settings import E2BSettings
from .templates import ensure_template

__all__ = ["E2BBackend", "E2BSandbox", "E2BSettings", "ensure_template"]
