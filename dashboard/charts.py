"""The Run page's charts: line charts, rank x step heatmaps and bar charts as panels of plain data,
drawn by Keel's canvas chart element (chart.js, a Streamlit custom component without an iframe).

Why not Vega-Lite, Streamlit's own charts: the browser spent about 0.1 s on each Vega view (compiling
the spec, building its dataflow, running its expressions in Streamlit's CSP-safe interpreter), over a
second for the Run page's thirteen, whatever their points; a canvas draws the same points in
milliseconds. Each panel carries its data as frames of column arrays ("frames"), already downsampled,
which is also what the tests read back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import streamlit as st

from keel.dashboard.series import AXES, MARKER_COLOURS

EFFECTIVE_COLOUR = "#1f77b4"
ABANDONED_COLOURS = ["#d62728", "#ff7f0e", "#8c564b", "#e377c2"]  # one per abandoned attempt, cycled
SOLID, DASHED = [], [4, 3]
CATEGORY10 = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
_CHART = st.components.v2.component("keel_chart", js=(Path(__file__).parent / "chart.js").read_text(), isolate_styles=False)


@dataclass(frozen=True)
class View:
    """How the line charts are drawn, as the page's controls set it: the x axis (series.AXES), the
    smoothing weight (0: none), a log-scale y, and whether a drag on a chart asks for its step range."""

    axis: str = "step"
    smoothing: float = 0.0
    log_y: bool = False
    zoom: bool = False


def draw(panels: list[dict], key: str, columns: int = 1, on_zoom: Callable[[], None] | None = None) -> None:
    """Draw `panels` (from the functions below) up to `columns` to a row (fewer in a narrow window),
    filling the container's width. With `on_zoom`, a drag across a chart or a double-click on it calls
    it, st.session_state[key]["zoom"] holding the steps chosen ([first, last], or "all": every step)."""
    callbacks = {} if on_zoom is None else {"on_zoom_change": on_zoom}
    _CHART(data={"columns": columns, "panels": panels}, key=key, **callbacks)


def _columns(frame: pd.DataFrame) -> dict[str, list]:
    """A frame as JSON column arrays, a missing or infinite value as null: JSON has neither NaN nor Infinity,
    and the browser refuses the whole chart for one (an Inf loss is a gap; its `nonfinite` event marks it)."""
    frame = frame.replace([math.inf, -math.inf], math.nan)
    return {name: frame[name].to_numpy(dtype=object, na_value=None).tolist() for name in frame.columns}


def line_chart(series: pd.DataFrame, by: str, styles: dict[str, dict], title: str, height: int, view: View,
               domain: tuple[float, float], layers: tuple[pd.DataFrame, pd.DataFrame] | None = None, legend: bool = False) -> dict:  # fmt: skip
    """One line per value of `by` (columns x, step, value, `by`, and smooth when smoothed), never joined
    to another, styled by `styles` ({"colour", "dash"} per line), over the x extent `domain`, under the
    events (series.marker_layers: a rule per group of events listing them on hover, a band per lasting fault)."""
    rules, bands = layers if layers is not None else (pd.DataFrame(columns=["x"]), pd.DataFrame(columns=["x0"]))
    panel = {"kind": "lines", "title": title, "height": height, "by": by, "x_title": AXES[view.axis],
             "x_format": "duration" if view.axis == "time" else "number", "domain": [float(domain[0]), float(domain[1])],
             "smoothed": "smooth" in series, "log_y": view.log_y, "zoom": view.zoom, "segments": styles,
             "frames": {"lines": _columns(series), "rules": _columns(rules), "bands": _columns(bands)}}  # fmt: skip
    if legend:  # the lines drawn, then the kinds of event present; a click on one hides or shows it
        drawn = set(series[by])
        panel["legend"] = [{"label": n, "colour": s["colour"], "dashed": bool(s["dash"])} for n, s in styles.items() if n in drawn]
        kinds = dict.fromkeys([k for ks in rules.get("kinds", []) for k in ks] + list(bands.get("kind", [])))
        panel["legend"] += [{"label": k, "colour": MARKER_COLOURS[k], "dashed": False} for k in kinds]
    return panel


def metric_chart(series: pd.DataFrame, title: str, height: int, view: View, domain: tuple[float, float],
                 layers: tuple[pd.DataFrame, pd.DataFrame] | None, legend: bool) -> dict:  # fmt: skip
    """A metric of one run (series.metric_series): the effective trajectory solid blue, each abandoned
    attempt dashed in a warm colour, under the run's events."""
    names = ["effective", *sorted(set(series.segment) - {"effective"})]
    styles = {names[0]: {"colour": EFFECTIVE_COLOUR, "dash": SOLID}}
    styles |= {name: {"colour": ABANDONED_COLOURS[i % len(ABANDONED_COLOURS)], "dash": DASHED} for i, name in enumerate(names[1:])}
    return line_chart(series, "segment", styles, title, height, view, domain, layers, legend)


def rank_heatmap(ranks: pd.DataFrame, stragglers: pd.DataFrame, metric: str, title: str, steps: tuple[int, int], row_px: int) -> dict:
    """One cell per rank and step range (monitor.store.read_rank_bins), coloured by the mean of
    `metric`; straggler events (series.straggler_marks) ringed in red."""
    hover = ["step_time_s", "comm_time_s", "busy_time_s"]
    return {"kind": "heatmap", "title": title, "metric": metric, "steps": list(steps), "hover": [h for h in hover if h in ranks],
            "ranks": sorted(ranks["rank"].unique().tolist()), "height": max(40, row_px * ranks["rank"].nunique()),  # room for its colour key
            "frames": {"cells": _columns(ranks), "rings": _columns(stragglers)}}  # fmt: skip


def bar_chart(frame: pd.DataFrame, label: str, value: str, title: str, row_px: int) -> dict:
    """Horizontal bars, one row of `row_px` pixels per label, in the frame's order."""
    return {"kind": "bars", "title": title, "label": label, "value": value, "height": row_px * len(frame),
            "frames": {"bars": _columns(frame[[label, value]])}}  # fmt: skip
