"""orchestrator: run whole smolagents multi-agent programs in hardened sandboxes.

from orchestrator import RunSpec, evaluate, run
result = run(RunSpec(payload="agent_payloads/research_team", model="mock"))
print(result.status, result.answer)
summary = evaluate("agent_payloads/research_team", "tasks.jsonl", model="mock")
print(summary.accuracy, summary.counts)

The names below are imported on first use, so that `orchestrator.cli` can install its signal
handlers before the rest of the package loads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .paths import VERSION as __version__

if TYPE_CHECKING:
    from .batch.evaluate import evaluate
    from .batch.plan import BatchSummary
    from .errors import ConfigError, EngineUnavailable, ManifestError, OrchestratorError
    from .execution.pool import Pool
    from .lifecycle.runner import run
    from .payloads.manifest import Manifest, load_manifest
    from .records.store import Store
    from .spec import Limits, RunError, RunResult, RunSpec

#: Public name -> the module that defines it.
_EXPORTS = {
    "BatchSummary": "batch.plan",
    "evaluate": "batch.evaluate",
    "ConfigError": "errors",
    "EngineUnavailable": "errors",
    "ManifestError": "errors",
    "OrchestratorError": "errors",
    "Manifest": "payloads.manifest",
    "load_manifest": "payloads.manifest",
    "Pool": "execution.pool",
    "run": "lifecycle.runner",
    "Limits": "spec",
    "RunError": "spec",
    "RunResult": "spec",
    "RunSpec": "spec",
    "Store": "records.store",
}

__all__ = [
    "BatchSummary",
    "ConfigError",
    "EngineUnavailable",
    "Limits",
    "Manifest",
    "ManifestError",
    "OrchestratorError",
    "Pool",
    "RunError",
    "RunResult",
    "RunSpec",
    "Store",
    "__version__",
    "evaluate",
    "load_manifest",
    "run",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
