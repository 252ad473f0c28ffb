"""The Compare page: runs overlaid, a chart per metric chosen, aligned by step, tokens trained on or
wall-clock time, with each run's events marked; each run downsampled with M4 on one shared grid so that a
spike in any of them stays visible. The runs can be narrowed by name and status. The runs, metrics and
alignment are in the URL."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pandas as pd
import streamlit as st

from keel.dashboard.charts import CATEGORY10, SOLID, View, draw, line_chart
from keel.dashboard.controls import choose_view
from keel.dashboard.runs_page import REFRESH_S, run_folders, run_names
from keel.dashboard.series import (
    AXES,
    ROUTINE_MARKERS,
    chart_titles,
    compare_series,
    event_markers,
    marker_layers,
    marker_x,
    run_origin,
    with_x,
)
from keel.monitor.runs import summarize_run
from keel.monitor.store import read_events, read_steps


def render_compare() -> None:
    st.title("Compare runs")
    runs = run_names(run_folders())
    if not runs:
        st.info("No runs found yet.")
        return
    asked = st.query_params.get_all("run")
    unknown = [r for r in asked if r not in runs]  # names from the URL are only looked up, never joined to a path
    if unknown:
        st.error(f"No run named {', '.join(repr(r) for r in unknown)} here; choose among the runs found.")
    offered = _filtered(runs)
    kept = [r for r in asked if r in runs]
    chosen = st.multiselect("runs", sorted(set(offered) | set(kept)), default=kept or sorted(offered)[:2], key="compare-runs")
    st.query_params["run"] = chosen
    metrics = _chosen_metrics()
    view = choose_view("compare", zoom=False)
    if chosen and metrics:
        _live_compare({name: runs[name] for name in chosen}, metrics, view)


def _filtered(runs: dict[str, Path]) -> list[str]:
    """The run names offered: those whose name holds the text typed and whose status is among those ticked."""
    by_name, by_status = st.columns([2, 3])
    with by_name:
        text = st.text_input("filter runs by name", value=st.query_params.get("filter", ""), key="compare-filter").strip()
    statuses = {name: _status(str(path)) for name, path in runs.items()}
    with by_status:
        wanted = st.multiselect("status", sorted(set(statuses.values())), placeholder="any", key="compare-status")
    _keep("filter", text)
    return [n for n in runs if text.lower() in n.lower() and (not wanted or statuses[n] in wanted)]


@st.cache_data(ttl=REFRESH_S, show_spinner=False)
def _status(run_dir: str) -> str:
    return summarize_run(run_dir)["status"]


def _chosen_metrics() -> list[str]:
    titles = chart_titles()
    asked = [m for m in st.query_params.get_all("metric") if m in titles] or ["loss"]
    metrics = st.multiselect("metrics", list(titles), default=asked, format_func=titles.get, key="compare-metrics")
    st.query_params["metric"] = metrics
    return metrics


def _keep(name: str, value: str) -> None:
    if value:
        st.query_params[name] = value
    else:
        st.query_params.pop(name, None)


@st.fragment(run_every=REFRESH_S)
def _live_compare(runs: dict[str, Path], metrics: list[str], view: View) -> None:
    kept, markers = {}, []
    for name, run_dir in runs.items():
        try:
            rows, events = read_steps(run_dir, effective=True), read_events(run_dir)
        except (sqlite3.Error, FileNotFoundError) as e:
            st.warning(f"{name}: cannot read its run store ({type(e).__name__}: {e}); the other runs are shown.")
            continue
        origin = run_origin(rows, events)
        kept[name] = with_x(rows, view.axis, origin)
        markers.append(_run_markers(name, events, kept[name], view, origin))
    xs = pd.concat([rows.x for rows in kept.values()]).dropna() if kept else pd.Series(dtype="float64")
    domain = (float(xs.min()), float(xs.max())) if len(xs) else (0.0, 1.0)  # every run's, so the charts line up
    layers = marker_layers(pd.concat(markers, ignore_index=True), domain) if markers else None
    styles = {name: {"colour": CATEGORY10[i % len(CATEGORY10)], "dash": SOLID} for i, name in enumerate(runs)}  # distinct hues
    titles = chart_titles()
    panels = []
    for metric in metrics:
        series = compare_series(kept, metric, smoothing=view.smoothing)
        panels.append(line_chart(series, "run", styles, f"{titles[metric]} by {AXES[view.axis]}", 360, view, domain, layers, legend=True))
    draw(panels, key="compare-chart")
    st.caption(f"{len(kept)} runs, effective trajectories (what rollbacks and restarts kept), their events marked (hover a rule: "
               f"which run, what happened); refreshed every {REFRESH_S:g} s.")  # fmt: skip


def _run_markers(name: str, events: pd.DataFrame, rows: pd.DataFrame, view: View, origin: float) -> pd.DataFrame:
    """One run's events but the routine ones, on the chosen axis, each message naming the run."""
    markers = event_markers(events)
    markers = markers[~markers.kind.isin(ROUTINE_MARKERS)]
    return markers.assign(x=marker_x(markers, rows, view.axis, origin), run=name, message=name + ": " + markers.message)
