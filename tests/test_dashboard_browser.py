"""The dashboard as a person sees it: `keel dashboard` serving on loopback, Debian's chromium driven by
Playwright (its own browser download cannot work here, so `executable_path`), a real trainer writing
while the page is open, and run directories broken the ways disks and crashes break them.

Screenshots of every page go to $KEEL_SCREENSHOTS (default: the test's temporary folder) for a person
to look at.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright
from servers import free_port
from streamlit.testing.v1 import AppTest

from keel.dashboard.actions import ACTIONS_ENV
from keel.dashboard.charts import ABANDONED_COLOURS, EFFECTIVE_COLOUR
from keel.dashboard.runs_page import RUNS_ENV
from keel.dashboard.series import MARKER_KINDS
from keel.monitor.store import read_events, step_bounds

# Multi-process training runs, real servers or the browser: the full suite only (`pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Headless chromium as root in a container: no sandbox, no GPU, no /dev/shm, no calls home.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking", "--no-first-run"]
LIVE_WITHIN_S = 10.0
PAGES = {"runs": "/", "run": "/run?run=spike", "events": "/events?run=spike", "drills": "/drills", "compare": "/compare?run=spike&run=live"}
# What shows that each page has drawn: its charts (keel.dashboard.charts marks each element drawn), its table, its last part.
DRAWN = {
    "runs": "[data-testid='stDataFrame']", "run": ".keel-chart[data-drawn] >> nth=4", "events": "[data-testid='stDataFrame']",
    "drills": "text=Inject a fault into a running run", "compare": ".keel-chart[data-drawn]",
}  # fmt: skip


@pytest.fixture(scope="module")
def runs_folder(spike_run, tmp_path_factory) -> Path:
    """A finished run with a spike and a rollback, and three run directories a crash or a full disk
    leaves: a store of garbage, an empty store, and a store cut off halfway."""
    folder = tmp_path_factory.mktemp("browser")
    (folder / "spike").symlink_to(spike_run, target_is_directory=True)
    for name in ("corrupt", "empty", "half"):
        (folder / name).mkdir()
    (folder / "corrupt" / "run.sqlite").write_bytes(b"\x00garbage" * 512)
    (folder / "empty" / "run.sqlite").touch()
    whole = (spike_run / "run.sqlite").read_bytes()
    (folder / "half" / "run.sqlite").write_bytes(whole[: len(whole) // 2])
    return folder


@pytest.fixture(scope="module")
def live_run(runs_folder):
    """A real `keel train` writing its store while the tests watch: a tiny model whose every step a
    straggler fault stretches by 150 ms, so it is still running when the tests look."""
    run_dir = runs_folder / "live"
    cmd = [sys.executable, "-m", "keel.cli", "train", f"--run-dir={run_dir}", "--config=tiny", "--pp=1", "--dp=1", "--tp=1",
           "--steps=1000", "--fault=straggler@step=1,steps=1000,ms=150", "--monitor.wandb=false"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 120
        while not _newest_step(run_dir) and time.time() < deadline and job.poll() is None:
            time.sleep(0.5)
        assert _newest_step(run_dir), "the live run wrote no step within 120 s"
        yield run_dir
    finally:
        os.killpg(job.pid, signal.SIGTERM)  # its own session: keel, torchrun and the worker
        try:
            job.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


def _newest_step(run_dir: Path) -> int:
    try:
        bounds = step_bounds(run_dir)
    except Exception:  # the store is still being created
        return 0
    return bounds[1] if bounds else 0


@pytest.fixture(scope="module")
def dashboard(runs_folder, live_run) -> str:
    port = free_port()
    cmd = [sys.executable, "-m", "keel.cli", "dashboard", str(runs_folder), f"--port={port}"]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while time.time() < deadline and server.poll() is None:
            try:
                if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                time.sleep(0.5)
        assert server.poll() is None, server.stdout.read()
        yield url
    finally:
        server.terminate()  # `keel dashboard` became the server: its own PID stops it
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    assert CHROMIUM, "Debian's chromium is not on PATH: apt-get install chromium (.ci/run does)"
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("KEEL_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _open(browser, url: str):
    page = browser.new_page(viewport={"width": 1500, "height": 2400})
    page.goto(url)
    page.wait_for_selector("[data-testid='stAppViewContainer']", timeout=60_000)
    return page


def _caption_steps(page) -> int:
    """The newest step the Run page says it shows (its caption: "Steps 1 to N: ...")."""
    text = page.get_by_text(re.compile(r"^Steps [\d,]+ to [\d,]+:")).first.inner_text(timeout=30_000)
    return int(re.search(r"to ([\d,]+):", text).group(1).replace(",", ""))


# How many of a canvas's pixels are within a small distance of a "#rrggbb" colour.
_PIXELS_OF = """(canvas, hex) => {
    const want = [1, 3, 5].map(k => parseInt(hex.slice(k, k + 2), 16));
    const px = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
    let n = 0;
    for (let i = 0; i < px.length; i += 4) if (want.every((v, k) => Math.abs(px[i + k] - v) < 24) && px[i + 3] > 200) n++;
    return n;
}"""


def test_run_page_shows_the_run_with_a_rendered_loss_chart(browser, dashboard, spike_run):
    page = _open(browser, dashboard + "/run?run=spike")
    assert _caption_steps(page) == 60
    # The loss chart is drawn on a canvas of real size, both of its lines in its pixels: the effective
    # trajectory's blue and the abandoned attempt's red (keel.dashboard.charts' colours).
    chart = page.locator(".keel-panel[data-title='loss'] canvas[data-drawn]")
    chart.wait_for(timeout=30_000)
    box = chart.bounding_box()
    assert box["width"] > 400 and box["height"] > 150
    assert chart.get_attribute("data-segments") == "2"
    for colour in (EFFECTIVE_COLOUR, ABANDONED_COLOURS[0]):
        assert chart.evaluate(_PIXELS_OF, colour) > 50, colour
    assert page.get_by_text("loss", exact=True).first.is_visible()
    assert page.locator("[data-testid='stException']").count() == 0
    # Hovering along the chart names every marked event with its message (the markers' hover text).
    seen = set()
    for dx in range(0, int(box["width"]), 3):
        page.mouse.move(box["x"] + dx, box["y"] + box["height"] / 2)
        seen.add(page.locator(".keel-chart > div:last-child").first.inner_text())
    events = read_events(spike_run)
    for _, event in events[events.kind.isin(MARKER_KINDS)].iterrows():
        assert any(f"at step {int(event.step)} " in text and event.message in text for text in seen), event.message
    page.close()


def test_charts_follow_a_dark_theme(browser, dashboard):
    """Streamlit follows the system's dark mode by default: the charts' text must turn light with it, or
    the axes and titles are dark on dark."""
    page = browser.new_page(viewport={"width": 1500, "height": 1200}, color_scheme="dark")
    page.goto(dashboard + "/run?run=spike")
    title = page.locator(".keel-panel[data-title='loss'] > div").first
    title.wait_for(timeout=60_000)
    text = title.evaluate("e => getComputedStyle(e).color")
    background = page.evaluate("getComputedStyle(document.querySelector('.stApp')).backgroundColor")
    assert _brightness(background) < 0.3 < 0.7 < _brightness(text), (text, background)
    page.close()


def _brightness(css_colour: str) -> float:
    """0 (black) to 1 (white): the mean of an "rgb(r, g, b)" colour's channels."""
    return sum(map(int, re.findall(r"\d+", css_colour)[:3])) / 765


def test_a_step_the_trainer_appends_appears_without_a_reload(browser, dashboard, live_run):
    page = _open(browser, dashboard + "/run?run=live")
    _caption_steps(page)
    page.evaluate("window.keelNoReload = true")  # gone if the page reloads
    before = _newest_step(live_run)
    while _newest_step(live_run) == before:
        time.sleep(0.05)
    appended, written_at = _newest_step(live_run), time.time()
    while _caption_steps(page) < appended and time.time() - written_at < LIVE_WITHIN_S + 5:
        time.sleep(0.2)
    shown_after = time.time() - written_at
    assert _caption_steps(page) >= appended and shown_after < LIVE_WITHIN_S, f"step {appended} shown after {shown_after:.1f} s"
    assert page.evaluate("window.keelNoReload") is True
    page.close()


def test_broken_run_directories_get_a_message_and_the_rest_works(browser, dashboard):
    page = _open(browser, dashboard + "/")
    for name in ("corrupt", "empty", "half"):
        page.get_by_text(re.compile(rf"/{name}: cannot read its run store")).first.wait_for(timeout=30_000)
    # The table is drawn on a canvas; its accessible copy (a table inside the canvas) holds the text.
    grid = page.locator("[data-testid='stDataFrame'] table").first.text_content()
    assert "spike" in grid and "live" in grid
    page.close()
    page = _open(browser, dashboard + "/run?run=half")
    page.get_by_text(re.compile(r"half: cannot read its run store")).first.wait_for(timeout=30_000)
    page.close()
    page = _open(browser, dashboard + "/run?run=spike")  # the same server still draws a good run
    assert _caption_steps(page) == 60
    page.close()


def test_every_page_renders_and_is_saved_as_a_screenshot(browser, dashboard, shots):
    for name, path in PAGES.items():
        page = _open(browser, dashboard + path)
        page.locator(DRAWN[name]).first.wait_for(timeout=30_000)
        page.wait_for_timeout(300)  # a table's cells finish painting
        assert page.locator("[data-testid='stException']").count() == 0, name
        page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
        assert (shots / f"{name}.png").stat().st_size > 20_000
        page.close()


def test_a_fault_injected_from_the_drills_page_reaches_the_live_run(runs_folder, live_run, monkeypatch):
    monkeypatch.setenv(RUNS_ENV, str(runs_folder))
    monkeypatch.setenv(ACTIONS_ENV, "1")
    app = AppTest.from_string("from keel.dashboard.drills_page import render_drills\nrender_drills()", default_timeout=60).run()
    app.selectbox(key="inject-run").set_value("live")
    app.text_input[-1].input("nan")
    [inject] = [b for b in app.button if b.label.startswith("Inject")]
    inject.click().run()
    assert "Inject `nan` into the running run **live** on every rank?" in app.warning[0].value
    [confirm] = [b for b in app.button if b.label == "Confirm the injection"]
    confirm.click().run()
    assert "requested nan@step=" in app.success[0].value
    deadline = time.time() + 60
    while time.time() < deadline and not (read_events(live_run).kind == "nonfinite").any():
        time.sleep(0.5)
    assert (read_events(live_run).kind == "nonfinite").any(), "the trainer never took the injected NaN"
