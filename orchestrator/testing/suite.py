"""The kit's checks as one test module, for `pytest -p orchestrator.testing.plugin
--backend-under-test NAME` (the plugin adds this file to the session)."""

from __future__ import annotations

from .plugin import conformance_tests

test_conformance = conformance_tests()
