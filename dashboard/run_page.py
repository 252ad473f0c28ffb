"""The Run page: one run, live. A header with its status (killed included), layout, progress and last
alert; every step metric against step, tokens or wall-clock time, smoothed or not, with every event
marked (events at one step grouped on one rule, a lasting fault as a band; hover for what happened) and the attempts a rollback or restart abandoned drawn beside the effective trajectory; the
ranks side by side (step and communication time per rank and step, stragglers picked out, memory);
goodput and where the rest of the time went; the checkpoints; the resolved config. Below Keel's own
metrics, a chart for each metric the user's training code reported (keel.monitor.custom_metrics), drawn
the same way; nothing when it reported none.

The charts show the step range of the slider above them (or of a drag across a chart), every step of it
when it is narrow enough (M4 keeps at most 4 points per pixel column), and the range is kept across
refreshes and in the URL.
"""

from __future__ import annotations

import dataclasses
import sqlite3
import time
from pathlib import Path

import pandas as pd
import streamlit as st

from keel.dashboard.charts import View, bar_chart, draw, metric_chart, rank_heatmap
from keel.dashboard.controls import choose_view
from keel.dashboard.run_data import RunData, RunReader
from keel.dashboard.runs_page import MISSING, REFRESH_S, run_folders, run_names
from keel.dashboard.series import (
    ROUTINE_MARKERS,
    chart_titles,
    custom_series,
    event_markers,
    marker_layers,
    marker_x,
    metric_series,
    run_origin,
    slowest_rank_counts,
    straggler_marks,
    with_x,
)
from keel.monitor.checkpoints import checkpoint_table, verify
from keel.monitor.goodput import Goodput
from keel.monitor.run_dir import CONFIG_FILE, MANIFEST
from keel.monitor.runs import summarize
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
    runs = run_names(run_folders())
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


_BADGES = {"running": "blue", "finished": "green", "stopped": "orange", "failed": "red", "killed": "red", "hung": "violet"}


def _header(run_dir: Path, data: RunData) -> None:
    """The run at a glance: its status (keel.monitor.runs; worked out at each refresh, as a killed run's
    store does not change), id, folder, layout, rank 0's host, start, last update, time left and last alert."""
    row = summarize(run_dir, data.every, data.events, data.meta, goodput=data.goodput)
    now = time.time()
    parts = [f":{_BADGES.get(row['status'], 'gray')}-badge[{row['status']}]", f"**{row['run_id']}**", f"`{run_dir}`"]
    parts += [row["layout"]] if row["layout"] else []
    if data.meta.get("rank0_host"):  # where the run store's writer and the exporter run (docs/cluster.md)
        parts.append(f"rank 0 on `{str(data.meta['rank0_host']).replace('`', '')}`")
    if row["started"] is not None:
        parts += [f"started {_clock(row['started'])}", f"last update {_ago(now - row['last_seen'])} ago"]
    if row["eta_s"] is not None:
        parts.append(f"ETA {_ago(row['eta_s'])}")
    st.markdown(" · ".join(parts))
    if row["last_alert"]:
        st.caption(f"Last alert ({_clock(row['last_alert_time'])}, {_ago(now - row['last_alert_time'])} ago): {row['last_alert']}")


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _ago(seconds: float) -> str:
    """A duration in its largest units: 40 s, 12 min, 3 h 20 min, 2 d 4 h."""
    s = max(0, round(seconds))
    for unit, size, smaller, small_size in (("d", 86400, "h", 3600), ("h", 3600, "min", 60)):
        if s >= size:
            return f"{s // size} {unit} {s % size // small_size} {smaller}"
    return f"{s // 60} min" if s >= 60 else f"{s} s"


def _zoom_to(chart_key: str) -> None:
    """A drag across a chart (or a double-click: every step) sets the step range, before the rerun draws it."""
    chosen = st.session_state[chart_key]["zoom"]
    st.session_state[RANGE_KEY] = (0, 2**62) if chosen == "all" else (int(chosen[0]), int(chosen[1]))  # clamped to the run's steps


@st.fragment(run_every=REFRESH_S)
def _live_run(run_dir: Path) -> None:
    try:
        version, bounds = store_version(run_dir), step_bounds(run_dir)
        if bounds is None:
            st.info("No step recorded yet.")
            return
        header = st.container()  # above the controls; filled once the run is read
        view = choose_view("run", zoom=True)
        steps = choose_step_range(*bounds)
        data = read_run(str(run_dir), steps, version)
    except (sqlite3.Error, FileNotFoundError) as e:
        st.warning(f"{run_dir}: cannot read its run store ({type(e).__name__}: {e}).")
        return
    with header:
        _header(run_dir, data)
    if view.axis == "tokens" and not data.rows.tokens.gt(0).any():
        st.caption("This run recorded no tokens (a loop opened without tokens_per_step): drawn by step.")
        view = dataclasses.replace(view, axis="step")
    origin = run_origin(data.rows, data.events)
    rows = with_x(data.rows, view.axis, origin)
    markers = event_markers(data.events)
    markers = markers[markers.step.between(*steps)]
    markers = markers.assign(x=marker_x(markers, rows, view.axis, origin))
    domain = _domain(rows, markers, steps, view)
    # Every event on the loss chart; the others without the routine ones (a checkpoint every few hundred
    # steps would hide the small charts' lines).
    every_event = marker_layers(markers, domain)
    unusual = marker_layers(markers[~markers.kind.isin(ROUTINE_MARKERS)], domain)
    ranks = data.ranks["rank"].nunique() if len(data.ranks) else 0
    _metric_charts(rows, len(markers), every_event, unusual, steps, view, domain, communicates=ranks > 1)
    _custom_charts(data.custom, data.custom_names, rows, unusual, view, domain)
    _rank_charts(data.ranks, straggler_marks(data.events, steps), steps)
    _slowest_ranks(data.rows, ranks)
    left, right = st.columns([2, 3])
    with left:
        _goodput_chart(data.goodput)
    with right:
        _checkpoints(run_dir, data.events)


def _domain(rows: pd.DataFrame, markers: pd.DataFrame, steps: tuple[int, int], view: View) -> tuple[float, float]:
    """The charts' x extent: the step range, or on the tokens and time axes what its rows and events span."""
    if view.axis == "step" or rows.x.isna().all():
        return float(steps[0]), float(steps[1])
    xs = pd.concat([rows.x, markers.x]).dropna()
    return float(xs.min()), float(xs.max())


Layers = tuple[pd.DataFrame, pd.DataFrame]  # series.marker_layers: (rules, bands)


def _metric_charts(rows: pd.DataFrame, marked: int, every_event: Layers, unusual: Layers, steps: tuple[int, int], view: View,
                   domain: tuple[float, float], communicates: bool) -> None:  # fmt: skip
    effective = int((rows.segment == "effective").sum())
    st.caption(f"Steps {steps[0]:,} to {steps[1]:,}: {effective:,} in effect, {len(rows) - effective:,} abandoned by rollbacks "
               f"or restarts, {marked} events marked; drag across a chart to zoom, double-click for every step; "
               f"refreshed every {REFRESH_S:g} s.")  # fmt: skip
    # The loss at full width with the legends and every event; the other metrics below, small, sharing its
    # colours, with the unusual events. A metric the run never recorded in the range (a
    # validation loss without evaluation) gets no empty chart, nor does one process's communication share
    # (always 0: it does not communicate).
    titles = chart_titles()
    loss = metric_series(rows, "loss", domain, smoothing=view.smoothing)
    draw([metric_chart(loss, titles["loss"], 300, view, domain, every_event, legend=True)], key="chart-loss",
         on_zoom=lambda: _zoom_to("chart-loss"))  # fmt: skip
    small = [
        metric_chart(
            metric_series(rows, metric, domain, SMALL_CHART_BUCKETS, view.smoothing), title, 150, view, domain, unusual, legend=False
        )
        for metric, title in titles.items()
        if metric != "loss" and rows[metric].notna().any() and (communicates or metric != "comm_share")
    ]
    draw(small, key="chart-grid", columns=3, on_zoom=lambda: _zoom_to("chart-grid"))


def _custom_charts(custom: pd.DataFrame, names: tuple[str, ...], rows: pd.DataFrame, unusual: Layers, view: View,
                   domain: tuple[float, float]) -> None:  # fmt: skip
    """The user's own metrics, as the small charts of Keel's: one per name the run reported, in or out
    of the range (a metric reported every thousand steps keeps its chart in a narrow range)."""
    if not names:
        return
    st.subheader("Your metrics")
    series = {name: custom_series(custom, rows, name, domain, SMALL_CHART_BUCKETS, view.smoothing) for name in names}
    charts = [metric_chart(drawn, name, 150, view, domain, unusual, legend=False) for name, drawn in series.items()]
    draw(charts, key="chart-custom", columns=3, on_zoom=lambda: _zoom_to("chart-custom"))


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


def _slowest_ranks(rows: pd.DataFrame, ranks: int) -> None:
    """The ranks most often among the slowest few of the measured steps in effect: read from the step rows,
    it stays one small chart at any number of ranks, where the heatmaps above grow a row per rank. Not
    drawn with SLOWEST_RANKS ranks or fewer: every rank is then among the slowest at every step."""
    counts = slowest_rank_counts(rows[rows.segment == "effective"])
    if counts.empty or ranks <= SLOWEST_RANKS:
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
    # A removed checkpoint's size is not known: an empty cell (Streamlit's default is the text "None").
    st.dataframe(shown, hide_index=True, column_config=columns, key="checkpoints", placeholder=MISSING)


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
