"""A conformance kit for sandbox backends: the promises every backend keeps, as one list of
named checks (`checks.CHECKS`), each a real run through the public API. A backend package
runs it with pytest (`plugin.py`); `orchestrator doctor` runs it against the user's host."""

from typing import Any

from .checks import CHECKS
from .kit import Check, CheckFailed, CheckOutcome, Kit, NotApplicable, open_kit, run_check

__all__ = [
    "CHECKS",
    "Check",
    "CheckFailed",
    "CheckOutcome",
    "Kit",
    "NotApplicable",
    "open_kit",
    "run_check",
]


def __getattr__(name: str) -> Any:
    """`Outcome`, this package's old name of `CheckOutcome` (renamed: a run's `Outcome` is
    `lifecycle.outcome`'s), still found, with a DeprecationWarning."""
    if name == "Outcome":
        import warnings

        warnings.warn(
            "orchestrator.testing.Outcome is now CheckOutcome",
            DeprecationWarning,
            stacklevel=2,
        )
        return CheckOutcome
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
