"""Headless Chromium for the browser tests (the viewer, the docs site, Phoenix's UI): Debian's
`chromium` and `chromium-driver`, driven by Selenium (Playwright's browser download cannot be
reached here; scripts/test.sh installs both packages, or leaves the tests marked `browser` out)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
#: What every test's browser runs with: headless, and no sandbox of its own (it runs as root
#: in CI, where Chromium refuses its sandbox), /dev/shm and the GPU left alone.
BASE_FLAGS = ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu")


@contextmanager
def headless_chromium(width: int, height: int, *flags: str, console: bool = False) -> Iterator[Any]:
    """A Selenium driver of a fresh headless Chromium window `width` x `height` (and `flags`
    beyond BASE_FLAGS), quit on exit. `console`: keep the page's console log, for tests that
    check it holds no error. Fails the test when Chromium or its driver is missing."""
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.fail(
            "chromium and chromium-driver are needed (apt-get install chromium "
            "chromium-driver; scripts/test.sh installs them)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*BASE_FLAGS, f"--window-size={width},{height}", *flags):
        options.add_argument(flag)
    if console:
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
