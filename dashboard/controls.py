"""The line charts' controls, shared by the Run and Compare pages: the x axis (step, tokens or wall-clock
time), the smoothing (an exponential moving average, as W&B and TensorBoard offer) and a log-scale y.
Each is kept in the URL, so a view can be shared as a link, and in the session, so that it survives a
visit to another page (as W&B keeps a workspace's smoothing)."""

from __future__ import annotations

import streamlit as st

from keel.dashboard.charts import View
from keel.dashboard.series import AXES

SMOOTHING_MAX = 0.99  # TensorBoard's slider stops there: at 1 the average never moves


def choose_view(prefix: str, zoom: bool) -> View:
    """The controls, in one row, as a View (`zoom`: the page takes a drag's step range). Their state is
    kept under `prefix` in the session and as ?x=, ?smooth= and ?log= in the URL."""
    kept: View = st.session_state.get(f"{prefix}-view", View())
    axis_column, smooth_column, log_column = st.columns([3, 3, 1])
    with axis_column:
        asked = st.query_params.get("x", kept.axis)
        axis = st.radio("x axis", list(AXES), index=list(AXES).index(asked) if asked in AXES else 0, format_func=AXES.get,
                        horizontal=True, key=f"{prefix}-x")  # fmt: skip
    with smooth_column:
        smoothing = st.slider("smoothing", 0.0, SMOOTHING_MAX, _smoothing_from_url(kept.smoothing), step=0.01, key=f"{prefix}-smooth",
                              help="An exponential moving average of each line; the raw line stays, faint, behind it.")  # fmt: skip
    with log_column:
        log_y = st.toggle("log y", value=st.query_params.get("log", "1" if kept.log_y else "0") == "1", key=f"{prefix}-log")
    _keep_in_url("x", axis, axis != "step")
    _keep_in_url("smooth", f"{smoothing:g}", smoothing > 0)
    _keep_in_url("log", "1", log_y)
    view = st.session_state[f"{prefix}-view"] = View(axis, smoothing, log_y, zoom)
    return view


def _smoothing_from_url(kept: float) -> float:
    try:
        return min(max(float(st.query_params.get("smooth", kept)), 0.0), SMOOTHING_MAX)
    except ValueError:  # a hand-edited URL: no smoothing rather than an error
        return 0.0


def _keep_in_url(name: str, value: str, keep: bool) -> None:
    if keep:
        st.query_params[name] = value
    else:
        st.query_params.pop(name, None)
