"""The dashboard as a person sees it: `keel dashboard` serving on loopback, Debian's chromium driven by
Playwright (its own browser download cannot work here, so `executable_path`), a real trainer writing
while the page is open, and run directories broken the ways disks and crashes break them.

Screenshots of every page go to $KEEL_SCREENSHOTS (default: the test's temporary folder) for a person
to look at.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from browsers import launched_chromium
from servers import free_port, wait_for_dashboard
from streamlit.testing.v1 import AppTest

from keel.dashboard.actions import ACTIONS_ENV
from keel.dashboard.charts import ABANDONED_COLOURS, EFFECTIVE_COLOUR
from keel.dashboard.runs_page import RUNS_ENV
from keel.dashboard.series import MARKER_KINDS
from keel.monitor.run_dir import LOCK_FILE
from keel.monitor.run_lock import lock_held
from keel.monitor.runs import KILLED_AFTER_S, summarize_run
from keel.monitor.store import read_events, read_steps, step_bounds
from keel.trainer.config import load_config

# Multi-process training runs, real servers or the browser: the full suite only (`pytest -m "not slow"` leaves them out).
pytestmark = pytest.mark.slow

LIVE_WITHIN_S = 10.0
PAGES = {"runs": "/", "run": "/run?run=spike", "events": "/events?run=hang", "drills": "/drills",
         "compare": "/compare?run=spike&run=hang&metric=loss&metric=grad_norm"}  # fmt: skip
# What shows that each page has drawn: its charts (keel.dashboard.charts marks each element drawn), its table, its last part.
DRAWN = {
    "runs": "[data-testid='stDataFrame']", "run": ".keel-chart[data-drawn] >> nth=4", "events": "[data-testid='stDataFrame']",
    "drills": "text=Inject a fault into a running run", "compare": ".keel-chart[data-drawn]",
}  # fmt: skip
PLACEHOLDER = "[data-testid='stSkeleton']"


@pytest.fixture(scope="module")
def runs_folder(spike_run, drill_runs, tmp_path_factory) -> Path:
    """A finished run with a spike and a rollback, a drill's runs with a hang and restart and with a rank
    late for many steps, and three run directories a crash or a full disk leaves: a store of garbage, an
    empty store, and a store cut off halfway."""
    folder = tmp_path_factory.mktemp("browser")
    (folder / "spike").symlink_to(spike_run, target_is_directory=True)
    for name in ("hang", "late_collective"):
        (folder / name).symlink_to(drill_runs / name, target_is_directory=True)
    for name in ("corrupt", "empty", "half"):
        (folder / name).mkdir()
    (folder / "corrupt" / "run.sqlite").write_bytes(b"\x00garbage" * 512)
    (folder / "empty" / "run.sqlite").touch()
    whole = (spike_run / "run.sqlite").read_bytes()
    (folder / "half" / "run.sqlite").write_bytes(whole[: len(whole) // 2])
    return folder


@pytest.fixture(scope="module")
def live_job(runs_folder):
    """A real `keel train` writing its store while the tests watch, in a session of its own (keel, torchrun
    and the worker): a tiny model whose every step a straggler fault stretches by 150 ms, so it is still
    running when the tests look. The last test kills it with SIGKILL."""
    cmd = [sys.executable, "-m", "keel.cli", "train", f"--run-dir={runs_folder / 'live'}", "--config=tiny", "--pp=1", "--dp=1",
           "--tp=1", "--steps=100000", "--fault=straggler@step=1,steps=100000,ms=150", "--monitor.wandb=false"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        yield job
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone already if the test killed it
            os.killpg(job.pid, signal.SIGTERM)
        try:
            job.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


@pytest.fixture(scope="module")
def live_run(runs_folder, live_job) -> Path:
    run_dir = runs_folder / "live"
    deadline = time.time() + 120
    while not _newest_step(run_dir) and time.time() < deadline and live_job.poll() is None:
        time.sleep(0.5)
    assert _newest_step(run_dir), "the live run wrote no step within 120 s"
    return run_dir


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
        wait_for_dashboard(url, server)
        assert server.poll() is None, server.stdout.read()
        yield url
    finally:
        server.terminate()  # `keel dashboard` became the server: its own PID stops it
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    with launched_chromium() as chromium:
        yield chromium


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


def _wait_for_caption(page, first: int, last: int) -> None:
    """Wait until the Run page's caption says it shows steps `first` to `last`. The URL changes as soon as the
    browser asks for a rerun and the caption only when the rerun's page arrives, so a test waits for the caption."""
    page.wait_for_function(
        "text => [...document.querySelectorAll('p')].some(p => p.innerText.startsWith(text))",
        arg=f"Steps {first} to {last}:",
        timeout=30_000,
    )


def _caption_steps(page) -> int:
    """The newest step the Run page says it shows (its caption: "Steps 1 to N: ...")."""
    text = page.get_by_text(re.compile(r"^Steps [\d,]+ to [\d,]+:")).first.inner_text(timeout=30_000)
    return int(re.search(r"to ([\d,]+):", text).group(1).replace(",", ""))


# How many of a canvas's pixels are a "#rrggbb" colour drawn faint (mostly transparent: a line under globalAlpha).
_FAINT_PIXELS_OF = """(canvas, hex) => {
    const want = [1, 3, 5].map(k => parseInt(hex.slice(k, k + 2), 16));
    const px = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
    let n = 0;
    for (let i = 0; i < px.length; i += 4) if (want.every((v, k) => Math.abs(px[i + k] - v) < 24) && px[i + 3] > 20 && px[i + 3] < 120) n++;
    return n;
}"""
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
    # The live run writes a step every 150 ms or so (its straggler's sleep, and the tiny model's step); a
    # minute without one is a run that stalled or died, which must fail the test, not hang it.
    deadline = time.time() + 60
    while _newest_step(live_run) == before and time.time() < deadline:
        time.sleep(0.05)
    appended, written_at = _newest_step(live_run), time.time()
    assert appended > before, f"the live run wrote no step after step {before} in 60 s"
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


LOSS = ".keel-panel[data-title='loss'] canvas[data-drawn]"
TIP = ".keel-tip:visible"  # each chart element has its own; the one shown


def _loss_chart(page, attribute: str = ""):
    """The loss chart's canvas, once drawn (and, with `attribute`, once it carries that attribute)."""
    chart = page.locator(LOSS + attribute)
    chart.wait_for(timeout=30_000)
    return chart


def _hover_texts(page, chart, y_share: float = 0.5) -> list[str]:
    """The hover text at every third pixel column along the chart, at `y_share` of its height."""
    box, texts = chart.bounding_box(), []
    for dx in range(0, int(box["width"]), 3):
        page.mouse.move(box["x"] + dx, box["y"] + box["height"] * y_share)
        texts.append(_tip_text(page))
    return texts


def _tip_text(page) -> str:
    tips = page.locator(TIP)
    return tips.first.inner_text() if tips.count() else ""


def _plot_x(chart, step: float, first: int, last: int) -> float:
    """The page x of `step` on a line chart over steps first..last (chart.js: 60 px left, 10 px right of the plot)."""
    box = chart.bounding_box()
    return box["x"] + 60 + (step - first) / (last - first) * (box["width"] - 70)


def test_smoothing_draws_the_average_over_the_raw_line_it_keeps(browser, dashboard):
    page = _open(browser, dashboard + "/run?run=spike")
    chart = _loss_chart(page)
    assert chart.get_attribute("data-lines") == "effective:raw,attempt 0:raw"
    before = chart.evaluate("c => c.toDataURL()")
    raw_blue = chart.evaluate(_PIXELS_OF, EFFECTIVE_COLOUR)
    slider = page.locator("[data-testid='stSlider']").filter(has_text="smoothing").get_by_role("slider")
    slider.focus()
    slider.press("End")  # the most smoothing: 0.99
    chart = _loss_chart(page, "[data-lines*='smooth']")
    assert chart.get_attribute("data-lines") == "effective:raw-faint,effective:smooth,attempt 0:raw-faint,attempt 0:smooth"
    page.wait_for_url(re.compile(r"smooth=0\.99"), timeout=30_000)
    assert chart.evaluate("c => c.toDataURL()") != before
    # The full-strength blue is now the smoothed line; the raw line stays, faint: the same blue, mostly transparent.
    assert chart.evaluate(_PIXELS_OF, EFFECTIVE_COLOUR) > 50 and chart.evaluate(_FAINT_PIXELS_OF, EFFECTIVE_COLOUR) > 100, raw_blue
    page.close()


def test_a_drag_zooms_to_its_steps_and_a_double_click_shows_them_all(browser, dashboard):
    page = _open(browser, dashboard + "/run?run=spike")
    chart = _loss_chart(page)
    box = chart.bounding_box()
    y = box["y"] + box["height"] / 2
    page.mouse.move(_plot_x(chart, 19.5, 1, 60), y)
    page.mouse.down()
    page.mouse.move(_plot_x(chart, 40.5, 1, 60), y, steps=8)
    page.mouse.up()
    page.wait_for_url(re.compile(r"steps=\d+-\d+"), timeout=30_000)
    assert re.search(r"steps=(\d+)-(\d+)", page.url).groups() == ("20", "40")
    _wait_for_caption(page, 20, 40)
    _loss_chart(page).dblclick()
    page.wait_for_function("() => !location.search.includes('steps=')", timeout=30_000)
    _wait_for_caption(page, 1, 60)
    page.close()


def test_log_scale_redraws_the_y_axis(browser, dashboard):
    page = _open(browser, dashboard + "/run?run=spike")
    before = _loss_chart(page, "[data-y-scale='linear']").evaluate("c => c.toDataURL()")
    page.get_by_text("log y", exact=True).click()
    chart = _loss_chart(page, "[data-y-scale='log']")
    assert chart.evaluate("c => c.toDataURL()") != before
    page.wait_for_url(re.compile(r"log=1"), timeout=30_000)
    page.close()


def test_the_wall_clock_axis_shows_the_time_a_hang_cost_and_the_chart_exports(browser, dashboard, drill_runs):
    page = _open(browser, dashboard + "/run?run=hang")
    _loss_chart(page)
    page.get_by_text("wall-clock time", exact=True).click()
    page.wait_for_url(re.compile(r"x=time"), timeout=30_000)
    _loss_chart(page, "[data-x-axis='wall-clock time']")
    with page.expect_download() as csv:
        page.locator(".keel-panel[data-title='loss'] .keel-export-csv").click()
    drawn = pd.read_csv(csv.value.path())
    assert {"x", "step", "value", "segment"} <= set(drawn.columns)
    effective = drawn[drawn.segment == "effective"].set_index("step").x
    hang = read_events(drill_runs / "hang").query("kind == 'hang'").iloc[0]
    gaps = effective.diff().dropna()
    # The x axis is the run's clock: each step's gap is the time the run store says passed between the steps.
    stored = read_steps(drill_runs / "hang", effective=True).set_index("step").time.diff().dropna()
    np.testing.assert_allclose(gaps.to_numpy(), stored.loc[gaps.index].to_numpy(), atol=0.01)
    # The step that hung ends after the watchdog's wait and the restart of every process: the widest gap, and
    # at least that wait. (Not a ratio to the other gaps: a loaded machine once stretched a plain step to 6.5 s.)
    floor_s = load_config(str(drill_runs / "hang" / "config.toml")).watchdog.floor_s
    assert gaps.idxmax() == hang.step and gaps.loc[hang.step] >= floor_s, gaps.to_dict()
    with page.expect_download() as png:
        page.locator(".keel-panel[data-title='loss'] .keel-export-png").click()
    assert Path(png.value.path()).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page.close()


def test_events_at_one_step_are_one_rule_whose_hover_lists_them_in_causal_order(browser, dashboard, drill_runs):
    page = _open(browser, dashboard + "/run?run=hang")
    chart = _loss_chart(page)
    [hang_step] = read_events(drill_runs / "hang").query("kind == 'hang'").step
    texts = [t for t in _hover_texts(page, chart) if f"hang at step {hang_step} " in t]
    assert texts, "no hover names the hang"
    kinds = [line.split(" at step ")[0] for line in texts[0].splitlines() if " at step " in line]
    assert kinds == ["injected fault", "hang", "alert", "restart"], texts[0]
    assert "resuming at step" in texts[0]
    page.close()


def test_a_fault_lasting_many_steps_is_one_band(browser, dashboard, drill_runs):
    page = _open(browser, dashboard + "/run?run=late_collective")
    chart = _loss_chart(page)
    injected = read_events(drill_runs / "late_collective").query("kind == 'fault_injected'").step
    assert len(injected) >= 5 and chart.get_attribute("data-bands") == "1"
    rules = int(chart.get_attribute("data-rules"))
    assert rules <= len(read_events(drill_runs / "late_collective").step.dropna().unique()) - len(injected) + 1
    first, last = step_bounds(drill_runs / "late_collective")
    page.mouse.move(_plot_x(chart, (injected.min() + injected.max()) / 2 + 0.3, first, last), chart.bounding_box()["y"] + 60)
    page.locator(TIP).first.wait_for(timeout=10_000)
    assert f"injected fault from step {injected.min()} to {injected.max()} ({len(injected)} events)" in _tip_text(page)
    page.close()


def test_a_legend_click_hides_a_line_and_a_second_shows_it(browser, dashboard):
    page = _open(browser, dashboard + "/run?run=spike")
    chart = _loss_chart(page)
    entry = page.locator(".keel-panel[data-title='loss'] .keel-legend [data-label='attempt 0']")
    entry.click()
    chart = _loss_chart(page, "[data-segments='1']")
    assert chart.evaluate(_PIXELS_OF, ABANDONED_COLOURS[0]) < 5
    entry = page.locator(".keel-panel[data-title='loss'] .keel-legend [data-label='attempt 0']")
    entry.click()
    assert _loss_chart(page, "[data-segments='2']").evaluate(_PIXELS_OF, ABANDONED_COLOURS[0]) > 50
    page.close()


def test_a_narrow_window_keeps_the_charts_readable_and_the_hover_on_screen(browser, dashboard):
    page = browser.new_page(viewport={"width": 800, "height": 1400})
    page.goto(dashboard + "/run?run=spike")
    chart = _loss_chart(page)
    assert page.locator("[data-testid='stSidebar']").count() == 0  # the pages are in a top bar: all the width is the charts'
    small = page.locator(".keel-panel[data-title='grad norm'] canvas[data-drawn]")
    assert small.bounding_box()["width"] >= 280
    box = chart.bounding_box()
    for x in (box["x"] + 62, box["x"] + box["width"] - 12):  # near either edge of the plot
        for dy in range(20, int(box["height"]) - 30, 6):
            page.mouse.move(x, box["y"] + dy)
            if page.locator(TIP).count():
                break
        tip = page.locator(TIP).first.bounding_box()
        assert tip and 0 <= tip["x"] and tip["x"] + tip["width"] <= 800, tip
    page.close()


def test_an_event_links_to_its_steps_on_the_run_page(browser, dashboard, spike_run):
    page = _open(browser, dashboard + "/events?run=spike&kind=rollback")
    grid = page.locator("[data-testid='stDataFrame']").first
    grid.wait_for(timeout=30_000)
    [step] = read_events(spike_run).query("kind == 'rollback'").step
    cell = grid.locator("td[data-testid='glide-cell-0-0']")  # the link column (the first) of the first (only) row
    assert cell.text_content() == f"run?run=spike&steps={step - 25}-{step + 25}"
    box = grid.bounding_box()
    # The table is drawn on a canvas: the first row's link text (a 35 px header, rows of 35 px). The first click
    # selects its cell, the next follows the link, in a new tab.
    link = (box["x"] + 16, box["y"] + 35 + 17)
    page.mouse.click(*link)
    with page.context.expect_page() as opened:
        page.mouse.click(*link)
    run_page = opened.value
    run_page.wait_for_load_state()
    assert f"steps={step - 25}-{step + 25}" in run_page.url and "run=spike" in run_page.url
    run_page.get_by_text(re.compile(rf"^Steps {step - 25} to {step + 25}:")).first.wait_for(timeout=30_000)
    run_page.close()
    page.close()


@pytest.mark.parametrize("width", [1400, 800])
def test_every_page_renders_and_is_saved_as_a_screenshot(browser, dashboard, shots, width):
    for name, path in PAGES.items():
        page = browser.new_page(viewport={"width": width, "height": 2400})
        page.goto(dashboard + path)
        page.locator(DRAWN[name]).first.wait_for(timeout=60_000)
        # Streamlit draws a grey placeholder for each widget until the widget's code has loaded (seconds on a
        # loaded machine): the page is drawn when none is left.
        page.wait_for_function(f"() => !document.querySelector({PLACEHOLDER!r})", timeout=60_000)
        page.wait_for_timeout(500)  # a table's cells finish painting
        assert page.locator("[data-testid='stException']").count() == 0, name
        for table in page.locator("[data-testid='stDataFrame'] table").all():  # a missing value is an empty cell
            assert "None" not in table.text_content(), name
        page.screenshot(path=str(shots / f"{name}-{width}.png"), full_page=True)
        assert (shots / f"{name}-{width}.png").stat().st_size > 20_000
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


def test_the_header_says_killed_once_a_run_is_killed_with_sigkill(browser, dashboard, live_run, live_job):
    """The last test: it kills the live run. Its lock is free at once; once it has been silent for
    KILLED_AFTER_S (a restart's gap is shorter) the header says killed, not running."""
    page = _open(browser, dashboard + "/run?run=live")
    page.get_by_text("running", exact=True).first.wait_for(timeout=30_000)
    page.close()
    # Every process of the job at once, as an OOM killer or `kill -9` ends them: keel and torchrun (the job's
    # session) and the worker holding the run's lock (which would otherwise get torchrun's death signal and stop).
    holder = json.loads((live_run / LOCK_FILE).read_text())["pid"]
    os.killpg(live_job.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):  # in the job's session, it may be gone already
        os.kill(holder, signal.SIGKILL)
    live_job.wait(timeout=30)
    deadline = time.time() + 10
    while lock_held(live_run) and time.time() < deadline:  # the kernel frees the lock as the process is reaped
        time.sleep(0.1)
    assert lock_held(live_run) is False
    last_seen = summarize_run(live_run)["last_seen"]
    time.sleep(max(0.0, last_seen + KILLED_AFTER_S + 1 - time.time()))
    page = _open(browser, dashboard + "/run?run=live")
    page.get_by_text("killed", exact=True).first.wait_for(timeout=30_000)
    assert page.get_by_text("running", exact=True).count() == 0
    page.close()
