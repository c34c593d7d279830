"""What every runsc-direct test needs: runsc and root (else it skips), and a look at what
this path leaves behind."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from orchestrator.backends.docker.runsc_direct import cgroup, records
from orchestrator.backends.docker.runsc_direct.binary import state_root


@pytest.fixture(scope="module")
def runsc_here() -> None:
    if shutil.which("runsc") is None:
        pytest.skip("no runsc on PATH (setup-gvisor.sh)")
    if os.geteuid() != 0:
        pytest.skip("runsc-direct makes each sandbox's cgroup: root only")


def nothing_of_ours_left() -> list[str]:
    """This path's sandbox records, cgroups and runsc container states still there."""
    left = [f"record {r.id}" for r in records.list_records({})]
    # this store's only: another test session on the host has cgroups of its own
    left += [f"cgroup {name}" for name in cgroup.leftovers() if records.of_this_store(name)]
    left += [f"runsc state {p.name}" for p in state_root().iterdir()]
    return left


@pytest.fixture
def leaves_nothing(runsc_here: None, no_leftovers) -> Iterator[None]:
    yield
    assert not nothing_of_ours_left()
