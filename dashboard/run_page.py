"""The Run page: one run, live. Every step metric against step with every event marked (hover for what
happened) and the attempts a rollback or restart abandoned drawn beside the effective trajectory; the
ranks side by side (step and communication time per rank and step, stragglers picked out, memory);
goodput and where the rest of the time went; the checkpoints; the resolved config. Below Keel's own
metrics, a chart for each metric the user's training code reported (keel.monitor.custom_metrics), drawn
the same way; nothing when it reported none.

The charts show the step range of the slider above them, every step of it when it is narrow enough
(M4 keeps at most 4 points per pixel column), and the range is kept across refreshes and in the URL.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pandas as pd
import streamlit as st

from keel.dashboard.charts import bar_chart, draw, metric_chart, rank_heatmap
from keel.dashboard.run_data import RunData, RunReader
from keel.dashboard.runs_page import REFRESH_S, run_folders
from keel.dashboard.series import (
    MARKER_COLOURS,
    ROUTINE_MARKERS,
    chart_titles,
    custom_series,
    event_markers,
    metric_series,
    slowest_rank_counts,
    straggler_marks,
)
from keel.monitor.checkpoints import checkpoint_table, verify
from keel.monitor.goodput import Goodput
from keel.monitor.run_dir import CONFIG_FILE, MANIFEST
from keel.monitor.runs import find_runs
from keel.monitor.store import SLOWEST_RANKS, read_meta, step_bounds, store_version

# The small charts, three to a row, are about 480 px wide on a wide page: M4 on 480 columns keeps every pixel
# column's extremes.
SMALL_CHART_BUCKETS = 480
HEATMAP_BINS = 120  # step columns of the rank x step heatmaps
RANGE_KEY = "steps"  # the slider's state key and the URL parameter (?steps=LO-HI)
_NEWEST_KEY = "newest-step"
_RUN_KEY = "chosen-run"  # the run chosen last, kept across pages


def render_run() -> None:
    st.title("Run")
    run_dir = choose_run()
    if run_dir is not None:
        _live_run(run_dir)
        _config(run_dir)


def choose_run() -> Path | None:
    """The run the page shows: `?run=<name>` if that names a run found, else the one this session showed
    last, else the first; the choice is written back to the URL. None (with a message) when there is
    no run."""
    runs = {p.name: p for p in find_runs(run_folders())}
    if not runs:
        st.info("No runs found yet.")
        return None
    # A name from the URL is only ever looked up among the runs found, never joined to a path.
    wanted = st.query_params.get("run")
    if wanted is not None and wanted not in runs:
        st.error(f"No run named '{wanted}' here; choose one of the runs found.")
    # Without one in the URL (the sidebar's links carry none), the run last shown on any page.
    wanted = wanted or st.session_state.get(_RUN_KEY)
    names = sorted(runs)
    name = st.selectbox("run", names, index=names.index(wanted) if wanted in runs else 0)
    st.query_params["run"] = st.session_state[_RUN_KEY] = name
    return runs[name]


def choose_step_range(first: int, last: int) -> tuple[int, int]:
    """The steps the charts show, from a range slider: all of them until the user narrows it; a range
    that ends at the newest step keeps ending there as the run grows. A narrowed range is in the URL."""
    if first >= last:
        return first, last
    state = st.session_state
    if RANGE_KEY in state:
        lo, hi = state[RANGE_KEY]
        hi = last if hi == state.get(_NEWEST_KEY) else hi  # following the newest step
    else:
        lo, hi = _range_from_url() or (first, last)
    lo, hi = min(max(lo, first), last), min(max(hi, first), last)
    state[RANGE_KEY], state[_NEWEST_KEY] = (min(lo, hi), max(lo, hi)), last
    lo, hi = st.slider("steps", first, last, key=RANGE_KEY)
    if (lo, hi) == (first, last):
        st.query_params.pop(RANGE_KEY, None)
    else:
        st.query_params[RANGE_KEY] = f"{lo}-{hi}"
    return lo, hi


def _range_from_url() -> tuple[int, int] | None:
    lo, _, hi = st.query_params.get(RANGE_KEY, "").partition("-")
    return (int(lo), int(hi)) if lo.isdigit() and hi.isdigit() else None


# Shared by every session and refresh until the store changes (store_version): a finished run, or a run
# several people watch, is read once rather than by each of them every few seconds. A few entries only:
# a million-step range is about 100 MB.
@st.cache_resource(max_entries=6, ttl=600, show_spinner=False)
def read_run(run_dir: str, steps: tuple[int, int], version: tuple[int, ...]) -> RunData:
    return run_reader(run_dir).read(steps)


# What was read of each run, kept so that a live run's refresh reads only what its trainer appended since
# (a million-step run read whole took 16 s). Not expired: the next read would read the whole run again.
@st.cache_resource(max_entries=4, show_spinner=False)
def run_reader(run_dir: str) -> RunReader:
    return RunReader(run_dir, HEATMAP_BINS)


@st.fragment(run_every=REFRESH_S)
def _live_run(run_dir: Path) -> None:
    try:
        version, bounds = store_version(run_dir), step_bounds(run_dir)
        if bounds is None:
            st.info("No step recorded yet.")
            return
        steps = choose_step_range(*bounds)
        data = read_run(str(run_dir), steps, version)
    except (sqlite3.Error, FileNotFoundError) as e:
        st.warning(f"{run_dir}: cannot read its run store ({type(e).__name__}: {e}).")
        return
    markers = event_markers(data.events)
    _metric_charts(data.rows, markers, steps)
    _custom_charts(data.custom, data.custom_names, markers, steps)
    _rank_charts(data.ranks, straggler_marks(data.events, steps), steps)
    _slowest_ranks(data.rows)
    left, right = st.columns([2, 3])
    with left:
        _goodput_chart(data.goodput)
    with right:
        _checkpoints(run_dir, data.events)


def _metric_charts(rows: pd.DataFrame, markers: pd.DataFrame, steps: tuple[int, int]) -> None:
    shown = markers[markers.step.between(*steps)]
    effective = int((rows.segment == "effective").sum())
    st.caption(f"Steps {steps[0]:,} to {steps[1]:,}: {effective:,} in effect, {len(rows) - effective:,} abandoned by rollbacks "
               f"or restarts, {len(shown)} events marked; refreshed every {REFRESH_S:g} s.")  # fmt: skip
    # The loss at full width with the legends and every event; the other metrics below, small, sharing its
    # colours, with every event but the routine ones.
    titles = chart_titles()
    loss = metric_series(rows, "loss", grid=steps)
    draw([metric_chart(loss, shown, titles["loss"], steps, MARKER_COLOURS, 300, legend=True)], key="chart-loss")
    unusual = shown[~shown.kind.isin(ROUTINE_MARKERS)]
    small = [
        metric_chart(
            metric_series(rows, metric, grid=steps, buckets=SMALL_CHART_BUCKETS), unusual, title, steps, MARKER_COLOURS, 150, legend=False
        )
        for metric, title in titles.items()
        if metric != "loss"
    ]
    draw(small, key="chart-grid", columns=3)


def _custom_charts(custom: pd.DataFrame, names: tuple[str, ...], markers: pd.DataFrame, steps: tuple[int, int]) -> None:
    """The user's own metrics, as the small charts of Keel's: one per name the run reported, in or out
    of the range (a metric reported every thousand steps keeps its chart in a narrow range)."""
    if not names:
        return
    st.subheader("Your metrics")
    unusual = markers[markers.step.between(*steps) & ~markers.kind.isin(ROUTINE_MARKERS)]
    series = {name: custom_series(custom, name, grid=steps, buckets=SMALL_CHART_BUCKETS) for name in names}
    charts = [metric_chart(drawn, unusual, name, steps, MARKER_COLOURS, 150, legend=False) for name, drawn in series.items()]
    draw(charts, key="chart-custom", columns=3)


def _rank_charts(ranks: pd.DataFrame, stragglers: pd.DataFrame, steps: tuple[int, int]) -> None:
    st.subheader("Ranks")
    if ranks.empty:
        st.info("No per-rank metrics in this step range.")
        return
    st.caption(f"Mean per rank over up to {HEATMAP_BINS} step ranges; a straggler event is ringed in red; blank: not measured "
               "(communication is timed on sampled steps). The rank the others wait for has the least communication time.")  # fmt: skip
    heat, memory = st.columns([4, 1])
    with heat:
        heatmaps = []
        for metric, title in (("step_time_s", "step time (s)"), ("comm_time_s", "communication time (s)")):
            if ranks[metric].isna().all():  # an empty heatmap with a "NaN" colour scale reads as broken
                st.caption(f"{title}: not measured in this step range (a single process does not communicate).")
                continue
            heatmaps.append(rank_heatmap(ranks, stragglers, metric, title, steps, _rank_rows(ranks)))
        if heatmaps:  # no empty chart element: the page's drawn charts are what it shows
            draw(heatmaps, key="heatmaps")
    with memory:
        peak = ranks.groupby("rank", as_index=False).mem_peak_bytes.max()
        peak["GiB"] = peak.mem_peak_bytes.astype("float64") / 2**30
        draw([bar_chart(peak, "rank", "GiB", "peak GiB by rank", _rank_rows(ranks))], key="rank-memory")


def _slowest_ranks(rows: pd.DataFrame) -> None:
    """The ranks most often among the slowest few of the measured steps in effect: read from the step rows,
    it stays one small chart at any number of ranks, where the heatmaps above grow a row per rank."""
    counts = slowest_rank_counts(rows[rows.segment == "effective"])
    if counts.empty:
        return
    st.caption(f"The ranks most often among the {SLOWEST_RANKS} slowest by busy time (step minus communication), over the "
               "measured steps in effect of this range.")  # fmt: skip
    draw([bar_chart(counts.assign(rank=counts["rank"].astype(str)), "rank", "steps", "steps among the slowest", 20)], key="slowest-ranks")


def _rank_rows(ranks: pd.DataFrame) -> int:
    """Each rank's row height: 20 px, smaller for many ranks so that the heatmap stays on a screen."""
    return max(4, min(20, 480 // ranks["rank"].nunique()))


def _goodput_chart(goodput: Goodput) -> None:
    st.subheader("Goodput")
    st.caption(f"{goodput.goodput:.1%} of {goodput.wall_s:,.0f} s of wall time went to steps that count.")
    parts = pd.DataFrame({"where": ["productive", *goodput.lost_s], "seconds": [goodput.productive_s, *goodput.lost_s.values()]})
    draw([bar_chart(parts, "where", "seconds", "where the time went (s)", 24)], key="goodput")


@st.cache_data(max_entries=1024, show_spinner=False)
def _verified(path: str, manifest_mtime_ns: int) -> str | None:
    """A checkpoint's verification, hashed once per manifest (a rewritten checkpoint has a new one)."""
    return verify(Path(path))


def _verify_cached(path: Path) -> str | None:
    try:
        return _verified(str(path), (path / MANIFEST).stat().st_mtime_ns)
    except FileNotFoundError:
        return verify(path)


def _checkpoints(run_dir: Path, events: pd.DataFrame) -> None:
    st.subheader("Checkpoints")
    table = checkpoint_table(run_dir, events, _verify_cached)
    if table.empty:
        st.info("No checkpoint saved yet.")
        return
    table["MiB"] = table.size_bytes.astype("float64") / 2**20
    shown = table[["step", "attempt", "folder", "MiB", "blocked_s", "write_s", "state"]]
    columns = {"MiB": st.column_config.NumberColumn(format="%.1f"), "blocked_s": st.column_config.NumberColumn("blocked (s)", format="%.3f"),
               "write_s": st.column_config.NumberColumn("written in (s)", format="%.2f")}  # fmt: skip
    st.dataframe(shown, hide_index=True, column_config=columns, key="checkpoints")


def _config(run_dir: Path) -> None:
    with st.expander("Resolved config"):
        path = run_dir / CONFIG_FILE
        if path.is_file():
            st.code(path.read_text(), language="toml")
        else:
            try:
                st.json(read_meta(run_dir).get("config", {}))
            except sqlite3.Error as e:
                st.warning(f"{run_dir}: no {CONFIG_FILE} and the run store cannot be read ({e}).")
