"""Attempts on a cluster's nodes (Ray): `RayExecutor`, given to a batch or `schedule serve`
(`--ray`), with one worker per node that declares `orchestrator_sandboxes`. Ray is an
optional extra (`pip install 'orchestrator[ray]'`), imported only when used."""

from .connect import RESOURCE, disconnect, import_ray
from .executor import RayExecutor

__all__ = ["RESOURCE", "RayExecutor", "disconnect", "import_ray"]
