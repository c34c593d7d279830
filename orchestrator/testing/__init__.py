"""A conformance kit for sandbox backends: the promises every backend keeps, as one list of
named checks (`checks.CHECKS`), each a real run through the public API. A backend package
runs it with pytest (`plugin.py`); `orchestrator doctor` runs it against the user's host."""

from .checks import CHECKS
from .kit import Check, CheckFailed, Kit, NotApplicable, Outcome, open_kit, run_check

__all__ = [
    "CHECKS",
    "Check",
    "CheckFailed",
    "Kit",
    "NotApplicable",
    "Outcome",
    "open_kit",
    "run_check",
]
