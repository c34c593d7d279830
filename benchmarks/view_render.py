"""The viewer at scale: the runs page over a store of 10,000 runs, and the page of one run of
500 steps (a manager and 20 calls of a managed agent), each must render in under 1 s.

The records are synthesised straight into a fresh store (index rows, and for the big run its
events.jsonl, result.json and stderr.log), as real runs would have written them; 10,000 real
sandboxes would measure Docker, not the viewer.

Measured for each page, median of --repeat:
  floor    the data access alone, in-process (the index query; reading and parsing the record)
  server   an HTTP GET to a real `orchestrator view` (uvicorn) until the last byte
  browser  headless Chromium (Selenium): navigation start to the load event, from the
           browser's own Navigation Timing

    python benchmarks/view_render.py [--runs 10000] [--steps 500] [--repeat 5]

Writes benchmarks/results/view_render.json and .md.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import context  # noqa: E402

from orchestrator.records.store import COLUMNS, Store  # noqa: E402
from orchestrator.view.queries import RunFilter, list_runs  # noqa: E402
from orchestrator.view.runs import load_run  # noqa: E402

STATUSES = ("succeeded", "succeeded", "succeeded", "failed", "timed_out", "infra_error")
PAYLOADS = ("research_team", "data_analyst", "batch_math", "sleeper")


def synthesise_runs(store: Store, count: int) -> None:
    """`count` ended runs over the last 30 days, spread over payloads, statuses and batches."""
    now = time.time()
    rows = []
    for i in range(count):
        created = now - (count - i) * (30 * 86400 / count)
        status = STATUSES[i % len(STATUSES)]
        rows.append(
            {
                "run_id": f"r-bench-{i:06d}",
                "created_at": created,
                "ended_at": created + 3,
                "status": status,
                "payload": PAYLOADS[i % len(PAYLOADS)],
                "model": "mock:scripted",
                "backend": "docker",
                "network": "none",
                "task": f"task number {i}",
                "answer": json.dumps(i),
                "error": None if status == "succeeded" else "AgentError",
                "exit_code": 0 if status == "succeeded" else 1,
                "duration": 2.5 + i % 7,
                "input_tokens": 2000 + i % 900,
                "output_tokens": 60 + i % 40,
                "schedule": None,
                "batch": f"b-bench-{i // 100:03d}" if i % 3 == 0 else None,
                "owner": None,
                "record_dir": str(store.runs_dir / f"r-bench-{i:06d}"),
            }
        )
    marks = ", ".join("?" for _ in COLUMNS)
    with store.connect() as db:
        db.executemany(
            f"INSERT INTO runs ({', '.join(COLUMNS)}) VALUES ({marks})",
            [[row[c] for c in COLUMNS] for row in rows],
        )


def step_event(seq: int, agent: str, number: int) -> dict[str, Any]:
    code = "\n".join(f"value_{k} = compute({number}, {k})  # step {number}" for k in range(8))
    return {
        "type": "step",
        "seq": seq,
        "ts": time.time(),
        "run_id": "r-bench-big",
        "agent": agent,
        "step_number": number,
        "step_type": "action",
        "model_output": f"Thought: step {number} of {agent}; "
        + "reasoning " * 80
        + f"\n<code>\n{code}\n</code>",
        "code": code,
        "observations": "Execution logs:\n" + "\n".join(f"line {k}: " + "x" * 60 for k in range(8)),
        "error": {"type": "AgentExecutionError", "message": "boom"} if number % 25 == 0 else None,
        "token_usage": {"input_tokens": 2400, "output_tokens": 70},
        "duration": 0.8,
        "is_final_answer": False,
    }


def synthesise_big_run(store: Store, steps: int) -> str:
    """One run of `steps` steps: the manager's, and in every 20th step a call of a managed
    agent that takes 5 steps of its own."""
    run_id = "r-bench-big"
    directory = store.create_run(
        run_id,
        status="succeeded",
        payload="research_team",
        model="mock:scripted",
        backend="docker",
        network="none",
        task="A long task",
        ended_at=time.time(),
        duration=400.0,
        exit_code=0,
        answer=json.dumps("done"),
    )
    events: list[dict[str, Any]] = [
        {
            "type": "run_start",
            "seq": 0,
            "ts": time.time(),
            "run_id": run_id,
            "agents": [{"name": "manager"}, {"name": "helper"}],
        }
    ]
    made, number = 0, 0
    while made < steps:
        number += 1
        if number % 20 == 0 and made + 6 <= steps:
            events.append(
                {
                    "type": "managed_agent_call",
                    "seq": len(events),
                    "caller": "manager",
                    "agent": "helper",
                    "task": f"help with {number}",
                }
            )
            for k in range(1, 6):
                events.append(step_event(len(events), "helper", k))
            made += 5
            events.append(
                {
                    "type": "managed_agent_result",
                    "seq": len(events),
                    "agent": "helper",
                    "caller": "manager",
                    "output": "helped",
                    "duration": 4.0,
                }
            )
        events.append(step_event(len(events), "manager", number))
        made += 1
    events.append({"type": "run_end", "seq": len(events), "state": "success", "answer": "done"})
    (directory / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (directory / "stderr.log").write_text(("log line " + "y" * 90 + "\n") * 2000)
    (directory / "result.json").write_text(
        json.dumps(
            {
                "run_id": run_id,
                "status": "succeeded",
                "answer": "done",
                "exit_code": 0,
                "token_usage": {"input_tokens": 2400 * steps, "output_tokens": 70 * steps},
                "timings": {"created": 0, "started": 1, "ended": 401, "duration": 400.0},
                "steps": steps,
            }
        )
    )
    return run_id


def median_of(repeat: int, function: Any) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def http_get(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path)
    response = conn.getresponse()
    body = response.read()
    conn.close()
    assert response.status == 200, (path, response.status)
    return len(body)


def browser_load(url: str, repeat: int) -> float:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        driver.get(url)  # warm: the first load also starts the renderer
        times = []
        for _ in range(repeat):
            driver.get(url)
            times.append(
                driver.execute_script(
                    "const n = performance.getEntriesByType('navigation')[0];"
                    "return n.loadEventEnd - n.startTime;"
                )
                / 1000
            )
        return statistics.median(times)
    finally:
        driver.quit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10000)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="orchestrator-view-bench-"))
    store = Store(home)
    synthesise_runs(store, args.runs)
    big = synthesise_big_run(store, args.steps)
    view = load_run(store, big)
    assert view is not None and view.steps == args.steps, view and view.steps
    pages = {
        f"runs page ({args.runs} runs)": ("/", lambda: list_runs(store, RunFilter())),
        f"runs page, filtered (status, payload; {args.runs} runs)": (
            "/?status=failed&payload=data_analyst",
            lambda: list_runs(store, RunFilter(status="failed", payload="data_analyst")),
        ),
        f"runs page, last page ({args.runs} runs)": (
            "/?page=200",
            lambda: list_runs(store, RunFilter(page=200)),
        ),
        f"run page ({args.steps} steps)": (f"/run/{big}", lambda: load_run(store, big)),
    }
    env = {**os.environ, "ORCHESTRATOR_HOME": str(home), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "view", "--port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    rows = []
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the viewer did not start"
        url = proc.stdout.readline().split(": ", 1)[1].strip().rstrip("/")
        port = int(url.rsplit(":", 1)[1])
        for name, (path, floor) in pages.items():
            size = http_get(port, path)  # warm
            row = {
                "page": name,
                "html_kb": round(size / 1024),
                "floor_s": round(median_of(args.repeat, floor), 4),
                "server_s": round(median_of(args.repeat, lambda p=path: http_get(port, p)), 4),
                "browser_s": round(browser_load(url + path, args.repeat), 4),
            }
            rows.append(row)
            print(row, flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(10)
        shutil.rmtree(home, ignore_errors=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    report = {**context.header(), "repeat": args.repeat, "rows": rows}
    (RESULTS / "view_render.json").write_text(json.dumps(report, indent=2))
    lines = [
        "# Viewer render times",
        "",
        f"{context.summary(report)}; median of {args.repeat}.",
        "",
        "| page | HTML | floor (data access) | server (HTTP GET) | browser (load event) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['page']} | {r['html_kb']} KiB | {r['floor_s'] * 1000:.0f} ms "
            f"| {r['server_s'] * 1000:.0f} ms | {r['browser_s'] * 1000:.0f} ms |"
        )
    (RESULTS / "view_render.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    slow = [r["page"] for r in rows if max(r["server_s"], r["browser_s"]) >= 1.0]
    if slow:
        sys.exit(f"over 1 s: {', '.join(slow)}")


if __name__ == "__main__":
    main()
