"""The documentation site in a real browser (Debian's chromium, headless, driven by Selenium),
served from the built site on 127.0.0.1: the home page, a guide, the CLI reference and the
performance page render with no console error and load nothing from another host; the
navigation and the search (Material's JavaScript, offline) work. No Docker needed.
Screenshots go to $DOCS_SHOTS (default /tmp/docs-shots)."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.chromium import headless_chromium
from tests.project.test_docs import build_site

pytestmark = pytest.mark.browser

SHOTS = Path(os.environ.get("DOCS_SHOTS", "/tmp/docs-shots"))


def until(condition: Callable[[], Any], what: str, timeout: float = 15) -> Any:
    """Poll `condition` until it is truthy; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = condition()
        except Exception:  # a page mid-load: an element not there yet
            value = None
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No access log on the test's output."""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The built site, served on 127.0.0.1 (Material's search needs http, not file://)."""
    root = tmp_path_factory.mktemp("docs") / "site"
    built = build_site(root)
    assert built.returncode == 0, built.stdout + built.stderr
    handler = functools.partial(QuietHandler, directory=str(root))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with headless_chromium(1400, 1000, console=True) as driver:
        SHOTS.mkdir(parents=True, exist_ok=True)
        yield driver


def open_page(driver: Any, url: str) -> str:
    """Load a page, wait for Material's JavaScript to have set it up; its h1."""
    from selenium.webdriver.common.by import By

    driver.get(url)
    until(
        lambda: driver.execute_script("return document.readyState") == "complete",
        f"{url} to load",
    )
    until(lambda: driver.find_elements(By.CSS_SELECTOR, ".md-search__form"), "the search form")
    return driver.find_element(By.CSS_SELECTOR, "article h1").text


def errors(driver: Any) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def foreign_requests(driver: Any, site: str) -> list[str]:
    names = driver.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)"
    )
    return [n for n in names if not n.startswith((site, "data:", "blob:"))]


@pytest.mark.parametrize(
    ("path", "title", "shot"),
    [
        ("/", "orchestrator", "home"),
        ("/guides/batch/", "Batch evaluation", "guide-batch"),
        ("/reference/cli/", "Command line", "reference-cli"),
        ("/performance/", "Performance", "performance"),
    ],
)
def test_page_renders_without_console_errors(
    browser: Any, site: str, path: str, title: str, shot: str
) -> None:
    browser.get_log("browser")  # drop what earlier pages logged
    assert open_page(browser, site + path).startswith(title)
    browser.save_screenshot(str(SHOTS / f"{shot}.png"))
    assert errors(browser) == []
    assert foreign_requests(browser, site) == []


def test_navigation_reaches_a_guide_and_back(browser: Any, site: str) -> None:
    from selenium.webdriver.common.by import By

    open_page(browser, site + "/")
    link = browser.find_element(By.CSS_SELECTOR, "nav.md-nav a[href$='guides/running/']")
    browser.execute_script("arguments[0].click()", link)  # collapsed sections: click by script
    until(lambda: browser.current_url.endswith("/guides/running/"), "the guide's address")
    heading = until(
        lambda: browser.find_element(By.CSS_SELECTOR, "article h1").text, "the guide's heading"
    )
    assert heading.startswith("Running a payload or a program")
    nxt = browser.find_element(By.CSS_SELECTOR, "a.md-footer__link--next")
    browser.execute_script("arguments[0].click()", nxt)
    until(lambda: browser.current_url.endswith("/guides/writing/"), "the next page")
    assert errors(browser) == []


def test_search_finds_a_page_and_opens_it(browser: Any, site: str) -> None:
    from selenium.webdriver.common.by import By

    open_page(browser, site + "/")
    browser.find_element(By.CSS_SELECTOR, "label.md-search__icon, .md-search__input").click()
    field = browser.find_element(By.CSS_SELECTOR, "input.md-search__input")
    field.send_keys("max-cost")

    def batch_guide_found() -> list[str] | None:
        """The results' links once the batch guide is among them (the list re-renders as
        the index answers, so links are read afresh each time)."""
        links = browser.find_elements(By.CSS_SELECTOR, ".md-search-result__item a")
        targets = [a.get_attribute("href") for a in links]
        return targets if any("guides/batch/" in t for t in targets) else None

    targets = until(batch_guide_found, "the batch guide among the search results")
    browser.save_screenshot(str(SHOTS / "search.png"))
    first = targets[0]
    browser.get(first)
    until(lambda: browser.current_url.split("#")[0] == first.split("#")[0], "the result's page")
    assert errors(browser) == []
