"""How fast the dashboard's Run page is on long runs: synthetic run stores of 100k steps x 8 ranks and
1M steps x 8 ranks (with a rollback, checkpoints, spikes, stragglers and alerts), served by the real
`keel dashboard` and opened in Debian's chromium.

Per store, measured from outside the code under test and repeated in ABBA order (100k, 1M, 1M, 100k):
- page, new tab: from navigation in a fresh tab (nothing cached in the browser) to the Run page
  rendered (its step caption shown and every chart drawn), once just after a live trainer appended
  LIVE_STEPS steps (what it writes between two refreshes: the dashboard reads those) and once more
  unchanged (a finished run: the dashboard's cache serves the reads);
- page, nav link: the same, the dashboard already open in the tab (on the run's Events page) and the
  user clicking "Run" in the navigation bar, the way one moves between the dashboard's pages; the Run
  page's features on (smoothing and log scale, kept from an earlier visit; a band, grouped markers, the
  header);
- floor: a new tab's time for a page of bare Streamlit holding only the caption (what Streamlit itself
  costs on this machine before Keel reads or draws anything), measured in the same rounds;
- refresh: the server's time for one run of the Run page script (what each live refresh costs), the
  same two ways and a first read (nothing read yet: the whole store), timed around Streamlit's AppTest.
Once per store, before the rounds, the first page of the server (the whole store read) is timed too.

    python bench/dashboard_load.py                 # 2 ABBA rounds; target: page under 2 s at 100k x 8 (nav link)
    python bench/dashboard_load.py --rounds 1 --sizes 100000
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import closing
from pathlib import Path

import numpy as np

from keel.monitor.event_kinds import EventKind
from keel.monitor.run_dir import STORE_FILE
from keel.monitor.store import RANK_COLUMNS, RunStore

RANKS = 8
LIVE_STEPS = 17  # a trainer's steps between two refreshes (5 s) at 0.3 s a step
# The target, for moving to the Run page within the dashboard; 1M x 8 is reported. A new tab is
# reported beside the floor: Streamlit's own start in a new tab is most of 2 s on a 2-core machine.
TARGET_PAGE_S = {100_000: 2.0}
CHUNK = 50_000


def make_store(run_dir: Path, steps: int, seed: int = 0) -> None:
    """A run of `steps` steps on RANKS ranks: a decaying noisy loss with a spike every 50k steps, a
    rollback that reran the last 2% once (attempt 1), events every 1,000 steps."""
    rng = np.random.default_rng(seed)
    RunStore(run_dir).close()  # the schema, exactly as the trainer makes it
    conn = sqlite3.connect(run_dir / STORE_FILE)
    rerun_from = steps - steps // 50
    with conn:
        for attempt, (first, last) in enumerate([(1, steps), (rerun_from, steps)]):
            for lo in range(first, last + 1, CHUNK):
                step = np.arange(lo, min(lo + CHUNK, last + 1))
                _insert_steps(conn, rng, step, attempt)
        events = []
        for s in range(1000, steps + 1, 1000):
            saved = json.dumps({"path": f"checkpoints/step-{s:08d}", "blocking_s": 0.012, "total_s": 2.5})
            events.append((s, 0, None, EventKind.CHECKPOINT_SAVED, "info", f"step-{s:08d}: blocked 12 ms, written in 2.50 s", saved))
            if s % 50_000 == 0:
                events.append((s, 0, None, EventKind.SPIKE, "critical", f"loss spike at step {s}", "{}"))
                events.append((s, 0, None, EventKind.ALERT, "critical", "KeelLossSpike", "{}"))
            if s % 7000 == 0:
                events.append((s, 0, 5, EventKind.STRAGGLER, "warning", "rank 5 is a straggler", "{}"))
        events.append((rerun_from, 1, None, EventKind.ROLLBACK, "critical", f"rolled back to step {rerun_from - 1}", "{}"))
        # A rank late for 500 steps (one band on the charts) and a hang with its alert and restart at one step (one rule).
        late = int(steps * 0.6)
        events += [
            (s, 0, 3, EventKind.FAULT_INJECTED, "warning", "fault injected on rank 3: straggler", "{}") for s in range(late, late + 500)
        ]
        hung = int(steps * 0.3)
        restart = json.dumps({"step": hung - 1, "time": 1.7e9 + hung * 0.3 + 60, "down_s": 20.0})
        events += [(hung, 0, None, EventKind.HANG, "critical", f"hang at step {hung}", "{}"),
                   (hung, 0, None, EventKind.ALERT, "critical", "KeelHang", "{}"),
                   (hung - 1, 0, 0, EventKind.RESTART, "warning", f"workers restarted, resuming at step {hung}", restart)]  # fmt: skip
        conn.executemany(
            "INSERT INTO events (time, step, attempt, rank, kind, severity, message, data) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [(1.7e9 + e[0], *e) for e in events],
        )
    conn.close()


def _insert_steps(conn: sqlite3.Connection, rng: np.random.Generator, step: np.ndarray, attempt: int) -> None:
    n = len(step)
    loss = 2.0 + 3.0 * np.exp(-step / 20_000) + rng.normal(0, 0.05, n)
    loss[step % 50_000 == 0] += 4.0
    step_time = 0.25 + rng.gamma(2.0, 0.01, n)
    values = {
        "step": step, "attempt": np.full(n, attempt), "time": 1.7e9 + step * 0.3, "loss": loss,
        "grad_norm": 1.0 + rng.gamma(2.0, 0.2, n), "lr": np.full(n, 3e-4), "tokens": np.full(n, 65536),
        "tokens_per_s": 65536 / step_time, "mfu": np.full(n, 0.41), "comm_share": rng.uniform(0.1, 0.3, n),
        "step_time_s": step_time, "data_time_s": rng.uniform(0.001, 0.01, n), "mem_peak_bytes": np.full(n, 40 * 2**30),
        "skipped": np.zeros(n, dtype=int),
    }  # fmt: skip
    # The columns this bench makes up; the others (the ranks' spread) are NULL, as in a store of an earlier Keel.
    rows = np.column_stack([v.astype(object) for v in values.values()]).tolist()
    conn.executemany(f"INSERT INTO steps ({', '.join(values)}) VALUES ({', '.join('?' * len(values))})", rows)
    rank = np.repeat(np.arange(RANKS)[None, :], n, axis=0).ravel()
    per_rank = {
        "step": np.repeat(step, RANKS), "attempt": np.full(n * RANKS, attempt), "rank": rank,
        "step_time_s": np.repeat(step_time, RANKS), "comm_time_s": rng.uniform(0.02, 0.08, n * RANKS) + 0.05 * (rank == 5),
        "data_time_s": rng.uniform(0.001, 0.01, n * RANKS), "mem_peak_bytes": np.full(n * RANKS, 40 * 2**30) + rank * 2**28,
    }  # fmt: skip
    rows = np.column_stack([per_rank[c].astype(object) for c in RANK_COLUMNS]).tolist()
    conn.executemany(f"INSERT INTO rank_steps ({', '.join(RANK_COLUMNS)}) VALUES ({', '.join('?' * len(RANK_COLUMNS))})", rows)


RUN_PAGE_CHARTS = 5  # chart elements: loss, the small multiples, the heatmaps, memory by rank, goodput
FLOOR_APP = """
import streamlit as st
st.set_page_config(layout="wide")
st.caption("Steps 1 to 1:")
"""


def serve(folder: Path, port: int) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "keel.cli", "dashboard", str(folder), f"--port={port}", "--read-only"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return _healthy(server, port)


def serve_floor(folder: Path, port: int) -> subprocess.Popen:
    (folder / "floor.py").write_text(FLOOR_APP)
    server = subprocess.Popen([sys.executable, "-m", "streamlit", "run", str(folder / "floor.py"), f"--server.port={port}",
                               "--server.address=127.0.0.1", "--server.headless=true", "--browser.gatherUsageStats=false"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return _healthy(server, port)


def _healthy(server: subprocess.Popen, port: int) -> subprocess.Popen:
    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2).read() == b"ok":
                return server
        except OSError:
            time.sleep(0.3)
    server.terminate()
    raise RuntimeError(f"the server on port {port} did not come up within 90 s")


# The Run page's new features, on in every page measured: smoothing, a log-scale y (the URL's), and the
# grouped markers, the band and the header that every page has.
FEATURES = "&smooth=0.6&log=1"
_FEATURES_DRAWN = ".keel-panel[data-title='loss'] canvas[data-lines*='smooth'][data-y-scale='log'][data-bands='1']"
# Every chart element of the Run page has drawn its panels (keel.dashboard.charts: chart.js marks each).
_DRAWN = "n => document.querySelectorAll('.keel-chart[data-drawn]').length >= n"


def _shown(page, last: int, charts: int = RUN_PAGE_CHARTS) -> None:
    page.get_by_text(re.compile(rf"^Steps 1 to {last:,}:")).first.wait_for(timeout=120_000)
    page.wait_for_function(_DRAWN, arg=charts, timeout=120_000, polling=50)


def page_seconds(browser, url: str, last: int, charts: int = RUN_PAGE_CHARTS) -> float:
    """Navigation in a new tab to a Run page showing steps 1 to `last` with `charts` chart elements drawn."""
    page = browser.new_page(viewport={"width": 1500, "height": 1200})
    start = time.perf_counter()
    page.goto(url)
    _shown(page, last, charts)
    elapsed = time.perf_counter() - start
    page.close()
    return elapsed


def navigation_seconds(browser, base: str, run_dir: Path, last: int, append: bool) -> tuple[float, int]:
    """From the run's Events page to its Run page by the navigation's "Run" link, with the Run page's new
    features on: smoothing and a log scale (set on an earlier visit, which the session keeps), grouped
    markers, a band and the run's header. With `append`, a live trainer's LIVE_STEPS steps are written
    while the Events page is open. Returns the seconds and the run's last step."""
    page = browser.new_page(viewport={"width": 1500, "height": 1200})
    page.goto(f"{base}/run?run={run_dir.name}{FEATURES}")
    _shown(page, last)
    page.get_by_role("link", name="Events", exact=True).click()
    page.wait_for_selector("[data-testid='stDataFrame']", timeout=120_000)
    last = append_steps(run_dir) if append else last
    start = time.perf_counter()
    page.get_by_role("link", name="Run", exact=True).click()
    _shown(page, last)
    page.wait_for_selector(_FEATURES_DRAWN, timeout=120_000)
    elapsed = time.perf_counter() - start
    page.close()
    return elapsed, last


def refresh_seconds(folder: Path, run: str) -> tuple[float, float, float]:
    """One run of the Run page script on the server side (AppTest), after a first run warmed it up:
    with nothing read yet (the whole store is read), after a live trainer appended LIVE_STEPS steps
    (those are read) and unchanged (a finished run: the reads come from the dashboard's cache)."""
    from streamlit.testing.v1 import AppTest

    from keel.dashboard.run_page import read_run, run_reader

    os.environ["KEEL_DASHBOARD_RUNS"] = str(folder)
    app = AppTest.from_string("from keel.dashboard.run_page import render_run\nrender_run()", default_timeout=300)
    app.query_params["run"] = run
    app.run()
    read_run.clear()
    run_reader.clear()
    seconds = []
    for change in (lambda: None, lambda: append_steps(folder / run), lambda: None):
        change()
        start = time.perf_counter()
        app.run()
        seconds.append(time.perf_counter() - start)
    return seconds[0], seconds[1], seconds[2]


def append_steps(run_dir: Path) -> int:
    """LIVE_STEPS more steps of the last attempt on every rank, written as a live trainer writes them
    (RunStore.write_step, a commit each); the store's last step after them."""
    with closing(sqlite3.connect(run_dir / STORE_FILE)) as conn:
        last, attempt = conn.execute("SELECT step, attempt FROM steps ORDER BY step DESC, attempt DESC LIMIT 1").fetchone()
    rng = np.random.default_rng(last)
    with RunStore(run_dir) as store:
        for step in range(last + 1, last + 1 + LIVE_STEPS):
            step_time = 0.25 + rng.gamma(2.0, 0.01)
            row = {"step": step, "attempt": attempt, "time": 1.7e9 + step * 0.3, "loss": 2.0 + rng.normal(0, 0.05),
                   "grad_norm": 1.0 + rng.gamma(2.0, 0.2), "lr": 3e-4, "tokens": 65536, "tokens_per_s": 65536 / step_time,
                   "mfu": 0.41, "comm_share": rng.uniform(0.1, 0.3), "step_time_s": step_time, "data_time_s": rng.uniform(0.001, 0.01),
                   "mem_peak_bytes": 40 * 2**30, "skipped": 0}  # fmt: skip
            ranks = [{"rank": r, "step_time_s": step_time, "comm_time_s": rng.uniform(0.02, 0.08), "mem_peak_bytes": 40 * 2**30}
                     for r in range(RANKS)]  # fmt: skip
            store.write_step(row, ranks)
    return last + LIVE_STEPS


FIGURES = ("page, new tab, steps appended", "page, new tab, unchanged", "page, nav link, steps appended", "page, nav link, unchanged",
           "floor: bare Streamlit, new tab", "refresh, first read", "refresh, steps appended", "refresh, unchanged")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000], help="steps per store (8 ranks each)")
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds (each size measured twice per round)")
    opts = p.parse_args()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="keel-dashboard-load-") as tmp:
        folder = Path(tmp)
        for steps in opts.sizes:
            start = time.perf_counter()
            make_store(folder / f"run-{steps}", steps)
            print(f"store of {steps:,} steps x {RANKS} ranks written in {time.perf_counter() - start:.0f} s "
                  f"({(folder / f'run-{steps}' / STORE_FILE).stat().st_size / 2**20:,.0f} MiB)", flush=True)  # fmt: skip
        server, floor = serve(folder, port=8765), serve_floor(folder, port=8766)
        seconds = {s: {f: [] for f in FIGURES} for s in opts.sizes}
        base, last = "http://127.0.0.1:8765", {s: s for s in opts.sizes}
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(
                    executable_path=shutil.which("chromium"), args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
                )
                for steps in opts.sizes:  # the server's first read of each store, the whole of it
                    first = page_seconds(browser, f"{base}/run?run=run-{steps}", steps)
                    print(f"  {steps:>9,} steps: page, new tab, the server's first read {first:.2f} s", flush=True)
                order = opts.sizes + opts.sizes[::-1]  # ABBA
                for _ in range(opts.rounds):
                    for steps in order:
                        run = f"run-{steps}"
                        last[steps] = append_steps(folder / run)
                        tabs = [page_seconds(browser, f"{base}/run?run={run}{FEATURES}", last[steps]) for _ in range(2)]
                        navigation = []
                        for append in (True, False):
                            elapsed, last[steps] = navigation_seconds(browser, base, folder / run, last[steps], append)
                            navigation.append(elapsed)
                        bare = page_seconds(browser, "http://127.0.0.1:8766/", 1, charts=0)
                        refresh = refresh_seconds(folder, run)
                        last[steps] += LIVE_STEPS  # refresh_seconds appended once
                        got = [*tabs, *navigation, bare, *refresh]
                        for figure, value in zip(FIGURES, got):
                            seconds[steps][figure].append(value)
                        print(f"  {steps:>9,} steps: " + ", ".join(f"{f} {v:.2f} s" for f, v in zip(FIGURES, got)), flush=True)
                browser.close()
        finally:
            for started in (server, floor):
                started.terminate()
                started.wait()
    print(f"\n{'store':>19} | {'figure':<30} | {'median (min-max)':>20} | target")
    for steps in opts.sizes:
        for figure in FIGURES:
            xs = seconds[steps][figure]
            target = TARGET_PAGE_S.get(steps) if figure.startswith("page, nav link") else None
            verdict = f"< {target:g} s: {'met' if statistics.median(xs) < target else 'MISSED'}" if target else "reported"
            print(f"{steps:>9,} x {RANKS} ranks | {figure:<30} | {_spread(xs):>20} | {verdict}")


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})"


if __name__ == "__main__":
    main()
