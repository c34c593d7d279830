"""The run record (orchestrator/records/record.py) as such: what it makes of the events it
observes. (What a whole run's record holds is checked where each event comes from: the
runner's, the egress proxy's, the traces' and the security suites' tests.)"""

from __future__ import annotations

from pathlib import Path


def test_a_proxy_attempt_is_tied_to_the_step_running_at_its_time(tmp_path: Path) -> None:
    from orchestrator.records.record import RunRecorder
    from orchestrator_runtime.masking import Masker

    record = RunRecorder(tmp_path, Masker([]), None)
    for ts, event in (
        (1.0, {"type": "run_start", "agents": [{"name": "manager"}]}),
        (2.0, {"type": "managed_agent_call", "caller": "manager", "agent": "web"}),
        (3.0, {"type": "step", "agent": "web", "step_number": 1}),
        (5.0, {"type": "step", "agent": "web", "step_number": 2}),
        (6.0, {"type": "managed_agent_result", "caller": "manager", "agent": "web"}),
        (7.0, {"type": "step", "agent": "manager", "step_number": 1}),
    ):
        record.observed({**event, "ts": ts})
    assert record.step_at(0.5) == {}
    assert record.step_at(1.5) == {"agent": "manager", "step_number": 1}
    assert record.step_at(2.5) == {"agent": "web", "step_number": 1}
    assert record.step_at(4.0) == {"agent": "web", "step_number": 2}
    assert record.step_at(6.5) == {"agent": "manager", "step_number": 1}
    assert record.step_at(8.0) == {"agent": "manager", "step_number": 2}
    record.close()
