"""The batch summary as printed (orchestrator/cli/batch_display.py)."""

from __future__ import annotations

import io

from orchestrator.batch.plan import BatchSummary
from orchestrator.cli.batch_display import BatchDisplay


def summary(**session: object) -> BatchSummary:
    return BatchSummary(
        batch_id="b-20261128-203000-0123abcd",
        state="complete",
        output_dir="batches/research_team-tasks",
        tasks_file="tasks.jsonl",
        payload="research_team",
        model="mock",
        scorer="exact",
        total=123456,
        counts={"succeeded": 123455, "failed": 1},
        pending=0,
        scored=123456,
        correct=123455,
        accuracy=123455 / 123456,
        accuracy_ci95=[0.99999, 1.0],
        duration_p50=12345.6,
        duration_p95=23456.7,
        tokens={"input": 1234567890, "output": 123456789},
        tokens_all_attempts={"input": 1234567890, "output": 123456789},
        tokens_source="sandbox",
        attempts=123457,
        retries=1,
        skipped_lines=[],
        stop_reason=None,
        session=session,
        concurrency={
            "mode": "auto",
            "ceiling": 32,
            "lowest": 1,
            "highest": 32,
            "changes": [{"limit": 1}, {"limit": 32}],
        },
    )


def test_piped_each_summary_row_is_one_line_however_long_its_figures() -> None:
    """Piped (a log, cron's mail), a row stays whole, so grep finds it: the figures' widths
    change from run to run, and a row wrapped at 80 columns split mid-phrase."""
    stream = io.StringIO()
    BatchDisplay(stream=stream).final(
        summary(tasks_run=123456, wall_seconds=12345.6, tasks_per_minute=1234.5, concurrency=32)
    )
    lines = stream.getvalue().splitlines()
    (session,) = [line for line in lines if line.lstrip().startswith("this session")]
    assert "1234.5 tasks/min" in session and session.rstrip().endswith("1 change(s))"), lines
    (tokens,) = [line for line in lines if line.lstrip().startswith("tokens")]
    assert tokens.rstrip().endswith("(as reported)"), lines
    assert all(len(line) < 200 for line in lines)  # no padding out to the wide layout
