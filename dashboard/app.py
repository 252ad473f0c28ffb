"""The Streamlit app behind `keel dashboard`: one page per view, each with its own URL.

Started by `keel dashboard RUNS_DIR...` (keel.dashboard.launch), which hands the folders over in the
environment (KEEL_DASHBOARD_RUNS, os.pathsep-separated) because a Streamlit script has no arguments of
its own under `AppTest`. Reads runs through keel.monitor only.
"""

from __future__ import annotations

import streamlit as st

from keel.dashboard.compare_page import render_compare
from keel.dashboard.drills_page import render_drills
from keel.dashboard.events_page import render_events
from keel.dashboard.run_page import render_run
from keel.dashboard.runs_page import render_runs

st.set_page_config(page_title="Keel", layout="wide")
pages = [
    st.Page(render_runs, title="Runs", default=True),
    st.Page(render_run, title="Run", url_path="run"),
    st.Page(render_events, title="Events", url_path="events"),
    st.Page(render_drills, title="Drills", url_path="drills"),
    st.Page(render_compare, title="Compare", url_path="compare"),
]
st.navigation(pages, position="top").run()  # no sidebar: a narrow window keeps its width for the charts
