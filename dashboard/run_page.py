"""The Run page: one run's step metrics against step, refreshed live, with every event marked (hover for
what happened) and the attempts a rollback or restart abandoned drawn beside the effective trajectory."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import altair as alt
import pandas as pd
import streamlit as st

from keel.dashboard.runs_page import REFRESH_S, run_folders
from keel.dashboard.series import METRICS, event_markers, metric_series
from keel.monitor.runs import find_runs
from keel.monitor.store import read_events, read_steps


def render_run() -> None:
    st.title("Run")
    run_dir = choose_run()
    if run_dir is not None:
        _live_charts(run_dir)


def choose_run() -> Path | None:
    """The run the page shows: `?run=<name>` if that names a run found, else the first; the choice is
    written back to the URL. None (with a message) when there is no run."""
    runs = {p.name: p for p in find_runs(run_folders())}
    if not runs:
        st.info("No runs found yet.")
        return None
    # A name from the URL is only ever looked up among the runs found, never joined to a path.
    wanted = st.query_params.get("run")
    if wanted is not None and wanted not in runs:
        st.error(f"No run named '{wanted}' here; choose one of the runs found.")
    names = sorted(runs)
    name = st.selectbox("run", names, index=names.index(wanted) if wanted in runs else 0)
    st.query_params["run"] = name
    return runs[name]


@st.fragment(run_every=REFRESH_S)
def _live_charts(run_dir: Path) -> None:
    try:
        every, kept, events = read_steps(run_dir), read_steps(run_dir, effective=True), read_events(run_dir)
    except (sqlite3.Error, FileNotFoundError) as e:
        st.warning(f"{run_dir}: cannot read its run store ({type(e).__name__}: {e}).")
        return
    if every.empty:
        st.info("No step recorded yet.")
        return
    markers = event_markers(events)
    st.caption(f"{len(kept)} steps in effect, {len(every) - len(kept)} abandoned by rollbacks or restarts, {len(markers)} events marked.")
    # The loss at full width with the legends; the other metrics below, small, sharing its colours.
    st.altair_chart(metric_chart(metric_series(every, kept, "loss"), markers, METRICS["loss"], 300, legend=True), key="chart-loss")
    columns = st.columns(3)
    for i, (metric, title) in enumerate((m, t) for m, t in METRICS.items() if m != "loss"):
        with columns[i % 3]:
            st.altair_chart(metric_chart(metric_series(every, kept, metric), markers, title, 180, legend=False), key=f"chart-{metric}")


ABANDONED_COLOURS = ["#d62728", "#ff7f0e", "#8c564b", "#e377c2"]  # one per abandoned attempt, cycled


def metric_chart(series: pd.DataFrame, markers: pd.DataFrame, title: str, height: int, legend: bool) -> alt.LayerChart:
    """Lines per segment (the effective trajectory solid blue, each abandoned attempt dashed in a warm
    colour, never joined) under a rule per event, coloured by kind, with the event's message on hover."""
    segments = ["effective", *sorted(set(series.segment) - {"effective"})]
    colours = ["#1f77b4", *(ABANDONED_COLOURS[i % len(ABANDONED_COLOURS)] for i in range(len(segments) - 1))]
    show = {} if legend else {"legend": None}
    lines = (
        alt.Chart(series, title=title)
        .mark_line(strokeWidth=1.5)
        .encode(
            x=alt.X("step:Q", title="step"),
            y=alt.Y("value:Q", title=None, scale=alt.Scale(zero=False)),
            color=alt.Color("segment:N", scale=alt.Scale(domain=segments, range=colours), title="trajectory", **show),
            strokeDash=alt.condition(alt.datum.segment == "effective", alt.value([1, 0]), alt.value([4, 3])),
            tooltip=["segment", "step", "value"],
        )
    )
    rules = (
        alt.Chart(markers)
        .mark_rule(opacity=0.45)
        .encode(
            x="step:Q",
            color=alt.Color("kind:N", title="event", scale=alt.Scale(scheme="tableau20"), **show),
            tooltip=["kind", "step", "attempt", "rank", "severity", "message"],
        )
    )
    chart = alt.layer(rules, lines).resolve_scale(color="independent").properties(height=height)
    return chart.configure_legend(orient="bottom", columns=8) if legend else chart
