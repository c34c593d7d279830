"""The conformance kit as pytest tests: a backend package points it at itself.

Either in its own test file (the kit's checks become that module's tests):

    from orchestrator.testing.plugin import conformance_tests
    test_conformance = conformance_tests("mycloud")

or from the command line, with nothing written:

    pytest -p orchestrator.testing.plugin --backend-under-test mycloud

Each check is one test, named after it; a check the backend's `Capabilities` declare absent
is skipped with the capability it lacks, and a broken promise fails with what was seen and
the fix. The kit's runs are recorded in the current store (`ORCHESTRATOR_HOME`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from .checks import CHECKS
from .kit import Check, Kit, run_check

#: The test module `--backend-under-test` adds to the session.
SUITE = Path(__file__).with_name("suite.py")
_KITS = pytest.StashKey[dict[tuple[str, str | None], Kit]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("orchestrator conformance")
    group.addoption(
        "--backend-under-test",
        metavar="NAME",
        help="run orchestrator's conformance checks against this registered backend",
    )
    group.addoption(
        "--sandbox-runtime-under-test",
        metavar="RUNTIME",
        help="the sandbox runtime the kit's runs ask for (default: the machine's)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_KITS] = {}
    if config.getoption("backend_under_test", None):
        # Alone unless paths were named: pytest drops a path that lies under another one it
        # collects (and would collect the caller's whole folder besides).
        named = config.args_source == pytest.Config.ArgsSource.ARGS
        config.args[:] = [*config.args, str(SUITE)] if named else [str(SUITE)]


def kit_for(config: pytest.Config, backend: str, runtime: str | None) -> Kit:
    """One kit per backend and runtime for the session (runs shared by its checks), closed
    when the session ends."""
    kits = config.stash.setdefault(_KITS, {})
    if (backend, runtime) not in kits:
        kit = kits[(backend, runtime)] = Kit(backend, runtime=runtime)
        config.add_cleanup(kit.close)  # also where this module is imported, not a plugin
    return kits[(backend, runtime)]


def conformance_tests(
    backend: str | None = None, *, runtime: str | None = None
) -> Callable[..., None]:
    """A test function parametrized over the kit's checks, for `backend` (None: the one
    `--backend-under-test` names) with runs asking for `runtime`."""

    @pytest.mark.parametrize("check", CHECKS, ids=[c.name for c in CHECKS])
    def test_conformance(check: Check, request: pytest.FixtureRequest) -> None:
        config = request.config
        name = backend or config.getoption("backend_under_test")
        if not name:
            pytest.skip("no backend under test (--backend-under-test NAME)")
        wanted = runtime or config.getoption("sandbox_runtime_under_test", None)
        outcome = run_check(kit_for(config, name, wanted), check)
        if outcome.status == "not_applicable":
            pytest.skip(f"{check.name} not applicable: {outcome.detail}")
        if outcome.status == "fail":
            fix = f" Fix: {outcome.fix}" if outcome.fix else ""
            pytest.fail(f"{check.name} ({check.promise}): {outcome.detail}.{fix}", pytrace=False)

    return test_conformance
