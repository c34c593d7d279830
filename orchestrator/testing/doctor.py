"""`orchestrator doctor`'s work: the host's configuration as the backend checks it
(`Backend.host_checks`, no run) and the kit's checks (`checks.CHECKS`) against the backend
and host a user actually has.

The runs go into a private, temporary state directory (the user's configuration file and
wheelhouse kept), so that the doctor's runs neither show up among the user's runs nor touch
the leftovers of the user's own dead runs; it is removed afterwards, and the kit removes every
sandbox it made. What it proves: that this configuration keeps the promises the checks name.
What it cannot: it is not a penetration test; a check passing says the configured barrier is
there, not that it has no hole.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..backends import backend_class
from ..backends.base import HostCheck, HostProblem
from ..defaults import CONFIG_ENV, config_path
from ..images.wheelhouse import WHEELHOUSE_ENV, wheelhouse_root
from ..paths import home_dir
from .checks import CHECKS
from .kit import CheckOutcome, Kit, run_check


def check_names(backend: str) -> tuple[str, ...]:
    """Every check's name for `backend`, its host checks first (they cost nothing), in the
    order they run (read from its class: nothing is made)."""
    host = tuple(c.name for c in backend_class(backend).host_checks)
    return host + tuple(c.name for c in CHECKS)


@contextlib.contextmanager
def private_home() -> Iterator[Path]:
    """A temporary state directory for the doctor's runs, keeping the user's configuration
    file and wheelhouse (so that its runs are configured, and built, as the user's are)."""
    keep = {WHEELHOUSE_ENV: str(wheelhouse_root())}
    if config_path().is_file():
        keep[CONFIG_ENV] = str(config_path())
    saved = {k: os.environ.get(k) for k in ("ORCHESTRATOR_HOME", *keep)}
    folder = Path(tempfile.mkdtemp(prefix="orchestrator-doctor-"))
    os.environ.update({"ORCHESTRATOR_HOME": str(folder), **keep})
    try:
        yield home_dir()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(folder, ignore_errors=True)


def host_outcome(check: HostCheck, facts: dict[str, Any]) -> CheckOutcome:
    started = time.monotonic()
    try:
        detail = check.function(facts)
    except HostProblem as exc:
        took = time.monotonic() - started
        return CheckOutcome(check.name, "fail", check.promise, exc.detail, exc.fix, took)
    return CheckOutcome(check.name, "pass", check.promise, detail, None, time.monotonic() - started)


@dataclass
class Report:
    """What the doctor found, and the runs it made (all of them removed again)."""

    outcomes: list[CheckOutcome] = field(default_factory=list)
    run_ids: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when every applicable check passed."""
        return all(o.status != "fail" for o in self.outcomes)


def doctor(
    backend: str,
    *,
    runtime: str | None = None,
    only: Collection[str] = (),
    facts: dict[str, Any] | None = None,
    on_outcome: Callable[[CheckOutcome], None] | None = None,
) -> Report:
    """Every check (or those named in `only`) against `backend` on this host, each reported
    to `on_outcome` as it ends. `facts`: what the backend's host checks judge, instead of
    what it says live (`Backend.host_facts`; a test's double). Raises OrchestratorError
    when the backend cannot be made (its engine unreachable, say), and the engine's errors
    when it cannot describe itself."""
    found = Report()
    outcomes = found.outcomes

    def report(outcome: CheckOutcome) -> None:
        outcomes.append(outcome)
        if on_outcome is not None:
            on_outcome(outcome)

    def wanted(name: str) -> bool:
        return not only or name in only

    with private_home():
        kit = Kit(backend, runtime=runtime)
        try:
            host_checks = kit.backend.host_checks
            if any(wanted(c.name) for c in host_checks):
                facts = facts if facts is not None else kit.backend.host_facts()
                for host_check in host_checks:
                    if wanted(host_check.name):
                        report(host_outcome(host_check, facts))
            for check in CHECKS:
                if wanted(check.name):
                    report(run_check(kit, check))
        finally:
            kit.close()
            found.run_ids = list(kit.run_ids)
    return found
