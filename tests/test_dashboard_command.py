"""`keel dashboard`'s flags reach what it serves. Started as a user starts it, with `--read-only`, or bound to
a non-loopback address (0.0.0.0: every interface, reached here over loopback), its Drills page offers no
action, neither the drill form nor fault injection; bound there with `--allow-actions`, it offers both.
Debian's chromium, driven by Playwright, reads the page as a person sees it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from browsers import launched_chromium
from servers import free_port, wait_for_dashboard

# Real servers and the browser: the full suite only (`pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow

ACTIONS_OFF = "Actions are off on this dashboard"  # the Drills page's caption in place of its actions
# Each command line, and whether the Drills page may start drills and inject faults.
COMMANDS = {
    "read-only": (["--read-only"], False),
    "non-loopback": (["--host=0.0.0.0"], False),
    "non-loopback-allowed": (["--host=0.0.0.0", "--allow-actions"], True),
}


@pytest.fixture(scope="module")
def dashboards(tmp_path_factory):
    """One `keel dashboard` per command line, all starting at once (a Streamlit server takes seconds to
    start); yields {name: (url, the line it printed)}."""
    runs = tmp_path_factory.mktemp("runs")
    servers = {}
    try:
        for name, (flags, _) in COMMANDS.items():
            port = free_port()
            cmd = [sys.executable, "-m", "keel.cli", "dashboard", str(runs), f"--port={port}", *flags]
            servers[name] = (port, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        started = {}
        for name, (port, server) in servers.items():
            url = f"http://127.0.0.1:{port}"
            printed = server.stdout.readline()  # printed before it becomes the server
            wait_for_dashboard(url, server)
            assert server.poll() is None, printed + server.stdout.read()
            started[name] = (url, printed)
        yield started
    finally:
        for _, server in servers.values():  # all told at once: each takes a few seconds to stop
            server.terminate()  # `keel dashboard` became the server: its own PID stops it
        for _, server in servers.values():
            server.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    with launched_chromium() as chromium:
        yield chromium


@pytest.mark.parametrize("name", COMMANDS)
def test_the_command_line_decides_whether_the_drills_page_has_actions(name, dashboards, browser):
    url, printed = dashboards[name]
    actions = COMMANDS[name][1]
    assert ("actions on" if actions else "actions off") in printed
    page = browser.new_page()
    try:
        page.goto(f"{url}/drills", timeout=60_000)
        inject, off = page.get_by_text("Inject a fault into a running run"), page.get_by_text(ACTIONS_OFF)
        # The page's last part, with its actions or without: once either is there, the page has drawn all it will.
        inject.or_(off).first.wait_for(timeout=60_000)
        offered = {"the drill form": page.get_by_role("button", name="Start the drill").count(), "fault injection": inject.count()}
        assert offered == dict.fromkeys(offered, 1 if actions else 0), f"keel dashboard {' '.join(COMMANDS[name][0])}: {offered}"
        assert off.count() == (0 if actions else 1)
    finally:
        page.close()
