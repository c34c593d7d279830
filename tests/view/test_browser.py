"""`orchestrator view` in a real browser (Debian's chromium, headless, driven by Selenium) over
a store made by real runs and real batches: each page shows what a person looks for, a live
run updates until it ends without a reload, hostile agent output runs nothing, and the static
export shows the same from file://. Screenshots go to .ci/output/screenshots/."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import docker
import pytest

from orchestrator.labels import LABEL_RUN_ID
from orchestrator.records.store import Store
from tests.chromium import headless_chromium
from tests.conftest import (
    PAYLOADS,
    REPO,
    TEST_PAYLOADS,
    cli,
    running_sandboxes,
    start_cli,
    wait_for,
)

pytestmark = [pytest.mark.docker, pytest.mark.browser]

SHOTS = REPO / ".ci" / "output" / "screenshots"
#: The viewer's pictures in the documentation (docs/guides/viewer.md): these screenshots,
#: copied each time they are taken, so the pictures show the pages as they are.
DOCS_PICTURES = {"run": REPO / "docs" / "view-run.png", "batch": REPO / "docs" / "view-batch.png"}

TASKS = [
    {"id": "mul", "task": "6*7?", "additional_args": {"op": "mul", "a": 6, "b": 7}, "expected": 42},
    {
        "id": "off-by-one",
        "task": "1+2?",
        "additional_args": {"op": "add", "a": 1, "b": 2},
        "expected": 4,
    },
    {"id": "add", "task": "2+2?", "additional_args": {"op": "add", "a": 2, "b": 2}, "expected": 4},
    {"id": "loops", "task": "loop", "additional_args": {"op": "loop"}, "expected": 1},
]


@dataclass
class World:
    team_run: str
    hostile_run: str
    batch_a: Path
    batch_b: Path
    batch_a_id: str
    schedules: Path
    root: Path
    #: pytest's temporary folder for the session: no docs picture may show it.
    basetemp: Path


def run_json(*args: str) -> dict:
    done = cli("run", *args, "--model", "mock", "--json")
    assert done.stdout, done.stderr
    return json.loads(done.stdout)


def batch(root: Path, name: str, tasks: list[dict]) -> Path:
    """A batch's output folder, `batches/NAME` under `root`, where a user keeps theirs (the
    viewer runs in `root` and shows it so)."""
    path = root / f"{name}.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    out = root / "batches" / name
    done = cli(
        "batch",
        str(TEST_PAYLOADS / "batch_math"),
        str(path),
        "-o",
        str(out),
        "--model",
        "mock",
        "-q",
    )
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, agent_image: str) -> World:
    """The store every test here looks at: a multi-agent run, a hostile run, two batches over
    the same tasks (the second expects 3 for 1+2, so one task flips) and a schedule firing."""
    root = tmp_path_factory.mktemp("view")
    team = run_json(str(PAYLOADS / "research_team"))
    assert team["status"] == "succeeded"
    hostile = run_json(str(TEST_PAYLOADS / "hostile_output"))
    assert "<script>" in hostile["answer"]
    batch_a = batch(root, "batch-a", TASKS)
    flipped = [dict(t, expected=3) if t["id"] == "off-by-one" else t for t in TASKS]
    batch_b = batch(root, "batch-b", flipped)
    schedules = root / "schedules.toml"
    schedules.write_text(
        '[[schedule]]\nname = "nightly-team"\ncron = "30 2 * * *"\ntimezone = "UTC"\n'
        f'payload = "{PAYLOADS / "research_team"}"\nmodel = "mock"\n'
    )
    fired = cli("schedule", "run", "nightly-team", "--file", str(schedules), "-q")
    assert fired.returncode == 0, fired.stderr
    rescored = cli("batch", "rescore", str(batch_a), "--scorer", "numeric", "--tolerance", "0.5")
    assert rescored.returncode == 0, rescored.stderr
    batch_a_id = json.loads((batch_a / "batch.json").read_text())["batch_id"]
    return World(
        team["run_id"],
        hostile["run_id"],
        batch_a,
        batch_b,
        batch_a_id,
        schedules,
        root,
        tmp_path_factory.getbasetemp(),
    )


def read_line(proc: subprocess.Popen[str], timeout: float = 30) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "no output from `orchestrator view`"
    return proc.stdout.readline()


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def server(world: World) -> Iterator[str]:
    """The viewer over the world, started in its folder as a user starts it in their project
    (batch folders shown relative to it: `batches/batch-a`)."""
    proc = start_cli(
        "view",
        str(world.batch_a),
        str(world.batch_b),
        "--port",
        "0",
        "--schedules",
        str(world.schedules),
        cwd=world.root,
    )
    try:
        line = read_line(proc)
        assert line.startswith("orchestrator view: http://127.0.0.1:"), line
        yield line.split(": ", 1)[1].strip().rstrip("/")
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    # the console is kept (the tests check it), local files may load local files (--export)
    with headless_chromium(1400, 1800, "--allow-file-access-from-files", console=True) as driver:
        SHOTS.mkdir(parents=True, exist_ok=True)
        yield driver


def load(driver, url: str) -> None:
    driver.get(url)
    wait_for(lambda: driver.execute_script("return document.body.dataset.ready"), timeout=10)


def text(driver, css: str) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, css).text


def live_text(driver, css: str) -> str | None:
    """The rendered text of the element `css` names, read in one step inside the page: a
    live page replaces its elements as the run goes, and an element found a moment before
    may be gone when its text is asked for (selenium's StaleElementReferenceException)."""
    return driver.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.innerText.trim() : null",
        css,
    )


def all_text(driver, css: str) -> list[str]:
    from selenium.webdriver.common.by import By

    return [e.get_attribute("textContent") for e in driver.find_elements(By.CSS_SELECTOR, css)]


def docs_shot(driver, name: str, world: World) -> None:
    """A screenshot that becomes a docs picture: what it shows is what a user would see, so
    no temporary folder of the test session is on the page."""
    page = driver.execute_script("return document.body.innerText")
    for temporary in (tempfile.gettempdir().rstrip("/") + "/", str(world.basetemp)):
        assert temporary not in page, f"{temporary} on the page of docs picture {name}"
    shot(driver, name)


def shot(driver, name: str) -> None:
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1400, min(max(900, height + 40), 6000))
    driver.save_screenshot(str(SHOTS / f"{name}.png"))
    if name in DOCS_PICTURES and os.environ.get("UPDATE_SCREENSHOTS"):  # else the tree stays clean
        shutil.copyfile(SHOTS / f"{name}.png", DOCS_PICTURES[name])
    driver.set_window_size(1400, 1800)


def check_run_page(driver, world: World) -> None:
    assert text(driver, "#answer") == "48"
    assert text(driver, "#run-status") == "succeeded"
    names = all_text(driver, ".agent-name")
    assert names[:2] == ["manager", "librarian"]
    code = all_text(driver, "pre.code")
    assert any('lookup_landmark(name="Golden Gate Bridge")' in c for c in code)
    assert any('final_answer(years_between(start=years["Eiffel Tower"]' in c for c in code)
    # The librarian is nested inside the manager's first step, not flattened after it.
    nested = driver.execute_script(
        "return Array.from(document.querySelectorAll('details.step details.agent "
        ".agent-name')).map(e => e.textContent)"
    )
    assert nested == ["librarian"]


def test_runs_page_filters_and_links(browser, server: str, world: World):
    load(browser, f"{server}/")
    assert world.team_run in all_text(browser, "table.runs td a")
    shot(browser, "runs")
    load(browser, f"{server}/?payload=hostile_output")
    runs = all_text(browser, "table.runs td:first-child")
    assert runs == [world.hostile_run]
    load(browser, f"{server}/?q={world.team_run[-8:]}")
    assert all_text(browser, "table.runs td:first-child") == [world.team_run]


def test_run_page_shows_the_tree_and_every_step(browser, server: str, world: World):
    load(browser, f"{server}/run/{world.team_run}")
    check_run_page(browser, world)
    assert "mock:scripted" in text(browser, "dl.facts")
    browser.execute_script("document.querySelector('button.expand-all').click()")
    docs_shot(browser, "run", world)


def test_hostile_output_runs_nothing(browser, server: str, world: World):
    load(browser, f"{server}/run/{world.hostile_run}")
    answer = text(browser, "#answer")
    assert answer.startswith('<script>window.__pwned = "answer"</script><img src=x onerror=')
    browser.execute_script("document.querySelector('button.expand-all').click()")
    time.sleep(0.5)  # an injected image would have failed to load by now
    assert browser.execute_script("return window.__pwned === undefined")
    assert not browser.execute_script("return document.querySelector('main script, main img')")
    assert "onerror=" in " ".join(all_text(browser, "pre.observations"))
    assert '<script>window.__pwned = "stderr"</script>' in browser.execute_script(
        "return document.getElementById('stderr').textContent"
    )
    shot(browser, "hostile")


def test_batch_page_wrong_first_sortable_and_charts(browser, server: str, world: World):
    load(browser, f"{server}/batch/{world.batch_a_id}")
    assert text(browser, "#accuracy").startswith("50.0%")
    assert "95% CI 15.0%–85.0%" in text(browser, "#accuracy")
    assert text(browser, "dd.rescore").startswith("75.0% (95% CI")  # batch rescore's summary
    assert "scorer numeric" in text(browser, "dd.rescore")
    ids = all_text(browser, "#tasks tbody td.task-id")
    assert ids[:2] == ["loops", "off-by-one"] and sorted(ids[2:]) == ["add", "mul"]
    rows = all_text(browser, "#tasks tbody tr")
    assert "3" in rows[1] and "4" in rows[1]  # answer vs expected of the wrong task
    for name in ("status", "duration", "tokens"):
        width = browser.execute_script(
            f"const i = document.getElementById('chart-{name}'); "
            "return i && i.complete ? i.naturalWidth : 0"
        )
        assert width > 100, name
    assert text(browser, "dl.facts dd") == "batches/batch-a"  # the folder, as its user has it
    docs_shot(browser, "batch", world)
    browser.execute_script("document.querySelector('#tasks th').click()")
    assert all_text(browser, "#tasks tbody td.task-id") == sorted(ids)
    href = browser.execute_script("return document.querySelector('#tasks tbody a').href")
    load(browser, href)
    assert text(browser, "#run-status") in ("failed", "succeeded")


def test_comparison_of_two_batches(browser, server: str, world: World):
    load(browser, f"{server}/batch/{world.batch_a_id}")
    browser.execute_script("document.querySelector('form.compare').submit()")
    wait_for(lambda: "/compare" in browser.current_url, timeout=10)
    wait_for(lambda: browser.execute_script("return document.body.dataset.ready"), timeout=10)
    assert "50.0% → 75.0%" in text(browser, "#cmp-accuracy")
    assert "+25.0 points" in text(browser, "#cmp-accuracy")
    assert text(browser, "#mcnemar").startswith("p = 1")
    assert "off-by-one" in " ".join(all_text(browser, "table.flips td"))
    shot(browser, "compare")


def test_schedules_page(browser, server: str, world: World):
    load(browser, f"{server}/schedules")
    page = text(browser, "main")
    assert "nightly-team" in page and "30 2 * * *" in page
    assert "T02:30+00:00" in page  # next fire times
    assert "succeeded" in page  # the last outcome
    shot(browser, "schedules")


def paused(docker_client, container_id: str) -> bool:
    """Pause the container; False when the kernel's freezer gave up this time (cgroup v1's
    "unable to freeze" while a busy machine's sandbox is mid-fork: a try again, not a failure)."""
    try:
        docker_client.api.pause(container_id)
    except docker.errors.APIError as exc:
        if "unable to freeze" in str(exc):
            return False
        raise
    return True


def test_live_run_updates_until_it_ends(
    browser, server: str, world: World, docker_client, store_label: str, no_leftovers
):
    proc = start_cli(
        "run", str(TEST_PAYLOADS / "sleeper"), "--model", "mock", "--arg", "seconds=6", "-q"
    )
    try:
        # The run's sandbox is paused while the page loads, so the page meets the run still
        # going however long a busy machine takes to load it; unpaused, the run ends itself.
        sandbox = wait_for(
            lambda: (running_sandboxes(docker_client, store_label) or [None])[0], timeout=120
        )
        wait_for(lambda: paused(docker_client, sandbox["Id"]), timeout=60, interval=0.2)
        try:
            load(browser, f"{server}/run/{sandbox['Labels'][LABEL_RUN_ID]}")
            assert live_text(browser, "#run-status") in ("running", "preparing")
            browser.execute_script("window.__sameDocument = 42")
        finally:
            docker_client.api.unpause(sandbox["Id"])
        wait_for(
            lambda: live_text(browser, "#run-status") == "succeeded", timeout=120, interval=0.5
        )
        assert browser.execute_script("return window.__sameDocument") == 42  # no reload
        assert live_text(browser, "#answer") == "awake"
        assert browser.execute_script("return document.body.dataset.runEnded") == "1"
        assert proc.wait(60) == 0
    finally:
        stop(proc)


def console(driver) -> list[str]:
    """What the page wrote to the browser's console since the last call (errors, warnings,
    the CSP's complaints)."""
    return [entry["message"] for entry in driver.get_log("browser")]


def test_static_export_opens_from_file(browser, world: World):
    folder = world.root / "export"
    done = cli(
        "view", "--export", str(folder), world.team_run, world.hostile_run, str(world.batch_a)
    )
    assert done.returncode == 0, done.stderr
    console(browser)  # what earlier tests left
    load(browser, (folder / f"run-{world.team_run}.html").as_uri())
    check_run_page(browser, world)
    assert console(browser) == []  # no console error on an exported page
    load(browser, (folder / f"run-{world.hostile_run}.html").as_uri())
    assert text(browser, "#answer").startswith("<script>")
    assert browser.execute_script("return window.__pwned === undefined")
    load(browser, (folder / f"batch-{world.batch_a_id}.html").as_uri())
    assert all_text(browser, "#tasks tbody td.task-id")[:2] == ["loops", "off-by-one"]
    assert browser.execute_script("return document.getElementById('chart-tokens').naturalWidth")
    shot(browser, "export-batch")
    assert console(browser) == []
    load(browser, (folder / "index.html").as_uri())
    assert world.team_run in all_text(browser, "table.runs td a")
    assert console(browser) == []
    bad = cli("view", "--export", str(folder), "no-such-run")
    assert bad.returncode == 2 and "neither a run" in bad.stderr


def test_the_policy_alone_stops_markup_that_got_through(browser, tmp_path: Path):
    """Defence in depth: were escaping ever missed, the pages' Content-Security-Policy still
    keeps inline script and event handlers from running (shown against the same page
    without the policy, where they do run)."""
    from orchestrator.view.render import CSP_META as CSP

    hostile = (
        '<img src="x" onerror="window.__pwned = 1"><script>window.__pwned = 2</script>'
        '<svg onload="window.__pwned = 3"></svg>'
    )
    page = tmp_path / "page.html"
    for policy, expected in (
        (f'<meta http-equiv="Content-Security-Policy" content="{CSP}">', True),
        ("", False),
    ):
        page.write_text(f"<!doctype html><html><head>{policy}</head><body>{hostile}</body></html>")
        browser.get(page.as_uri())
        time.sleep(0.3)
        assert browser.execute_script("return window.__pwned === undefined") is expected


def test_pages_read_at_1400_px_without_a_click(browser, server: str, world: World):
    """In the browser at 1400 px: run ids and dates on one
    line each (before: 3-4 lines, about 9 runs a screen); a run's failed step and the agent
    it called visible as the page opens; a failed run shows no empty green answer; the batch
    page shows each task's text and arguments; the comparison names its sides."""
    from selenium.webdriver.common.by import By

    load(browser, f"{server}/")
    # The text's own height, not the cell's: a row is as tall as its tallest cell, and the
    # session's store holds other tests' runs too (a long error wraps its own cell only).
    lines = browser.execute_script(
        "const cells = Array.from(document.querySelectorAll('table.runs tbody tr'))"
        "  .map(r => [r.cells[0], r.cells[1]]).flat();"
        "return cells.map(c => { const text = document.createRange();"
        "  text.selectNodeContents(c);"
        "  return Math.round(text.getBoundingClientRect().height"
        "    / parseFloat(getComputedStyle(c).lineHeight)); })"
    )
    assert lines and max(lines) == 1, lines  # one line of text each
    assert browser.execute_script(
        "return document.documentElement.scrollWidth <= window.innerWidth"
    ), "the runs table is wider than the window"
    shot(browser, "runs-1400")

    load(browser, f"{server}/run/{world.team_run}")  # no click: the tree as it opens
    failed_steps = browser.find_elements(By.CSS_SELECTOR, "details.step.has-error")
    assert failed_steps and all(s.get_attribute("open") is not None for s in failed_steps)
    errors = browser.find_elements(By.CSS_SELECTOR, "details.step.has-error .field.error pre")
    assert any(e.is_displayed() and "InterpreterError" in e.text for e in errors)
    librarian = browser.find_elements(By.CSS_SELECTOR, "details.step details.agent .agent-name")
    assert librarian and librarian[0].is_displayed()
    shot(browser, "run-unclicked")

    failed = next(
        r for r in Store().list_runs(limit=0, status="failed") if r["batch"] == world.batch_a_id
    )
    load(browser, f"{server}/run/{failed['run_id']}")
    answer = browser.find_element(By.CSS_SELECTOR, "#answer")
    assert "none" in answer.get_attribute("class").split()
    assert answer.text == "no answer: the run failed (see the error below)"
    assert "Reached max steps" in text(browser, "#error")
    shot(browser, "failed-run")

    load(browser, f"{server}/batch/{world.batch_a_id}")
    by_id = dict(
        zip(
            all_text(browser, "#tasks tbody td.task-id"),
            all_text(browser, "#tasks tbody td.task-text"),
            strict=True,
        )
    )
    assert by_id["mul"].startswith("6*7?") and '"op": "mul"' in by_id["mul"], by_id
    chart = browser.find_element(By.ID, "chart-status")
    assert chart.get_attribute("alt") == "Tasks by verdict"
    shot(browser, "batch-tasks")
    browser.execute_script("document.querySelector('form.compare').submit()")
    wait_for(lambda: "/compare" in browser.current_url, timeout=10)
    wait_for(lambda: browser.execute_script("return document.body.dataset.ready"), timeout=10)
    heading = text(browser, "h1")
    assert heading.startswith("A batch-a (mock:scripted, scorer exact) vs B batch-b"), heading


def test_run_page_shows_where_bound_secrets_went(
    browser, server: str, world: World, docker_client, monkeypatch, tmp_path: Path
):
    """A bound-secret run (tests/backends/docker/test_secret_runs.py's probe, against its
    HTTPS server): the page lists where the value was injected and what was refused, by secret,
    host and place, and never holds the value."""
    from orchestrator.backends.docker.backend import DockerBackend
    from orchestrator.backends.docker.interceptor import (
        InterceptorRoute,
        ensure_interceptor_image,
    )
    from tests.backends.docker.test_secret_runs import BOUND, OTHER, VALUE, probe
    from tests.https_upstream import https_upstream
    from tests.model_server import docker_bridge_address

    ensure_interceptor_image(docker_client, print)
    monkeypatch.setenv("ANALYTICS_TOKEN", VALUE)
    address = docker_bridge_address()
    with https_upstream(tmp_path, [BOUND, OTHER], address=address) as (up, ca):
        route = InterceptorRoute(f"http://{address}:{up.proxy_port}", ca.read_text())
        backend = DockerBackend(docker_client, interceptor_route=route)
        attempts = [{"url": f"https://{BOUND}/data"}, {"url": f"https://{OTHER}/header"}]
        result = probe(backend, attempts)
    assert result.status == "succeeded", result.error
    load(browser, f"{server}/run/{result.run_id}")
    assert text(browser, "#secrets-injected").startswith(
        f"[manager step 1] injected ANALYTICS_TOKEN {BOUND} header:X-Api-Key 1 request, first "
    )
    refused = text(browser, "#egress")
    assert f"refused ANALYTICS_TOKEN to {OTHER} header:X-Api-Key secret_not_bound" in refused
    assert VALUE not in browser.page_source
    shot(browser, "run-secrets")
