"""The Compare page: two or more runs overlaid on one chart, aligned by step or by tokens trained on,
each downsampled with M4 on one shared grid so that a spike in any of them stays visible. The runs, the
metric and the alignment are in the URL."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import streamlit as st

from keel.dashboard.charts import CATEGORY10, SOLID, draw, line_chart
from keel.dashboard.runs_page import REFRESH_S, run_folders
from keel.dashboard.series import chart_titles, compare_series
from keel.monitor.runs import find_runs
from keel.monitor.store import read_steps

ALIGN = {"step": "step", "tokens_seen": "tokens trained on"}


def render_compare() -> None:
    st.title("Compare runs")
    runs = {p.name: p for p in find_runs(run_folders())}
    if not runs:
        st.info("No runs found yet.")
        return
    asked = st.query_params.get_all("run")
    unknown = [r for r in asked if r not in runs]  # names from the URL are only looked up, never joined to a path
    if unknown:
        st.error(f"No run named {', '.join(repr(r) for r in unknown)} here; choose among the runs found.")
    chosen = st.multiselect("runs", sorted(runs), default=[r for r in asked if r in runs] or sorted(runs)[:2], key="compare-runs")
    titles = chart_titles()
    metric = _choice("metric", list(titles), titles)
    align = _choice("by", list(ALIGN), ALIGN, label="align by")
    st.query_params["run"] = chosen
    if chosen:
        _live_compare({name: runs[name] for name in chosen}, metric, align)


def _choice(param: str, options: list[str], names: dict[str, str], label: str | None = None) -> str:
    """A radio choice kept in the URL under `param`."""
    asked = st.query_params.get(param)
    choice = st.radio(label or param, options, index=options.index(asked) if asked in options else 0, format_func=names.get,
                      horizontal=True, key=f"compare-{param}")  # fmt: skip
    st.query_params[param] = choice
    return choice


@st.fragment(run_every=REFRESH_S)
def _live_compare(runs: dict[str, Path], metric: str, align: str) -> None:
    kept = {}
    for name, run_dir in runs.items():
        try:
            kept[name] = read_steps(run_dir, effective=True)
        except (sqlite3.Error, FileNotFoundError) as e:
            st.warning(f"{name}: cannot read its run store ({type(e).__name__}: {e}); the other runs are shown.")
    series = compare_series(kept, metric, align)
    styles = {name: {"colour": CATEGORY10[i % len(CATEGORY10)], "dash": SOLID} for i, name in enumerate(runs)}  # distinct hues
    draw(
        [line_chart(series, "x", "run", styles, f"{chart_titles()[metric]} by {ALIGN[align]}", 420, x_title=ALIGN[align], legend=True)],
        key="compare-chart",
    )
    st.caption(f"{len(kept)} runs, effective trajectories (what rollbacks and restarts kept); refreshed every {REFRESH_S:g} s.")
