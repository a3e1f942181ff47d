"""Debian's Chromium, headless, driven by Selenium through Debian's chromedriver: the console's browser tests,
its screenshots and its benchmark open their pages with it.

Nothing is downloaded. The browser and its driver are found on PATH or at Debian's paths
(``scripts/setup-system`` installs both packages) and handed to Selenium explicitly, so Selenium
Manager, which would fetch a browser of its own, never runs; ``SE_OFFLINE`` is set to keep it offline
all the same. Selenium comes with the ``dev`` extra.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from keyfailover.core.errors import KeyFailoverError

if TYPE_CHECKING:
    from selenium.webdriver.chrome.webdriver import WebDriver

__all__ = ["BrowserMissingError", "Chromium", "browser_missing", "find_chromium", "start_chromium"]

_BROWSERS = (("chromium", "/usr/bin/chromium"), ("chromium-browser", "/usr/lib/chromium/chromium"))
_DRIVERS = (("chromedriver", "/usr/bin/chromedriver"),)
_ARGUMENTS = (
    "--headless=new",
    "--no-sandbox",  # the tests run as root, where Chromium's sandbox refuses to start
    "--disable-dev-shm-usage",  # a container's small /dev/shm would crash the renderer
    "--disable-gpu",
    "--no-first-run",
    "--disable-extensions",
    # Tabs behind the one in front poll as that one does: the benchmark opens ten on one page.
    "--disable-background-timer-throttling",
    "--disable-renderer-backgrounding",
    "--disable-backgrounding-occluded-windows",
)


class BrowserMissingError(KeyFailoverError):
    """Chromium, chromedriver or Selenium is not installed here."""


@dataclass(frozen=True)
class Chromium:
    """Where the browser and its driver are."""

    browser: str
    driver: str


def _find(candidates: tuple[tuple[str, str], ...]) -> str | None:
    """The first of the commands found on PATH, else the first of Debian's paths that exists."""
    for command, _ in candidates:
        found = shutil.which(command)
        if found is not None:
            return found
    return next((path for _, path in candidates if Path(path).is_file()), None)


def _missing(browser: str | None, driver: str | None) -> str | None:
    """What is missing of ``browser``, ``driver`` (None: not found) and Selenium, with how to install it."""
    missing = []
    if browser is None:
        missing.append("Chromium (no chromium on PATH, no /usr/bin/chromium: apt-get install chromium)")
    if driver is None:
        missing.append("chromedriver (none on PATH, no /usr/bin/chromedriver: apt-get install chromium-driver)")
    if importlib.util.find_spec("selenium") is None:
        missing.append("Selenium (not importable: pip install -e '.[dev]')")
    if not missing:
        return None
    return "a headless browser needs " + "; ".join(missing) + " (scripts/setup-system installs the Debian packages)"


def browser_missing() -> str | None:
    """What is missing to drive a headless Chromium here, with how to install it; None when nothing is."""
    return _missing(_find(_BROWSERS), _find(_DRIVERS))


def find_chromium() -> Chromium:
    """The browser and its driver; :class:`BrowserMissingError` saying what is missing when one is."""
    browser, driver = _find(_BROWSERS), _find(_DRIVERS)
    missing = _missing(browser, driver)
    if browser is not None and driver is not None and missing is None:
        return Chromium(browser, driver)
    raise BrowserMissingError(str(missing))


def start_chromium(width: int = 1400, height: int = 1000) -> WebDriver:
    """A headless Chromium of ``width`` x ``height`` pixels, driven through Debian's chromedriver.

    The caller quits it. :class:`BrowserMissingError` when the browser, its driver or Selenium is missing.
    """
    found = find_chromium()
    os.environ.setdefault("SE_OFFLINE", "true")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = found.browser
    for argument in (*_ARGUMENTS, f"--window-size={width},{height}"):
        options.add_argument(argument)
    return webdriver.Chrome(options=options, service=Service(executable_path=found.driver))
