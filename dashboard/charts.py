"""The Run page's charts: line charts, rank x step heatmaps and bar charts as panels of plain data,
drawn by Keel's canvas chart element (chart.js, a Streamlit custom component without an iframe).

Why not Vega-Lite, Streamlit's own charts: the browser spent about 0.1 s on each Vega view (compiling
the spec, building its dataflow, running its expressions in Streamlit's CSP-safe interpreter), over a
second for the Run page's thirteen, whatever their points; a canvas draws the same points in
milliseconds. Each panel carries its data as frames of column arrays ("frames"), already downsampled,
which is also what the tests read back.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import streamlit as st

EFFECTIVE_COLOUR = "#1f77b4"
ABANDONED_COLOURS = ["#d62728", "#ff7f0e", "#8c564b", "#e377c2"]  # one per abandoned attempt, cycled
SOLID, DASHED = [], [4, 3]
CATEGORY10 = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
_CHART = st.components.v2.component("keel_chart", js=(Path(__file__).parent / "chart.js").read_text(), isolate_styles=False)


def draw(panels: list[dict], key: str, columns: int = 1) -> None:
    """Draw `panels` (from the functions below) `columns` to a row, filling the container's width."""
    _CHART(data={"columns": columns, "panels": panels}, key=key)


def _columns(frame: pd.DataFrame) -> dict[str, list]:
    """A frame as JSON column arrays, a missing value as null (JSON has no NaN)."""
    return {name: frame[name].to_numpy(dtype=object, na_value=None).tolist() for name in frame.columns}


def line_chart(series: pd.DataFrame, x: str, by: str, styles: dict[str, dict], title: str, height: int, *, x_title: str = "step",
               domain: tuple[float, float] | None = None, markers: pd.DataFrame | None = None, colours: dict[str, str] | None = None,
               legend: bool = False) -> dict:  # fmt: skip
    """One line per value of `by` (columns `x`, value, `by`), never joined to another, styled by
    `styles` ({"colour", "dash"} per line), under a vertical rule per row of `markers` (columns step,
    kind, attempt, rank, severity, message) coloured by kind from `colours`, the event on hover."""
    markers = pd.DataFrame(columns=["step", "kind"]) if markers is None else markers
    lo, hi = domain or ((series[x].min(), series[x].max()) if len(series) else (0, 1))
    panel = {"kind": "lines", "title": title, "height": height, "x": x, "by": by, "x_title": x_title, "steps": [float(lo), float(hi)],
             "segments": styles, "kinds": colours or {}, "frames": {"lines": _columns(series[[x, "value", by]]), "events": _columns(markers)}}  # fmt: skip
    if legend:  # the lines drawn, then the kinds of event present
        panel["legend"] = [
            {"label": n, "colour": s["colour"], "dashed": bool(s["dash"])} for n, s in styles.items() if n in set(series[by])
        ]
        panel["legend"] += [{"label": k, "colour": c, "dashed": False} for k, c in (colours or {}).items() if k in set(markers.kind)]
    return panel


def metric_chart(series: pd.DataFrame, markers: pd.DataFrame, title: str, steps: tuple[int, int], colours: dict[str, str],
                 height: int, legend: bool) -> dict:  # fmt: skip
    """A metric against step (series.metric_series): the effective trajectory solid blue, each abandoned
    attempt dashed in a warm colour, under the events (series.event_markers) coloured by kind."""
    names = ["effective", *sorted(set(series.segment) - {"effective"})]
    styles = {names[0]: {"colour": EFFECTIVE_COLOUR, "dash": SOLID}}
    styles |= {name: {"colour": ABANDONED_COLOURS[i % len(ABANDONED_COLOURS)], "dash": DASHED} for i, name in enumerate(names[1:])}
    return line_chart(series, "step", "segment", styles, title, height, domain=steps, markers=markers, colours=colours, legend=legend)


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
