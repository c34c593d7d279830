"""orchestrator: run whole smolagents multi-agent programs in hardened sandboxes.

from orchestrator import RunSpec, run
result = run(RunSpec(payload="agent_payloads/research_team", model="mock"))
print(result.status, result.answer)
"""

from .config import VERSION as __version__
from .errors import ConfigError, EngineUnavailable, ManifestError, OrchestratorError
from .manifest import Manifest, load_manifest
from .runner import run
from .spec import Limits, RunResult, RunSpec
from .store import Store

__all__ = [
    "ConfigError",
    "EngineUnavailable",
    "Limits",
    "Manifest",
    "ManifestError",
    "OrchestratorError",
    "RunResult",
    "RunSpec",
    "Store",
    "__version__",
    "load_manifest",
    "run",
]
