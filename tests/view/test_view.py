"""The viewer without a browser: who it serves (token off loopback, loopback Host names), the
headers on every response, the agent tree built from an event stream, and bad input."""

from __future__ import annotations

import http.client
import json
import os
import select
import signal
import subprocess
from collections.abc import Iterator

import pytest

from orchestrator.view.render import CSP
from orchestrator.view.security import host_name, is_loopback
from orchestrator.view.tree import build_tree, count_steps
from tests.conftest import cli, start_cli


def started(proc: subprocess.Popen[str]) -> list[str]:
    """The lines `orchestrator view` prints before it serves (the URL is the last)."""
    assert proc.stdout is not None
    lines: list[str] = []
    while not lines or not lines[-1].startswith("orchestrator view:"):
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, f"no URL printed; so far {lines}"
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else "exited"
        lines.append(line.strip())
    return lines


@pytest.fixture
def viewer(request: pytest.FixtureRequest) -> Iterator[tuple[int, list[str]]]:
    proc = start_cli("view", "--port", "0", *request.param)
    try:
        lines = started(proc)
        yield int(lines[-1].rsplit(":", 1)[1].split("/")[0]), lines
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(10)


def get(port: int, path: str, headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path, headers=headers or {})
    response = conn.getresponse()
    response.read()
    conn.close()
    return response


@pytest.mark.parametrize("viewer", [("--host", "0.0.0.0")], indirect=True)
def test_other_addresses_need_the_printed_token(viewer: tuple[int, list[str]]):
    port, lines = viewer
    assert len(lines) == 1
    # an address another machine can open (before: http://0.0.0.0:PORT/)
    host = lines[-1].split("://", 1)[1].rsplit(":", 1)[0]
    assert host not in ("0.0.0.0", "localhost") and not host.startswith("127."), lines
    opened = http.client.HTTPConnection(host, port, timeout=10)
    opened.request("GET", "/")
    assert opened.getresponse().status == 401  # reached, and still asks for the token
    opened.close()
    token = lines[-1].split("?token=", 1)[1]
    assert len(token) >= 30
    for path in ("/", "/static/view.css", "/run/x/live", "/?token=wrong"):
        refused = get(port, path)
        assert refused.status == 401, path
        assert refused.getheader("content-security-policy") == CSP
    handed = get(port, f"/batches?token={token}")
    assert handed.status == 303 and handed.getheader("location") == "/batches"
    cookie = handed.getheader("set-cookie") or ""
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    with_cookie = get(port, "/batches", {"Cookie": cookie.split(";", 1)[0]})
    assert with_cookie.status == 200
    assert get(port, "/", {"Authorization": f"Bearer {token}"}).status == 200


@pytest.mark.parametrize("viewer", [()], indirect=True)
def test_loopback_serves_loopback_hosts_only_with_strict_headers(viewer: tuple[int, list[str]]):
    port, lines = viewer
    assert lines == [f"orchestrator view: http://127.0.0.1:{port}/"]
    page = get(port, "/")
    assert page.status == 200
    assert page.getheader("content-security-policy") == CSP
    assert "script-src 'self'" in CSP and "unsafe-inline" not in CSP and "unsafe-eval" not in CSP
    assert page.getheader("x-content-type-options") == "nosniff"
    assert page.getheader("x-frame-options") == "DENY"
    assert get(port, "/", {"Host": f"localhost:{port}"}).status == 200
    assert get(port, "/", {"Host": "attacker.example"}).status == 403  # DNS rebinding
    assert get(port, "/run/no-such-run").status == 404
    assert get(port, "/?since=yesterday").status == 400


def test_host_names():
    assert host_name("[::1]:8080") == "::1" and host_name("localhost:80") == "localhost"
    assert is_loopback("127.0.0.2") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com")


def step(agent: str, n: int, **extra: object) -> dict:
    return {
        "type": "step",
        "agent": agent,
        "step_number": n,
        "code": f"{agent} {n}",
        "token_usage": {"input_tokens": 10, "output_tokens": 1},
        **extra,
    }


def test_tree_nests_managed_agents_in_the_step_that_called_them():
    events = [
        {"type": "run_start", "agents": [{"name": "boss"}, {"name": "helper"}]},
        {"type": "managed_agent_call", "caller": "boss", "agent": "helper", "task": "t1"},
        {"type": "managed_agent_call", "caller": "helper", "agent": "deep", "task": "t2"},
        step("deep", 1),
        {"type": "managed_agent_result", "caller": "helper", "agent": "deep", "output": "d"},
        step("helper", 1),
        {"type": "managed_agent_result", "caller": "boss", "agent": "helper", "output": "h"},
        step("boss", 1),
        {"type": "managed_agent_call", "caller": "boss", "agent": "helper", "task": "again"},
        step("helper", 1),
    ]
    root = build_tree(events)
    assert root.name == "boss" and not root.finished
    [first] = root.steps[0].calls
    assert (first.name, first.task, first.output, first.finished) == ("helper", "t1", "h", True)
    [deep] = first.steps[0].calls
    assert (deep.name, deep.output, deep.steps[0].code) == ("deep", "d", "deep 1")
    # A live run: the second call is still going, held on the boss until its step ends.
    [pending] = root.pending
    assert (pending.task, pending.finished, len(pending.steps)) == ("again", False, 1)
    assert count_steps(root) == 4 and root.tokens == (40, 4)
    assert build_tree(events + [{"type": "run_end"}]).finished


def test_view_bad_input_exits_2(tmp_path):
    not_batch = cli("view", str(tmp_path / "missing"))
    assert not_batch.returncode == 2 and "not a batch output folder" in not_batch.stderr
    empty = cli("view", "--export", str(tmp_path / "out"))
    assert empty.returncode == 2 and "Nothing to export" in empty.stderr
    bad_port = cli("view", "--port", "70000")
    assert bad_port.returncode == 2


def test_runs_list_filters_search_dates_and_pages(tmp_path):
    """The runs page's query over a real SQLite index (rows written as the store writes them)."""
    from datetime import datetime, timezone

    from orchestrator.errors import ConfigError
    from orchestrator.records.store import Store
    from orchestrator.view.queries import PAGE_SIZE, RunFilter, list_runs

    store = Store(tmp_path)
    day = datetime(2026, 3, 1, tzinfo=timezone.utc).timestamp()
    for i in range(120):
        status = "failed" if i % 4 == 0 else "succeeded"
        batch = "b-1" if i < 10 else None
        store.create_run(f"r-test-{i:03d}", status=status, payload="ba"[i % 2], batch=batch)
        store.update_run(f"r-test-{i:03d}", ended_at=day + i * 3600)
    with store.connect() as db:  # creation times a day apart, oldest first
        for i in range(120):
            db.execute(
                "UPDATE runs SET created_at = ? WHERE run_id = ?",
                (day + i * 86400, f"r-test-{i:03d}"),
            )
    first = list_runs(store, RunFilter())
    assert (first.total, first.pages, len(first.rows)) == (120, 3, PAGE_SIZE)
    assert first.rows[0]["run_id"] == "r-test-119"  # newest first
    last = list_runs(store, RunFilter(page=99))  # clamped to the last page
    assert last.page == 3 and len(last.rows) == 120 - 2 * PAGE_SIZE
    assert last.rows[-1]["run_id"] == "r-test-000"
    failed_b = list_runs(store, RunFilter(status="failed", payload="b"))
    assert failed_b.total == 30 and all(r["status"] == "failed" for r in failed_b.rows)
    assert list_runs(store, RunFilter(batch="b-1")).total == 10
    assert [r["run_id"] for r in list_runs(store, RunFilter(q="t-07")).rows] == [
        f"r-test-{i:03d}" for i in range(79, 69, -1)
    ]
    assert list_runs(store, RunFilter(q="%")).total == 0  # LIKE wildcards are literal
    march = list_runs(store, RunFilter(since="2026-03-01", until="2026-03-31"))
    assert march.total == 31
    assert sorted(first.facets["payload"]) == ["a", "b"] and first.facets["batch"] == ["b-1"]
    with pytest.raises(ConfigError):
        list_runs(store, RunFilter(since="March"))


def test_tokens_measured_by_the_gateway_are_told_apart_from_the_sandboxs_claim():
    from orchestrator.view.runs import host_token_usage, reported_token_usage

    measured = {"input_tokens": 120, "output_tokens": 30, "total_tokens": 150}
    gateway_result = {
        "token_usage": measured,
        "token_usage_source": "gateway",
        "token_usage_reported": {"input_tokens": 1, "output_tokens": 1},
        "token_usage_mismatch": True,
        "gateway": {"enabled": True, "calls": 3},
    }
    assert host_token_usage(gateway_result, [])["input_tokens"] == 120
    assert host_token_usage(gateway_result, [])["calls"] == 3
    assert reported_token_usage(gateway_result) == {"input_tokens": 1, "output_tokens": 1}
    # A run still going: the gateway's calls so far; a run without one: nothing measured.
    live = [
        {"type": "model_call", "source": "gateway", "input_tokens": 10, "output_tokens": 2},
        {"type": "model_call", "source": "gateway", "input_tokens": 5, "output_tokens": 1},
        {"type": "step", "source": "sandbox", "input_tokens": 99},
    ]
    assert host_token_usage(None, live) == {"input_tokens": 15, "output_tokens": 3, "calls": 2}
    sandbox_only = {"token_usage": {"input_tokens": 7, "output_tokens": 2}}
    assert host_token_usage(sandbox_only, []) is None
    assert reported_token_usage(sandbox_only) == {"input_tokens": 7, "output_tokens": 2}


def test_duration_bins_are_round_and_not_finer_than_a_tenth() -> None:
    """Bins a person reads at a glance (before: (max - min) / 12, such as
    0.0042 s for tasks of 0.14 to 0.19 s)."""
    from orchestrator.view.charts import nice_width

    assert nice_width(0.0042) == 0.1
    assert nice_width(0.23) == 0.5 and nice_width(1.7) == 2 and nice_width(30) == 50


def test_a_run_page_shows_where_bound_secrets_went_and_what_was_refused(tmp_path):
    """The interceptor's `secret_injected` and `secret_not_bound` events, as the host writes
    them, on the run's page (names, hosts, places, agent and step; never a value)."""
    from orchestrator.records.store import Store
    from orchestrator.view.render import Links, render
    from orchestrator.view.runs import load_run

    store = Store(tmp_path)
    record = store.create_run("r-secrets", status="succeeded", payload="secret_probe")
    events = [
        {
            "type": "secret_injected",
            "source": "interceptor",
            "secret": "ANALYTICS_TOKEN",
            "host": "api.example.com",
            "place": "header:X-Api-Key",
            "count": 3,
            "first_ts": 1.0,
            "agent": "manager",
            "step_number": 1,
        },
        {
            "type": "egress_blocked",
            "source": "egress",
            "verdict": "denied",
            "reason": "secret_not_bound",
            "secret": "ANALYTICS_TOKEN",
            "host": "other.example.net",
            "place": "query",
            "detail": "other.example.net is not a host ANALYTICS_TOKEN is bound to",
            "ts": 2.0,
            "agent": "manager",
            "step_number": 2,
        },
        {"type": "egress_blocked", "source": "egress", "host": "evil.example", "ts": 3.0},
    ]
    (record / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    view = load_run(store, "r-secrets")
    assert view is not None
    page = " ".join(render("run_body.html", Links(), run=view).split())
    assert (
        "[manager step 1] injected <code>ANALYTICS_TOKEN</code> <code>api.example.com</code> "
        "header:X-Api-Key" in page
    )
    assert "3 requests" in page
    assert (
        "[manager step 2] refused <code>ANALYTICS_TOKEN</code> to <code>other.example.net</code> "
        "query" in page
    )
    assert "secret_not_bound (other.example.net is not a host" in page
    assert "blocked <code>evil.example</code>" in page  # squid's refusals as before


def test_a_batch_folder_is_shown_as_its_user_knows_it(tmp_path, monkeypatch):
    """Relative to the folder the viewer was started in when inside it, `~/...` inside the
    home folder, else whole; the batch pages show it so."""
    from orchestrator.view.render import folder

    home, work = tmp_path / "home", tmp_path / "home" / "project"
    (work / "runs" / "eval-1").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    assert folder(work / "runs" / "eval-1") == "runs/eval-1"
    assert folder(str(home / "other" / "eval-2")) == "~/other/eval-2"
    assert folder("/srv/evals/eval-3") == "/srv/evals/eval-3"
    assert folder(None) == ""
    monkeypatch.chdir("/")
    assert folder(work / "runs" / "eval-1") == "~/project/runs/eval-1"
