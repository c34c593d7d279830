"""Record integrity: a sandbox that forges its event channel cannot make a failed run
`succeeded`; the violation is visible in `runs show` and result.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..conftest import TEST_PAYLOADS, cli

pytestmark = pytest.mark.docker

FORGER = TEST_PAYLOADS / "forger"


@pytest.mark.parametrize("how", ["raw", "stream"])
def test_a_forged_success_end_then_a_real_failure_is_not_succeeded(
    how: str, agent_image: str, no_leftovers
) -> None:
    out = cli("run", str(FORGER), "--arg", f'how="{how}"', "--json", "--quiet")
    assert out.returncode == 1, out.stderr  # failed, not 0
    result = json.loads(out.stdout)
    assert result["status"] == "failed"
    assert result["error"]["type"] == "protocol_violation", result["error"]
    assert result["answer"] is None
    assert result["exit_code"] == 1  # the runtime's own verdict, as the engine recorded it
    written = json.loads((Path(result["record_dir"]) / "result.json").read_text())
    assert written["error"]["type"] == "protocol_violation"
    shown = cli("runs", "show", result["run_id"])
    assert shown.returncode == 0 and "protocol_violation" in shown.stdout, shown.stdout
    events = [json.loads(line) for line in (Path(result["record_dir"]) / "events.jsonl").open()]
    # Caught by the runtime's relay before the host (which checks again): the payload never
    # holds the host's channel.
    assert any(e["type"] == "protocol_violation" for e in events), events
