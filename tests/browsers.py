"""Debian's chromium for the browser tests, driven by Playwright: its own browser download cannot work here,
so the browser is named by `executable_path`.

Not a test module (nothing here is named test_*): import it from tests, e.g.

    from browsers import launched_chromium

    with launched_chromium() as browser:
        page = browser.new_page()
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator

from playwright.sync_api import Browser, sync_playwright

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Headless chromium as root in a container: no sandbox, no GPU, no /dev/shm, no calls home.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking", "--no-first-run"]


@contextlib.contextmanager
def launched_chromium() -> Iterator[Browser]:
    """Debian's chromium, headless, closed on exit."""
    assert CHROMIUM, "Debian's chromium is not on PATH: apt-get install chromium (.ci/run does)"
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()
