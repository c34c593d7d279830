"""Scheduled jobs: time is injected (simulated hours take milliseconds), the executor is
injected where Docker is beside the point, and the real thing runs where it matters
(overlap across processes, one end-to-end firing in a container)."""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from croniter import croniter

from orchestrator.errors import ConfigError
from orchestrator.execution.executor import Attempt, AttemptExecutor
from orchestrator.lifecycle.runner import RunObservers, prepare
from orchestrator.policy import MAX_HOSTS
from orchestrator.records.store import Store
from orchestrator.registry import backend_names
from orchestrator.schedules import (
    EXIT_SKIPPED,
    Cron,
    Scheduler,
    ScheduleStore,
    cron_times_field,
    crontab_block,
    fire,
    load_schedules,
    merge_crontab,
    parse_duration,
    run_due,
)
from orchestrator.spec import RunError, RunResult, RunSpec
from tests.conftest import PAYLOADS, REPO, TEST_PAYLOADS, cli, wait_for

UTC = timezone.utc
BERLIN = ZoneInfo("Europe/Berlin")
RESEARCH = PAYLOADS / "research_team"
ADVERSARY = TEST_PAYLOADS / "adversary"


# --- helpers ----------------------------------------------------------------------------------


class FakeClock:
    """Jumps instead of sleeping; sets `stop` once time passes `end` (inclusive)."""

    def __init__(self, start: datetime, end: datetime | None = None) -> None:
        self.t = start
        self.end = end
        self.slept = 0.0

    def now(self) -> datetime:
        return self.t

    def sleep(self, seconds: float, stop: threading.Event) -> bool:
        target = self.t + timedelta(seconds=seconds)
        self.slept += seconds
        if self.end is not None and target > self.end:
            self.t = self.end
            stop.set()
            return True
        self.t = target
        return stop.is_set()


class FakeRuns(AttemptExecutor):
    """Stands in for an executor: writes a real run row (linked to the schedule) and
    returns the given status; `block` makes it wait for its cancel event like a long run."""

    def __init__(self, status: str = "succeeded", *, block: float = 0.0, raises: bool = False):
        self.status = status
        self.block = block
        self.raises = raises
        self.specs: list[RunSpec] = []
        self.started = threading.Event()

    def run(self, attempt: Attempt, observers: RunObservers) -> RunResult:
        spec, cancel, store = attempt.prepared.spec, observers.cancel, observers.store
        assert store is not None
        self.specs.append(spec)
        if self.raises:
            raise RuntimeError("engine exploded")
        store.create_run(
            spec.run_id,
            status="running",
            schedule=spec.schedule,
            payload=Path(spec.payload).name,
            model=spec.model,
        )
        self.started.set()
        status = self.status
        if self.block and cancel.wait(self.block):
            status = "cancelled"
        store.update_run(spec.run_id, status=status, ended_at=time.time())
        error = None if status == "succeeded" else RunError(status, f"it {status}")
        return RunResult(
            run_id=spec.run_id,
            status=status,
            error=error,
            record_dir=str(store.run_dir(spec.run_id)),
        )


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, Path)):
        return json.dumps(str(value))
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(value)


def write_schedules(directory: Path, *tables: dict[str, Any]) -> Path:
    lines = []
    for table in tables:
        lines.append("[[schedule]]")
        table = {"payload": str(RESEARCH), "model": "mock", **table}
        lines.extend(f"{k} = {toml_value(v)}" for k, v in table.items())
        lines.append("")
    path = directory / "schedules.toml"
    path.write_text("\n".join(lines))
    return path


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def sync(job) -> None:
    job()


def serve_simulated(schedules, clock: FakeClock, executor, log: list[str] | None = None):
    """One `serve` session over simulated time; firings run inline, nothing sleeps."""
    store = ScheduleStore()
    scheduler = Scheduler(
        schedules,
        store=store,
        clock=clock,
        executor=executor,
        spawn=sync,
        log=(log if log is not None else []).append,
    )
    stop = threading.Event()
    started = time.monotonic()
    scheduler.serve(stop)
    return store, time.monotonic() - started


def firings(store: ScheduleStore, name: str) -> list[dict[str, Any]]:
    return list(reversed(store.history(name, limit=100_000)))


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).astimezone(UTC)


# --- 1. the right instants, across DST --------------------------------------------------------


@pytest.mark.parametrize(
    ("start", "local_minutes"),
    [
        # Spring forward: 02:00 CET becomes 03:00 CEST, no 02:xx exists.
        ("2024-03-31T00:30:00+00:00", ["01:59+0100", "03:00+0200"]),
        # Fall back: 03:00 CEST becomes 02:00 CET, 02:xx happens twice.
        ("2024-10-27T00:30:00+00:00", ["02:59+0200", "02:00+0100"]),
    ],
    ids=["spring-forward", "fall-back"],
)
def test_every_minute_over_a_simulated_hour_across_dst(
    tmp_path: Path, start: str, local_minutes: list[str]
) -> None:
    name = unique("every-minute")
    sf = load_schedules(
        write_schedules(tmp_path, {"name": name, "cron": "* * * * *", "timezone": "Europe/Berlin"})
    )
    begin = at(start)
    clock = FakeClock(begin, begin + timedelta(hours=1))
    runs = FakeRuns()
    log: list[str] = []
    store, elapsed = serve_simulated(sf.schedules, clock, runs, log)

    rows = firings(store, name)
    expected = [begin + timedelta(minutes=m) for m in range(1, 61)]
    fired = [datetime.fromtimestamp(r["scheduled_for"], UTC) for r in rows]
    assert fired == expected  # every real minute once: no gap, no double, across the switch
    assert all(r["fired_at"] == r["scheduled_for"] for r in rows)  # on the instant, not late
    assert {r["outcome"] for r in rows} == {"succeeded"} and len(runs.specs) == 60
    wall = [t.astimezone(BERLIN).strftime("%H:%M%z") for t in fired]
    i = wall.index(local_minutes[0])
    assert wall[i + 1] == local_minutes[1]
    # One log line per firing, and every run record links back to the schedule.
    assert len([line for line in log if f"schedule={name} " in line and "outcome=" in line]) == 60
    linked = Store().list_runs(schedule=name, limit=1000)
    assert {r["run_id"] for r in linked} == {r["run_id"] for r in rows}
    assert clock.slept >= 3600 and elapsed < 30  # an hour simulated, not waited


def test_fixed_hour_jobs_fire_once_on_dst_days() -> None:
    daily = Cron("30 2 * * *", BERLIN)
    # 02:30 does not exist on 31 March: it fires when the clock jumps, at 03:00 CEST.
    spring = daily.next_times(at("2024-03-30T12:00:00+00:00"), 2)
    assert [t.astimezone(BERLIN).isoformat() for t in spring] == [
        "2024-03-31T03:00:00+02:00",
        "2024-04-01T02:30:00+02:00",
    ]
    # 02:30 happens twice on 27 October: a fixed-hour job runs in the first pass only.
    fall = daily.next_times(at("2024-10-26T12:00:00+00:00"), 2)
    assert [t.astimezone(BERLIN).isoformat() for t in fall] == [
        "2024-10-27T02:30:00+02:00",
        "2024-10-28T02:30:00+01:00",
    ]
    # An hourly job fires in both passes: every real hour.
    hourly = Cron("@hourly", BERLIN).next_times(at("2024-10-26T23:30:00+00:00"), 3)
    assert [t.strftime("%H:%M") for t in hourly] == ["00:00", "01:00", "02:00"]


# --- 2. two processes, one run ----------------------------------------------------------------


def _start_run(name: str, path: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "schedule", "run", name, "--file", str(path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.docker
def test_two_processes_exactly_one_runs(tmp_path: Path, agent_image: str, no_leftovers) -> None:
    name = unique("overlap")
    path = write_schedules(
        tmp_path,
        {
            "name": name,
            "cron": "@hourly",
            "payload": str(ADVERSARY),
            "additional_args": {"mode": "sleep"},
            "limits": {"timeout_seconds": 8},
        },
    )
    procs = [_start_run(name, path), _start_run(name, path)]
    outs = [p.communicate(timeout=180) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [3, EXIT_SKIPPED], outs  # one timed out after running, one skipped
    store = ScheduleStore()
    rows = firings(store, name)
    assert sorted(r["outcome"] for r in rows) == ["skipped", "timed_out"]
    ran = next(r for r in rows if r["outcome"] == "timed_out")
    skipped = next(r for r in rows if r["outcome"] == "skipped")
    assert skipped["run_id"] is None and skipped["exit_code"] == EXIT_SKIPPED
    assert ran["run_id"] in skipped["reason"]  # the skip names the run still going
    assert [r["run_id"] for r in Store().list_runs(schedule=name)] == [ran["run_id"]]
    skip_out = outs[[p.returncode for p in procs].index(EXIT_SKIPPED)][0]
    assert skip_out.count("\n") == 1 and "outcome=skipped" in skip_out  # one log line


@pytest.mark.docker
def test_replace_cancels_the_run_of_another_process(
    tmp_path: Path, agent_image: str, no_leftovers
) -> None:
    name = unique("replace")
    path = write_schedules(
        tmp_path,
        {
            "name": name,
            "cron": "@hourly",
            "payload": str(ADVERSARY),
            "concurrency": "replace",
            "additional_args": {"mode": "sleep"},
            "limits": {"timeout_seconds": 60},
        },
    )
    store = ScheduleStore()

    def running_run() -> str | None:
        """The run id of the firing whose sandbox runs now (None while none does)."""
        for row in store.running(name):
            run = Store().get_run(row["run_id"]) if row["run_id"] else None
            if run and run["status"] == "running":
                return run["run_id"]
        return None

    first = _start_run(name, path)
    first_run = wait_for(running_run, timeout=120)
    second = _start_run(name, path)
    first.communicate(timeout=60)
    assert first.returncode == 130  # its run was cancelled: sandbox killed, recorded
    assert wait_for(running_run, timeout=60) != first_run  # the second one took over
    second.send_signal(signal.SIGTERM)  # no need to wait out the second run's minute
    second.communicate(timeout=60)
    rows = firings(store, name)
    assert rows[0]["outcome"] == "cancelled" and rows[0]["reason"] == "replaced by a newer firing"
    assert rows[1]["outcome"] == "cancelled" and rows[1]["run_id"]
    assert {r["status"] for r in Store().list_runs(schedule=name)} == {"cancelled"}


def test_forbid_skips_and_replace_cancels_within_one_process(tmp_path: Path) -> None:
    forbid, repl = unique("forbid"), unique("replace")
    sf = load_schedules(
        write_schedules(
            tmp_path,
            {"name": forbid, "cron": "@hourly"},
            {"name": repl, "cron": "@hourly", "concurrency": "replace"},
        )
    )
    store = ScheduleStore()
    for schedule in sf.schedules:
        slow, cancel = FakeRuns(block=30), threading.Event()
        background = threading.Thread(
            target=fire,
            args=(schedule,),
            kwargs={
                "store": store,
                "executor": slow,
                "observers": RunObservers(cancel=cancel),
                "log": print,
            },
        )
        background.start()
        assert slow.started.wait(120)
        log: list[str] = []
        second = fire(schedule, store=store, executor=FakeRuns(), log=log.append)
        if schedule.concurrency == "forbid":
            assert second.outcome == "skipped" and second.exit_code == EXIT_SKIPPED
            assert slow.specs[0].run_id in second.reason
            cancel.set()  # end the long run (as Ctrl-C would)
        background.join(30)
        rows = firings(store, schedule.name)
        if schedule.concurrency == "forbid":
            assert [r["outcome"] for r in rows] == ["cancelled", "skipped"]
        else:
            assert second.outcome == "succeeded"
            assert [r["outcome"] for r in rows] == ["cancelled", "succeeded"]
            assert rows[0]["reason"] == "replaced by a newer firing"
            assert second.reason == f"replaced {slow.specs[0].run_id}"
            assert [line for line in log if "outcome=" in line] == log and len(log) == 1
        assert store.running(schedule.name) == []


# --- 3. downtime: skip fires nothing, run-once fires once -------------------------------------


def test_restart_after_three_hours_applies_the_missed_rule(tmp_path: Path) -> None:
    skip, once, late = unique("skip"), unique("once"), unique("deadline")
    sf = load_schedules(
        write_schedules(
            tmp_path,
            {"name": skip, "cron": "*/15 * * * *", "missed": "skip"},
            {"name": once, "cron": "*/15 * * * *", "missed": "run-once", "missed_deadline": "1h"},
            {"name": late, "cron": "*/15 * * * *", "missed": "run-once", "missed_deadline": "5m"},
        )
    )
    runs = FakeRuns()
    t0 = at("2024-06-01T10:00:00+00:00")
    store, _ = serve_simulated(sf.schedules, FakeClock(t0, t0 + timedelta(hours=1)), runs)
    for name in (skip, once, late):
        assert len(firings(store, name)) == 4  # 10:15, 10:30, 10:45, 11:00

    # Stopped at 11:00; restarted at 14:07, seven minutes after the last missed fire time.
    restart = t0 + timedelta(hours=4, minutes=7)
    log: list[str] = []
    serve_simulated(sf.schedules, FakeClock(restart, restart + timedelta(minutes=5)), runs, log)

    skip_rows = firings(store, skip)[4:]
    assert [r["outcome"] for r in skip_rows] == ["missed"]  # nothing fired for the gap
    assert skip_rows[0]["reason"].startswith("12 fire time(s)")

    once_rows = firings(store, once)[4:]
    fired = [r for r in once_rows if r["outcome"] != "missed"]
    assert len(fired) == 1  # exactly once, for the latest missed fire time
    assert fired[0]["trigger"] == "catch-up" and fired[0]["outcome"] == "succeeded"
    assert fired[0]["scheduled_for"] == at("2024-06-01T14:00:00+00:00").timestamp()
    assert [r["outcome"] for r in once_rows if r["outcome"] == "missed"] == ["missed"]

    late_rows = firings(store, late)[4:]
    assert [r["outcome"] for r in late_rows] == ["missed"]  # 7 min late > 5 min deadline
    assert "missed_deadline" in late_rows[0]["reason"]

    # And back to normal: the next fire times fire on time, once each.
    again = restart + timedelta(minutes=5)
    serve_simulated(sf.schedules, FakeClock(again, again + timedelta(minutes=30)), runs)
    for name in (skip, once, late):
        recent = [r for r in firings(store, name) if r["scheduled_for"] > restart.timestamp()]
        assert [r["trigger"] for r in recent] == ["serve", "serve"]  # 14:15 and 14:30


def test_if_due_fires_on_time_only_and_once(tmp_path: Path) -> None:
    name = unique("cron-line")
    sf = load_schedules(write_schedules(tmp_path, {"name": name, "cron": "*/5 * * * *"}))
    schedule, store, runs = sf.schedules[0], ScheduleStore(), FakeRuns()
    due = at("2024-06-01T10:05:03+00:00")
    first = run_due(schedule, store=store, clock=FakeClock(due), executor=runs, log=print)
    assert first is not None and first.outcome == "succeeded"
    # The same fire time again (a second cron line, or serve beside cron): nothing runs.
    assert run_due(schedule, store=store, clock=FakeClock(due), executor=runs, log=print) is None
    racer = fire(
        schedule,
        store=store,
        trigger="serve",
        scheduled_for=due.replace(second=0),
        clock=FakeClock(due),
        executor=runs,
        log=print,
    )
    assert racer.outcome == "duplicate" and racer.exit_code == 0  # the claim is atomic
    assert (
        run_due(
            schedule,
            store=store,
            clock=FakeClock(due + timedelta(minutes=2)),
            executor=runs,
            log=print,
        )
        is None
    )
    assert len(runs.specs) == 1
    # Cron skipped 10:10 and 10:15 (host down): the 10:20 firing records the gap.
    later = at("2024-06-01T10:20:01+00:00")
    run_due(schedule, store=store, clock=FakeClock(later), executor=runs, log=print)
    outcomes = [(r["outcome"], r["trigger"]) for r in firings(store, name)]
    assert outcomes == [("succeeded", "cron"), ("missed", "cron"), ("succeeded", "cron")]


# --- 4. failures are heard about; a broken notifier breaks nothing ----------------------------

NOTIFY_SCRIPT = (
    "import json, os, sys; "
    "open(sys.argv[1], 'a').write(json.dumps({'argv': sys.argv[2:], "
    "'run_id': os.environ['ORCHESTRATOR_RUN_ID'], 'status': os.environ['ORCHESTRATOR_STATUS'], "
    "'schedule': os.environ['ORCHESTRATOR_SCHEDULE']}) + '\\n')"
)


def test_failing_run_notifies_and_failing_notifier_is_recorded(tmp_path: Path) -> None:
    good, broken, hanging = unique("notify"), unique("broken-notify"), unique("hang-notify")
    calls = tmp_path / "calls.jsonl"
    sf = load_schedules(
        write_schedules(
            tmp_path,
            {
                "name": good,
                "cron": "* * * * *",
                "notify": {
                    "command": [
                        sys.executable,
                        "-c",
                        NOTIFY_SCRIPT,
                        str(calls),
                        "{run_id}",
                        "{status}",
                    ]
                },
            },
            {
                "name": broken,
                "cron": "* * * * *",
                "notify": {
                    "command": "/nonexistent/notifier --run {run_id}",
                    "webhook": "http://127.0.0.1:9/closed-port",
                },
            },
            {
                "name": hanging,
                "cron": "0 * * * *",
                "notify": {"command": ["sleep", "30"], "timeout_seconds": 1},
            },
        )
    )
    runs = FakeRuns(status="failed")
    t0 = at("2024-06-01T09:57:00+00:00")
    log: list[str] = []
    started = time.monotonic()
    store, _ = serve_simulated(sf.schedules, FakeClock(t0, t0 + timedelta(minutes=5)), runs, log)
    assert time.monotonic() - started < 28  # cut off after 1 s, not after its 30 s sleep

    good_rows = firings(store, good)
    assert len(good_rows) == 5 and {r["outcome"] for r in good_rows} == {"failed"}
    sent = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [(c["run_id"], c["status"]) for c in sent] == [
        (r["run_id"], "failed") for r in good_rows
    ]
    assert [c["argv"] for c in sent] == [[r["run_id"], "failed"] for r in good_rows]
    assert {c["schedule"] for c in sent} == {good}

    # The broken notifier failed every time, was recorded every time, and the schedule went on.
    assert len(firings(store, broken)) == 5
    notes = store.notifications(broken, limit=100)
    assert len(notes) == 10 and not any(n["ok"] for n in notes)
    assert {n["kind"] for n in notes} == {"command", "webhook"}
    assert any(f"schedule={broken} notify=command ok=false" in line for line in log)

    (hang,) = store.notifications(hanging)
    assert not hang["ok"] and "did not finish within 1s" in hang["detail"]


def test_webhook_gets_json_and_scheduler_survives_a_crashing_run(tmp_path: Path) -> None:
    received: list[dict[str, Any]] = []

    class Hook(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # http.server's naming
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append(json.loads(body))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        name = unique("webhook")
        url = f"http://127.0.0.1:{server.server_address[1]}/hook"
        sf = load_schedules(
            write_schedules(
                tmp_path, {"name": name, "cron": "* * * * *", "notify": {"webhook": url}}
            )
        )
        t0 = at("2024-06-01T12:00:00+00:00")
        store, _ = serve_simulated(
            sf.schedules, FakeClock(t0, t0 + timedelta(minutes=3)), FakeRuns(raises=True)
        )
    finally:
        server.shutdown()
    rows = firings(store, name)
    assert [r["outcome"] for r in rows] == ["error"] * 3  # every firing recorded, loop went on
    assert "engine exploded" in rows[0]["reason"]
    assert len(received) == 3 and received[0]["status"] == "error"
    assert received[0]["schedule"] == name and received[0]["exit_code"] == 5
    assert all(n["ok"] for n in store.notifications(name))


def test_a_schedules_allowlist_is_held_to_the_maximum(tmp_path: Path) -> None:
    """`allow_hosts` alone past `MAX_HOSTS`, and `allow_hosts` with the payload's own
    `[network] hosts` past it together: both refused by validation, naming the maximum."""
    hosts = [f"h{i:05d}.example.test" for i in range(MAX_HOSTS + 1)]
    name = unique("hosts")
    path = write_schedules(tmp_path, {"name": name, "cron": "@daily", "allow_hosts": hosts})
    with pytest.raises(ConfigError) as info:
        load_schedules(path)
    assert "allow_hosts" in str(info.value) and f"{MAX_HOSTS:,}" in str(info.value)
    probe = TEST_PAYLOADS / "egress_probe"  # lists one host itself
    path = write_schedules(
        tmp_path,
        {"name": name, "cron": "@daily", "payload": str(probe), "allow_hosts": hosts[1:]},
    )
    with pytest.raises(ConfigError) as info:
        load_schedules(path)
    assert f'schedule "{name}" field `network`' in str(info.value)
    assert f"{MAX_HOSTS + 1:,} hosts" in str(info.value), info.value


def test_a_secret_the_schedule_does_not_allow_stops_the_firing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = unique("secrets")
    path = write_schedules(
        tmp_path, {"name": name, "cron": "@daily", "payload": str(PAYLOADS / "data_analyst")}
    )
    with pytest.raises(Exception) as info:
        load_schedules(path)
    assert f'schedule "{name}" field `secrets`' in str(info.value)
    # Who asks for it, and only who does (before: "declared by the payload
    # data_analyst or the model mock", although the mock model needs no key).
    assert "ANALYTICS_TOKEN (the payload data_analyst)" in str(info.value), info.value
    assert "mock" not in str(info.value)
    # At firing time too (the manifest may have changed since validation): recorded, exit 2.
    (schedule,) = load_schedules(path, check_payloads=False).schedules
    runs = FakeRuns()
    firing = fire(schedule, store=ScheduleStore(), executor=runs, log=print)
    assert firing.outcome == "error" and firing.exit_code == 2 and not runs.specs
    allowed = write_schedules(
        tmp_path,
        {
            "name": name,
            "cron": "@daily",
            "payload": str(PAYLOADS / "data_analyst"),
            "secrets": ["ANALYTICS_TOKEN"],
        },
    )
    (schedule,) = load_schedules(allowed).schedules
    assert schedule.secrets == ("ANALYTICS_TOKEN",)
    # The allow-list check mirrors what the runner hands a run: pin that assumption.
    monkeypatch.setenv("ANALYTICS_TOKEN", "token-value-1234")
    assert set(prepare(schedule.run_spec()).secrets) <= set(schedule.secrets)
    # The model's credential counts too.
    hosted = write_schedules(
        tmp_path, {"name": name, "cron": "@daily", "network": "open", "model": "openai:gpt-4o-mini"}
    )
    with pytest.raises(Exception, match=r"OPENAI_API_KEY \(the key of the model openai:gpt-4o"):
        load_schedules(hosted)


# --- 5. install --dry-run; malformed cron rejected --------------------------------------------


def test_install_dry_run_prints_valid_crontab_lines(tmp_path: Path) -> None:
    name = unique("nightly")
    path = write_schedules(
        tmp_path,
        {"name": name, "cron": "0 0 1 1 *", "timezone": "UTC", "missed": "run-once"},
        {"name": unique("berlin"), "cron": "30 2 * * 1-5", "timezone": "Europe/Berlin"},
        {"name": unique("kolkata"), "cron": "*/10 * * * *", "timezone": "Asia/Kolkata"},
        {"name": unique("off"), "cron": "@daily", "enabled": False},
    )
    out = cli("schedule", "install", "--dry-run", "--file", str(path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("# >>> orchestrator schedules ") and lines[-1].startswith("# <<<")
    jobs = [line for line in lines if not line.startswith("#")]
    assert len(jobs) == 4  # three schedules, plus @reboot catch-up for the run-once one
    for job in jobs:
        if job.startswith("@reboot "):
            command = job[len("@reboot sleep 60 && ") :]
            assert "--catch-up" in command
        else:
            fields = job.split()
            assert croniter.is_valid(" ".join(fields[:5])), job
            command = " ".join(fields[5:])
            assert "--if-due" in command
        assert re.search(r" -m orchestrator schedule run \S+ --(if-due|catch-up) --file ", command)
        assert f"--file {path}" in command and f"{sys.executable} -m orchestrator" in command
        assert re.search(r">> /\S+\.log 2>&1$", command)  # absolute log file, appended
        assert "%" not in command.replace("\\%", "")  # cron would turn % into a newline
    # Time fields: UTC as is; Berlin differs by whole hours (minute field kept); Kolkata by
    # half an hour (every minute, and --if-due decides).
    assert [j.split()[:5] for j in jobs if not j.startswith("@")] == [
        ["0", "0", "1", "1", "*"],
        ["30", "*", "*", "*", "*"],
        ["*", "*", "*", "*", "*"],
    ]
    # The line really runs: a not-due firing exits 0 and writes nothing but its log file.
    command = next(j for j in jobs if not j.startswith("@")).split(None, 5)[5]
    done = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    log_file = Path(re.search(r">> (\S+\.log)", command).group(1))
    assert log_file.is_file() and log_file.read_text() == ""


def test_a_shipped_example_is_named_as_run_names_it(tmp_path: Path) -> None:
    """`payload = "research_team"` names the shipped example, as `run research_team` does
    (before: "... does not exist (a payload folder)"); a folder of that
    name beside the schedules file comes first; a name that is neither says both ways."""
    path = write_schedules(
        tmp_path, {"name": "daily", "cron": "@daily", "payload": "research_team"}
    )
    (schedule,) = load_schedules(path).schedules
    assert schedule.payload == (REPO / "agent_payloads" / "research_team").absolute()
    out = cli("schedule", "validate", "--file", str(path))
    assert out.returncode == 0, out.stderr
    (tmp_path / "research_team").mkdir()
    with pytest.raises(Exception, match="No payload manifest"):
        load_schedules(path)  # the local folder, as `run` would take it
    missing = write_schedules(tmp_path, {"name": "x", "cron": "@daily", "payload": "nosuch"})
    with pytest.raises(Exception, match=r"shipped example's name") as info:
        load_schedules(missing)
    assert "1 problem:" in str(info.value) and "next five fire times" in str(info.value)


def test_malformed_cron_is_rejected_naming_schedule_and_field(tmp_path: Path) -> None:
    name = unique("typo")
    path = write_schedules(
        tmp_path,
        {"name": name, "cron": "0 25 * * *"},
        {"name": "other", "cron": "*/5 * * * *", "missed": "sometimes"},
    )
    for command in ("validate", "install"):
        out = cli(
            "schedule",
            command,
            *(["--dry-run"] if command == "install" else []),
            "--file",
            str(path),
        )
        assert out.returncode == 2 and out.stdout == ""
        assert f"schedule \"{name}\" field `cron`: '0 25 * * *'" in out.stderr
        # A valid cron next to a bad field: the next five fire times help check it.
        assert 'schedule "other" field `missed`' in out.stderr
        assert re.search(r'schedule "other": next five fire times: (\S+, ){4}\S+', out.stderr)
    for cron, problem in [
        ("* * * *", "has 4 fields"),
        ("* * * * * *", "has 6 fields"),
        ("@reboot", "not supported"),
        ("0 0 30 2 *", "never fires"),
    ]:
        bad = write_schedules(tmp_path, {"name": "x", "cron": cron})
        with pytest.raises(Exception, match=re.escape(problem)) as info:
            load_schedules(bad)
        assert 'schedule "x" field `cron`' in str(info.value)


def test_validation_names_every_bad_field(tmp_path: Path) -> None:
    path = write_schedules(
        tmp_path,
        {
            "name": "a",
            "cron": "@hourly",
            "timezone": "Mars/Olympus",
            "limits": {"timeout": 3},
            "payload": "no/such/payload",
            "colour": "blue",
            "notify": {"webhook": "ftp://x"},
        },
        {"name": "a", "cron": "@hourly", "limits": {"timeout_seconds": 999999}},
    )
    with pytest.raises(Exception) as info:
        load_schedules(path)
    text = str(info.value)
    for field in (
        "timezone",
        "limits.timeout",
        "payload",
        "colour",
        "notify.webhook",
        "name",
        "limits.timeout_seconds",  # the limit's own path (was `limits`: prepare's finding)
    ):
        assert f'schedule "a" field `{field}`' in text, field
    assert "timeout_seconds" in text and "out of range" in text


def test_install_merges_idempotently_between_markers(tmp_path: Path) -> None:
    table = tmp_path / "crontab.txt"
    table.write_text("MAILTO=ops@example.com\n17 * * * * /usr/bin/backup\n")
    fake = tmp_path / "crontab"
    fake.write_text(f'#!/bin/sh\nif [ "$1" = "-l" ]; then cat {table}; else cat > {table}; fi\n')
    fake.chmod(0o755)
    name = unique("installed")
    path = write_schedules(tmp_path, {"name": name, "cron": "@hourly"})
    env = {"ORCHESTRATOR_CRONTAB": str(fake)}
    for _ in range(2):
        out = cli("schedule", "install", "--file", str(path), env=env)
        assert out.returncode == 0, out.stderr
    text = table.read_text()
    assert text.startswith("MAILTO=ops@example.com\n17 * * * * /usr/bin/backup\n")
    assert text.count(">>> orchestrator schedules") == 1 and text.count(f"run {name} ") == 1
    assert cli("schedule", "install", "--remove", "--file", str(path), env=env).returncode == 0
    assert table.read_text() == "MAILTO=ops@example.com\n17 * * * * /usr/bin/backup\n"


def test_cron_fields_follow_the_host_zone(tmp_path: Path) -> None:
    sf = load_schedules(
        write_schedules(
            tmp_path,
            {"name": "b", "cron": "15 3 * * *", "timezone": "Europe/Berlin"},
            {"name": "l", "cron": "0 0 L * *", "timezone": "UTC"},
        )
    )
    berlin, last_day = sf.schedules
    now = at("2024-06-01T00:00:00+00:00")
    assert cron_times_field(berlin, now, BERLIN) == "15 3 * * *"
    assert cron_times_field(berlin, now, ZoneInfo("UTC")) == "15 * * * *"
    assert cron_times_field(last_day, now, ZoneInfo("UTC")) == "0 * * * *"  # L: croniter only
    block = crontab_block(sf, now=now, zone=ZoneInfo("UTC"))
    assert merge_crontab("", block, sf.path) == "\n".join(block) + "\n"
    assert merge_crontab(merge_crontab("x\n", block, sf.path), [], sf.path, remove=True) == "x\n"


def test_durations_and_exit_code_constants() -> None:
    assert parse_duration("1h30m") == 5400 and parse_duration(90) == 90
    assert parse_duration("2d") == 172800
    for bad in ("soon", "", "-5m", 0, True):
        with pytest.raises(ValueError):
            parse_duration(bad)
    assert EXIT_SKIPPED == 75


# --- 6. one real firing, end to end -----------------------------------------------------------


@pytest.mark.docker
def test_real_firing_runs_in_a_container_and_links_to_the_schedule(
    tmp_path: Path, agent_image: str, no_leftovers
) -> None:
    name = unique("e2e")
    path = write_schedules(
        tmp_path,
        {
            "name": name,
            "cron": "0 3 * * *",
            "timezone": "Europe/Berlin",
            "task": "How many years after the Eiffel Tower opened did the Golden Gate Bridge open?",
            "network": "none",
            "limits": {"timeout_seconds": 120},
        },
    )
    assert cli("schedule", "validate", "--file", str(path)).returncode == 0
    out = cli("schedule", "run", name, "--file", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    (line,) = out.stdout.splitlines()  # one log line, no progress output off a terminal
    assert out.stderr == ""
    assert f"schedule={name} trigger=manual outcome=succeeded run=r-" in line
    run_id = re.search(r"run=(\S+)", line).group(1)

    listed = cli("runs", "list", "--schedule", name, "--json")
    (row,) = json.loads(listed.stdout)
    assert row["run_id"] == run_id and row["schedule"] == name and row["status"] == "succeeded"
    assert json.loads((Path(row["record_dir"]) / "result.json").read_text())["answer"] in (48, "48")
    history = cli("schedule", "history", name, "--json")
    (firing,) = json.loads(history.stdout)["firings"]
    assert firing["run_id"] == run_id and firing["outcome"] == "succeeded"
    listing = cli("schedule", "list", "--file", str(path))
    assert "LAST" in listing.stdout and "succeeded" in listing.stdout and run_id in listing.stdout


@pytest.mark.docker
def test_serve_shutdown_cancels_a_running_firing(
    tmp_path: Path, agent_image: str, no_leftovers
) -> None:
    from orchestrator.execution.executor import LocalExecutor

    name = unique("shutdown")
    sf = load_schedules(
        write_schedules(
            tmp_path,
            {
                "name": name,
                "cron": "0 * * * *",
                "payload": str(ADVERSARY),
                "additional_args": {"mode": "sleep"},
                "limits": {"timeout_seconds": 60},
            },
        )
    )
    t = at("2024-06-01T10:00:00+00:00")
    # Real threads and the real runner; the clock stops serve right after the firing starts.
    scheduler = Scheduler(
        sf.schedules,
        clock=FakeClock(t - timedelta(seconds=1), t),
        executor=LocalExecutor(),
        log=print,
    )
    started = time.monotonic()
    scheduler.serve(threading.Event())
    assert time.monotonic() - started < 60  # cancelled, not waited for
    (row,) = firings(scheduler.store, name)
    assert row["outcome"] == "cancelled" and row["run_id"]
    assert Store().get_run(row["run_id"])["status"] == "cancelled"


def test_serve_shuts_down_cleanly_on_sigterm(tmp_path: Path) -> None:
    path = write_schedules(tmp_path, {"name": unique("serve"), "cron": "0 0 1 1 *"})
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "schedule", "serve", "--file", str(path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ},
    )
    assert "serve started" in proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "serve stopped" in out


# --- one schema, every problem at once, with its field path and line ---------------


def test_three_mistakes_in_a_schedules_file_are_all_reported_at_once(tmp_path: Path) -> None:
    """Acceptance 3: an unknown key close to a real one, a wrong type, a value out of range,
    in a file with a good schedule too: `schedule validate` names all three (line, schedule,
    field, fix) and exits 2; `schedule list` (payloads unchecked) and --json say the same."""
    good, bad = unique("good"), unique("bad")
    path = write_schedules(
        tmp_path,
        {"name": good, "cron": "@daily"},
        {
            "name": bad,
            "cron": "@hourly",
            "timezon": "Europe/Berlin",
            "enabled": "yes",
            "limits": {"timeout_seconds": 0},
        },
    )
    text = path.read_text()
    lines = text.splitlines()

    def line(start: str) -> int:
        return next(n for n, s in enumerate(lines, 1) if s.startswith(start))

    expected = [
        (
            line("timezon"),
            f'schedule "{bad}" field `timezon`: is not a known field; '
            "did you mean `timezone`? Known fields: ",
        ),
        (
            line("enabled"),
            f'schedule "{bad}" field `enabled`: must be true or false, '
            "got 'yes'. Use true or false.",
        ),
        (
            line("limits"),
            f'schedule "{bad}" field `limits.timeout_seconds`: is 0, out of range. '
            "Use 1 to 86400 seconds.",
        ),
    ]
    for command in ("validate", "list"):
        out = cli("schedule", command, "--file", str(path))
        assert out.returncode == 2 and out.stdout == "", out.stderr
        assert f"{path}: 3 problems:" in out.stderr  # the next fire times are no problem
        for number, message in expected:
            assert f"\n  - line {number}: {message}" in out.stderr, (message, out.stderr)
        assert f'schedule "{bad}": next five fire times: ' in out.stderr
        assert good not in out.stderr
    refused = json.loads(cli("schedule", "validate", "--file", str(path), "--json").stdout)
    problems = refused["error"]["problems"]
    assert [(p["field"], p["line"]) for p in problems] == [
        ("schedule[2].timezon", expected[0][0]),
        ("schedule[2].enabled", expected[1][0]),
        ("schedule[2].limits.timeout_seconds", expected[2][0]),
    ]
    assert all(p["fix"] for p in problems)


def test_schedules_file_names_unknown_tables_and_allowed_values(tmp_path: Path) -> None:
    path = tmp_path / "schedules.toml"
    path.write_text(
        f'[[schedule]]\nname = "x"\ncron = "@daily"\npayload = "{RESEARCH}"\n'
        'network = "closed"\nbackend = "k8s"\n\n[[schedul]]\nname = "y"\n'
    )
    with pytest.raises(Exception) as info:
        load_schedules(path)
    text = str(info.value)
    assert (
        "line 5: schedule \"x\" field `network`: is 'closed', not one of none, allowlist, open. "
        "Use one of none, allowlist, open." in text
    )
    names = ", ".join(backend_names())  # docker, e2b and any installed plugin's
    assert f"line 6: schedule \"x\" field `backend`: is 'k8s', not one of {names}." in text
    assert "line 8: `[schedul]` is not a known table; did you mean `[schedule]`?" in text
