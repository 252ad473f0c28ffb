"""The Events page: one run's events and alerts as a timeline, newest first, filtered by kind,
severity, rank and attempt (the filters are in the URL, so a filtered view can be shared)."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pandas as pd
import streamlit as st

from keel.dashboard.run_page import choose_run
from keel.dashboard.runs_page import REFRESH_S
from keel.monitor.store import read_events

FILTERS = ("kind", "severity", "rank", "attempt")


def render_events() -> None:
    st.title("Events and alerts")
    run_dir = choose_run()
    if run_dir is not None:
        _live_events(run_dir)


@st.fragment(run_every=REFRESH_S)
def _live_events(run_dir: Path) -> None:
    try:
        table = event_table(read_events(run_dir))
    except (sqlite3.Error, FileNotFoundError) as e:
        st.warning(f"{run_dir}: cannot read its run store ({type(e).__name__}: {e}).")
        return
    chosen = {}
    for column, name in zip(st.columns(len(FILTERS)), FILTERS):
        with column:
            choices = sorted(table[name].unique(), key=str)
            wanted = [v for v in st.query_params.get_all(name) if v in choices]
            chosen[name] = st.multiselect(name, choices, default=wanted, placeholder="all", key=f"filter-{name}")
            st.query_params[name] = chosen[name]
    shown = filter_events(table, chosen)
    st.caption(f"{len(shown)} of {len(table)} events; refreshed every {REFRESH_S:g} s.")
    st.dataframe(shown, hide_index=True, height=min(36 * (len(shown) + 1) + 2, 900))  # whole up to ~24 rows, then it scrolls


def event_table(events: pd.DataFrame) -> pd.DataFrame:
    """The events as text a person filters and reads: when, step, attempt, rank ("all" for the job), kind,
    severity, message; newest first."""
    table = pd.DataFrame(
        {
            "time": events.time.map(lambda t: time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))),
            "step": events.step.astype("string").fillna("-"),
            "attempt": events.attempt.astype("string").fillna("-"),
            "rank": events["rank"].astype("string").fillna("all"),
            "kind": events.kind,
            "severity": events.severity,
            "message": events.message,
        }
    )
    return table.iloc[::-1].reset_index(drop=True)


def filter_events(table: pd.DataFrame, chosen: dict[str, list[str]]) -> pd.DataFrame:
    """Rows matching every filter that has a choice (an empty choice lets everything through)."""
    keep = pd.Series(True, index=table.index)
    for name, values in chosen.items():
        if values:
            keep &= table[name].isin(values)
    return table[keep]
