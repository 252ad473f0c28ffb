"""The Run page's charts as Vega-Lite specs (https://vega.github.io/vega-lite/docs/), plain dicts with
their data as named datasets, drawn by `st.vega_lite_chart`.

Plain dicts rather than Altair because the page builds thirteen charts on every live refresh, and
Altair's schema validation of each encoding took about 60 ms a chart: most of a refresh's server time
on a 100k-step run (the data, already downsampled, costs little). The specs are small and fixed, so
nothing here needs validating at run time; the tests read back what the browser is sent.
"""

from __future__ import annotations

import pandas as pd

STEP_AXIS = {"format": ",d", "tickMinStep": 1}  # steps are whole numbers: never "1.0"
EFFECTIVE_COLOUR = "#1f77b4"
ABANDONED_COLOURS = ["#d62728", "#ff7f0e", "#8c564b", "#e377c2"]  # one per abandoned attempt, cycled
# Every chart's value labels take the same width, so the small multiples' plots line up in columns; a
# constant series reads "0.41", not Vega's "0.410000".
Y_AXIS = {"format": ",~r", "minExtent": 56, "maxExtent": 56}
LEGEND_BELOW = {"legend": {"orient": "bottom", "columns": 8}}


def _step_x(steps: tuple[int, int], field: str = "step") -> dict:
    return {"field": field, "type": "quantitative", "title": "step", "axis": STEP_AXIS,
            "scale": {"domain": list(steps), "nice": False}}  # fmt: skip


def _named(dataset: str) -> dict:
    """A dataset of the spec's "datasets", typed already (Arrow): no per-row parsing in the browser."""
    return {"name": dataset, "format": {"parse": None}}


def _tooltip(**fields: str) -> list[dict]:
    """Tooltip fields from name=Vega-Lite type ("quantitative", "nominal", "ordinal")."""
    return [{"field": name, "type": kind} for name, kind in fields.items()]


def metric_chart(series: pd.DataFrame, markers: pd.DataFrame, title: str, steps: tuple[int, int],
                 colours: dict[str, str], height: int, legend: bool) -> dict:  # fmt: skip
    """Lines per segment (series.metric_series: the effective trajectory solid blue, each abandoned
    attempt dashed in a warm colour, never joined) under a rule per event (series.event_markers),
    coloured by kind from `colours`, with the event's message on hover."""
    view = _metric_view("lines", series, markers, title, steps, colours, legend)
    spec = {**view, "height": height, "datasets": {"lines": series, "events": markers}}
    return {**spec, "config": LEGEND_BELOW} if legend else spec


def metric_grid(series: dict[str, pd.DataFrame], markers: pd.DataFrame, steps: tuple[int, int], colours: dict[str, str],
                width: int, height: int, columns: int) -> dict:  # fmt: skip
    """Small multiples: one metric_chart per title in `series`, without legends, `columns` to a row, in
    one Vega-Lite spec. One spec rather than one chart each because the browser's cost of a page grows
    with its charts (each is compiled, embedded and laid out on its own) more than with their points."""
    views = [{**_metric_view(f"lines-{i}", s, markers, title, steps, colours, legend=False), "width": width, "height": height}
             for i, (title, s) in enumerate(series.items())]  # fmt: skip
    datasets = {"events": markers, **{f"lines-{i}": s for i, s in enumerate(series.values())}}
    # Rows of hconcat in a vconcat: Streamlit sizes a wrapping "concat" to nothing (1.67).
    independent = {"scale": {"color": "independent", "strokeDash": "independent"}}
    rows = [{"hconcat": views[i : i + columns], "resolve": independent} for i in range(0, len(views), columns)]
    return {"datasets": datasets, "vconcat": rows, "resolve": independent}


def _metric_view(lines: str, series: pd.DataFrame, markers: pd.DataFrame, title: str, steps: tuple[int, int],
                 colours: dict[str, str], legend: bool) -> dict:  # fmt: skip
    """metric_chart's layers, drawing the dataset named `lines` under the dataset "events"."""
    segments = ["effective", *sorted(set(series.segment) - {"effective"})]
    segment_colours = [EFFECTIVE_COLOUR, *(ABANDONED_COLOURS[i % len(ABANDONED_COLOURS)] for i in range(len(segments) - 1))]
    kinds = [k for k in colours if k in set(markers.kind)] or list(colours)  # the legend lists those present
    shown = {} if legend else {"legend": None}
    rules = {
        "data": _named("events"),
        "mark": {"type": "rule", "opacity": 0.7, "aria": False},
        "encoding": {
            "x": _step_x(steps),
            "color": {
                "field": "kind",
                "type": "nominal",
                "title": "event",
                "scale": {"domain": kinds, "range": [colours[k] for k in kinds]},
                **shown,
            },
            "tooltip": _tooltip(
                kind="nominal", step="quantitative", attempt="nominal", rank="nominal", severity="nominal", message="nominal"
            ),
        },
    }
    line = {
        "data": _named(lines),
        "mark": {"type": "line", "strokeWidth": 1.5, "clip": True, "aria": False},
        "encoding": {
            "x": _step_x(steps),
            "y": {"field": "value", "type": "quantitative", "title": None, "scale": {"zero": False}, "axis": Y_AXIS},
            "color": {
                "field": "segment",
                "type": "nominal",
                "title": "trajectory",
                "scale": {"domain": segments, "range": segment_colours},
                **shown,
            },
            # By a scale, not a condition: Streamlit's Vega runs expressions in its (CSP-safe) interpreter, per row.
            "strokeDash": {
                "field": "segment",
                "type": "nominal",
                "legend": None,
                "scale": {"domain": segments, "range": [[1, 0]] + [[4, 3]] * (len(segments) - 1)},
            },
            "tooltip": _tooltip(segment="nominal", step="quantitative", value="quantitative"),
        },
    }
    return {"title": title, "layer": [rules, line], "resolve": {"scale": {"color": "independent"}}}


def rank_heatmap(ranks: pd.DataFrame, stragglers: pd.DataFrame, metric: str, title: str, steps: tuple[int, int],
                 row_px: int) -> dict:  # fmt: skip
    """One cell per rank and step range (monitor.store.read_rank_bins), coloured by the mean of
    `metric`; straggler events (series.straggler_marks) ringed in red."""
    cells = {
        "data": _named("cells"),
        "mark": {"type": "rect", "aria": False},
        "encoding": {
            "x": _step_x((steps[0], steps[1] + 1), "first_step"),
            "x2": {"field": "end_step"},
            "y": {"field": "rank", "type": "ordinal"},
            "color": {"field": metric, "type": "quantitative", "title": None, "scale": {"scheme": "viridis"}},
            "tooltip": _tooltip(
                rank="ordinal",
                first_step="quantitative",
                last_step="quantitative",
                step_time_s="quantitative",
                comm_time_s="quantitative",
                busy_time_s="quantitative",
            ),
        },
    }
    rings = {
        "data": _named("rings"),
        "mark": {"type": "point", "shape": "circle", "size": 120, "color": "#ff2d2d", "strokeWidth": 2.5, "aria": False},
        "encoding": {
            "x": {"field": "at", "type": "quantitative"},
            "y": {"field": "rank", "type": "ordinal"},
            "tooltip": _tooltip(step="quantitative", rank="ordinal", message="nominal"),
        },
    }
    datasets = {"cells": ranks.assign(end_step=ranks.last_step + 1), "rings": stragglers.assign(at=stragglers.step + 0.5)}
    return {"title": title, "height": {"step": row_px}, "datasets": datasets, "layer": [cells, rings]}


def bar_chart(frame: pd.DataFrame, label: str, label_type: str, value: str, title: str, row_px: int) -> dict:
    """Horizontal bars, one row of `row_px` pixels per label, in the frame's order."""
    y = {"field": label, "type": label_type, "sort": None, "title": None, "axis": {"labelOverlap": False}}
    return {
        "title": title, "height": {"step": row_px}, "datasets": {"bars": frame}, "data": {"name": "bars"}, "mark": {"type": "bar"},
        "encoding": {"y": y, "x": {"field": value, "type": "quantitative", "title": None},
                     "tooltip": _tooltip(**{label: label_type, value: "quantitative"})},
    }  # fmt: skip
